/* GGUF Q4_K rows repacked in groups of 8 (poly.runtime.repack.repack8k) for the fused step's
 * decode rows in the auto mode (the prompt panels are built from them too: formats/kquant_interleave8_panels.h): one
 * 32-bit vector lane per weight row, so a sub-block's integer dot product lands in its row's lane
 * and no row needs a horizontal sum or its own scale unpack.
 * Why: the stored rows' decode (formats/kquant_rows.h k8_tile_k, one row at a time: 6-bit scales unpacked,
 * shuffled per sub-block, a horizontal sum a row) was compute-bound on AVX2 without VNNI (Zen 3
 * 1B Q4_K_M decode at 0.7 of the read bandwidth, level with llama.cpp's repacked Q4_K).
 * Record per 8 rows and 256-element super-block (KIL8_REC bytes, +2.8 % of the stored 8 x 144):
 *     [0, 16)     D[8] float16 (each row's d)     [16, 32)  Dmin[8] float16
 *     [32, 96)    scales: byte 8 j + r = sub-block j's 6-bit scale of row r
 *     [96, 160)   mins: byte 16 i + 2 r + e = the min of sub-block 2 i + e of row r
 *     [160, 1184) codes: vector 8 i + t (32 bytes), byte 4 r + b = stored code byte 32 i + 4 t + b
 *                 of row r (low nibble: element 64 i + 4 t + b, high: 64 i + 32 + 4 t + b)
 * x is the auto mode's codes per 256 (core/activations.h quantize_k: xk, dk). The integer sums are k8_tile_k's
 * exactly (sum of s * u * xc and of the mins times x's code sums, int32) and the float steps the
 * same formula once a super-block, per row in its lane.
 * Q6_K rows by 8 (KIL8Q6_REC bytes, the stored 8 x 210: no bigger; the output head of most Q4_K_M,
 * Q5_K_M and Q3_K_M files and a fifth of the 1B Q4_K_M body), the 6-bit codes in natural order:
 *     [0, 16)       D[8] float16            [16, 144)  scales: byte 16 i + 2 r + e = the int8
 *                                                      scale of 16-group 2 i + e of row r
 *     [144, 1680)   16-group j in vectors 3 j + k (k < 3): byte 4 r + b = the code of element
 *                   16 j + 4 k + b of row r in bits 0-5, and in bits 6-7 bits 4 - 2 k, 5 - 2 k
 *                   of the code of element 16 j + 12 + b
 * value = D s (u - 32) as formats/kquant_rows.h takes it: the offsets 32 D s meet x's code sums per 16. Why three
 * vectors per four codes: a group's codes come out in 11 vector ops, where the stored ql/qh split
 * (a nibble vector and a 2-bit vector per code vector) took 17 (Zen 3, 2 threads, Q6_K matrices
 * decode 20.0 -> 21.7 GB/s). */
#ifndef POLY_FORMATS_KQUANT_INTERLEAVE8_H
#define POLY_FORMATS_KQUANT_INTERLEAVE8_H
#include "core/common.h"
#include "formats/kinds.h"
#include "core/prefetch.h"
#include "formats/kquant_interleave8_panels.h"

/* KIL8_REC, KIL8Q6_REC: formats/kquant_interleave8_panels.h (the prompt panels rebuild the stored bytes from the records) */
/* each super-block asks for the records two ahead (Zen 3 1B Q4_K_M decode, alternating builds:
 * 22.1-24.3 -> 23.5-24.4 tok/s; four ahead no better) */
#ifndef KIL8_PF
#define KIL8_PF (2 * KIL8_REC)
#endif

#if PK_SIMD
/* input c's min pairs: word 4 sb + i = (sum of x's codes over sub-block 2 i, over 2 i + 1) as
 * two int16 (|.| <= 32 * 127), the pair vpmaddwd meets with a row's two mins */
static inline void kil8_xpairs(const mm_args *A, int64_t c, int64_t nsb, int32_t *xp) {
    for (int64_t sb = 0; sb < nsb; sb++) {
        const int16_t *s = (const int16_t *)(A->xk + (c * nsb + sb) * XK_BYTES + 256);
        for (int i = 0; i < 4; i++) {
            const uint16_t a = (uint16_t)(s[4 * i] + s[4 * i + 1]), b = (uint16_t)(s[4 * i + 2] + s[4 * i + 3]);
            xp[4 * sb + i] = (int32_t)((uint32_t)a | (uint32_t)b << 16);
        }
    }
}

/* the 8 rows of group g x input c: 8 float lanes (row r in lane r) */
static inline __attribute__((always_inline)) __m256 kil8_group(const mm_args *A, const uint8_t *rk, int64_t g, int64_t c,
                                                              int64_t nsb, const int32_t *xp) {
    const __m256i m15 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    const uint8_t *R = rk + g * nsb * KIL8_REC;
    for (int64_t sb = 0; sb < nsb; sb++, R += KIL8_REC) {
#if KIL8_PF
        for (int l = 0; l < KIL8_REC; l += 64) prefetch_line((const char *)R + KIL8_PF + l);
#endif
        const int8_t *x = A->xk + (c * nsb + sb) * XK_BYTES;
        __m256i isum = _mm256_setzero_si256(), io = isum;
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            __m256i p0 = _mm256_setzero_si256(), p1 = p0; /* int16: 8 pairs <= 30,480 */
#pragma GCC unroll 8
            for (int t = 0; t < 8; t++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(R + 160 + (8 * i + t) * 32));
                int32_t a, b;
                memcpy(&a, x + 64 * i + 4 * t, 4);
                memcpy(&b, x + 64 * i + 32 + 4 * t, 4);
                p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(_mm256_and_si256(v, m15), _mm256_set1_epi32(a)));
                p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), m15), _mm256_set1_epi32(b)));
                __asm__("" : "+x"(p0), "+x"(p1)); /* one chain each (GCC's add trees spill) */
            }
            const __m256i s0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(R + 32 + 16 * i)));
            const __m256i s1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(R + 40 + 16 * i)));
            isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(_mm256_madd_epi16(p0, ones), s0));
            isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(_mm256_madd_epi16(p1, ones), s1));
            const __m256i mn = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(R + 96 + 16 * i)));
            io = _mm256_add_epi32(io, _mm256_madd_epi16(mn, _mm256_set1_epi32(xp[4 * sb + i])));
        }
        const __m256 d = _mm256_set1_ps(A->dk[c * nsb + sb]);
        const __m256 D = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)R)), d);
        const __m256 M = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(R + 16))), d);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), D, acc);
        acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(io), M, acc);
    }
    return acc;
}

/* Q6_K: the 8 rows of group g x input c (row r in lane r) */
static inline __attribute__((always_inline)) __m256 kil8q6_group(const mm_args *A, const uint8_t *rk, int64_t g, int64_t c,
                                                               int64_t nsb) {
    /* a pair's scales as int16 (s, s) in row r's two words: bytes 2 r + e twice, e = 0 or 1 */
    const __m128i dup0 = _mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14);
    const __m128i dup1 = _mm_add_epi8(dup0, _mm_set1_epi8(1));
    __m256 acc = _mm256_setzero_ps();
    const uint8_t *R = rk + g * nsb * KIL8Q6_REC;
    for (int64_t sb = 0; sb < nsb; sb++, R += KIL8Q6_REC) {
#if KIL8_PF
        for (int l = 0; l < KIL8Q6_REC; l += 64) prefetch_line((const char *)R + 2 * KIL8Q6_REC + l);
#endif
        const int8_t *x = A->xk + (c * nsb + sb) * XK_BYTES;
        const int32_t *xs = (const int32_t *)(x + 256); /* x's code sums per 16, two a word */
        __m256i i0 = _mm256_setzero_si256(), i1 = i0, io = i0;
#pragma GCC unroll 2
        for (int i = 0; i < 8; i++) { /* 16-groups 2 i, 2 i + 1 */
            const __m128i sb8 = _mm_loadu_si128((const __m128i *)(R + 16 + 16 * i));
            /* the pair's offsets: both scales against x's two sums */
            io = _mm256_add_epi32(io, _mm256_madd_epi16(_mm256_cvtepi8_epi16(sb8), _mm256_set1_epi32(xs[i])));
#pragma GCC unroll 2
            for (int e = 0; e < 2; e++) {
                const int j = 2 * i + e;
                const __m256i sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sb8, e ? dup1 : dup0));
                __m256i cq[4];
                kil8q6_split(R + 144 + 96 * j, cq);
                int32_t xw[4];
                memcpy(xw, x + 16 * j, 16);
                /* int16: two pairs of 63 * 127 <= 32,004 */
                const __m256i pa = _mm256_add_epi16(_mm256_maddubs_epi16(cq[0], _mm256_set1_epi32(xw[0])),
                                                    _mm256_maddubs_epi16(cq[1], _mm256_set1_epi32(xw[1])));
                const __m256i pb = _mm256_add_epi16(_mm256_maddubs_epi16(cq[2], _mm256_set1_epi32(xw[2])),
                                                    _mm256_maddubs_epi16(cq[3], _mm256_set1_epi32(xw[3])));
                i0 = _mm256_add_epi32(i0, _mm256_madd_epi16(pa, sc));
                i1 = _mm256_add_epi32(i1, _mm256_madd_epi16(pb, sc));
            }
        }
        const __m256 D = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)R)), _mm256_set1_ps(A->dk[c * nsb + sb]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1)), D, acc);
        acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(io), _mm256_mul_ps(D, _mm256_set1_ps(32.0f)), acc);
    }
    return acc;
}

/* rows [r0, r1) for A's n inputs (out row i at A->out + i * A->ldo): whole groups of 8, a group
 * that straddles r0 or r1 stores its own rows only (the same lanes whatever the split); each
 * input alone through a group (its records stay in L1), so a row's result does not depend on the
 * other inputs of the call. -1: no thread buffer */
static int kil8_range(int kind, const mm_args *A, const uint8_t *rk, int64_t r0, int64_t r1) {
    const int64_t nsb = A->k / 256;
    int32_t *xp = NULL;
    if (KINDS[kind]->kil8 == KIL8_NIB) {
        if (!(xp = (int32_t *)thread_buffer((size_t)(A->n * nsb * 4)) /* int32 words */)) return -1;
        for (int64_t c = 0; c < A->n; c++) kil8_xpairs(A, c, nsb, xp + c * nsb * 4);
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t g = r0 / 8; g * 8 < r1; g++) {
        const int64_t lo = r0 - g * 8, hi = r1 - g * 8; /* lanes [lo, hi) are this range's */
        const __m256i keep = _mm256_and_si256(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32((int)lo - 1)),
                                              _mm256_cmpgt_epi32(_mm256_set1_epi32((int)hi), lane));
        for (int64_t c = 0; c < A->n; c++)
            _mm256_maskstore_ps(A->out + c * A->ldo + 8 * g, keep,
                                KINDS[kind]->kil8 == KIL8_NIB ? kil8_group(A, rk, g, c, nsb, xp + c * nsb * 4) : kil8q6_group(A, rk, g, c, nsb));
    }
    return 0;
}
#define PK_KIL8 1
#else
static int kil8_range(int kind, const mm_args *A, const uint8_t *rk, int64_t r0, int64_t r1) {
    (void)kind; (void)A; (void)rk; (void)r0; (void)r1;
    return -1;
}
#define PK_KIL8 0
#endif

#endif /* POLY_FORMATS_KQUANT_INTERLEAVE8_H */

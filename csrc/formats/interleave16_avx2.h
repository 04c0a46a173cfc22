/* The repacked rows of csrc/formats/interleave16.h on 8-lane builds without VNNI (AVX2; AVX-512 without
 * VNNI): the same records, 8 rows (one 32-byte half of each 64-byte code vector) at a time.
 * vpmaddubsw multiplies byte pairs into int16, vpmaddwd sums the pairs into each row's int32
 * lane, so the integer sums are the VNNI kernel's exactly and every lane's float work is the
 * same operations in the same order: a row's results equal the AVX-512 build's, bit for bit.
 * Q4: codes (u8, <= 15) times x's codes (|c| <= 127): a pair <= 3,810, the 8 code vectors of a
 * block summed in int16 (<= 30,480) before one vpmaddwd. Q8_0: the codes widened to int16
 * against x's two codes as one int16 (254 h + l) in vpmaddwd: half the multiplies of two byte
 * products with the sign trick (1B Q8_0 prompt of 16 tokens 76 -> 147 tok/s); a -128 code is
 * exact. */
#ifndef POLY_FORMATS_INTERLEAVE16_AVX2_H
#define POLY_FORMATS_INTERLEAVE16_AVX2_H
#include "core/common.h"
#include "core/prefetch.h"
#include "rows/avx512.h"
#include "formats/interleave16.h"
#if PK_SIMD && !(PK_AVX512 && defined(__AVX512VNNI__))
#ifndef IL16_PF
#define IL16_PF 4096
#endif

/* the 8 code vectors of one half of a Q4 block's record (c: its first code vector, the record +
 * il16_codes_at + 32 h), nibbles as bytes (low: elements 4 q + i, high: 16 + 4 q + i) */
static inline __attribute__((always_inline)) void il16_codes8(const uint8_t *c, __m256i w[8]) {
    const __m256i m15 = _mm256_set1_epi8(15);
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(c + 64 * q));
        w[q] = _mm256_and_si256(v, m15);
        w[q + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
    }
}

/* the 8 rows' Q4 dot products of a block with an input's two codes x64 (32 high, then 32 low),
 * as the VNNI tile forms them: float(low sums) / 254 + float(high sums); x1: float(high sums) */
static inline __attribute__((always_inline)) __m256 il16_dot8(const __m256i w[8], const int8_t *x64, const int x1) {
    const __m256i one = _mm256_set1_epi16(1);
    __m256i ih = _mm256_setzero_si256(), il = ih;
#pragma GCC unroll 8
    for (int q = 0; q < 8; q++) {
        int32_t ch, cl;
        memcpy(&ch, x64 + 4 * q, 4);
        memcpy(&cl, x64 + 32 + 4 * q, 4);
        ih = _mm256_add_epi16(ih, _mm256_maddubs_epi16(w[q], _mm256_set1_epi32(ch)));
        if (!x1) il = _mm256_add_epi16(il, _mm256_maddubs_epi16(w[q], _mm256_set1_epi32(cl)));
        __asm__("" : "+x"(ih), "+x"(il)); /* one chain each (il16w_sums) */
    }
    ih = _mm256_madd_epi16(ih, one);
    if (x1) return _mm256_cvtepi32_ps(ih);
    il = _mm256_madd_epi16(il, one);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(il), _mm256_set1_ps(1.0f / XL_SCALE), _mm256_cvtepi32_ps(ih));
}

/* Q8_0 and int8 rows: the 8 rows' int32 sums of a block half (c: its first code vector, the
 * record + il16_codes_at + 32 h) with nn inputs' int16 codes (il16w_x; input i at x + 32 i: one
 * pointer, constant offsets), as float(I) in row order (the tile multiplies by D * (dx / 254)).
 * Each code vector is widened once for all inputs: rows 0-3 (a) and 4-7 (b), a row's 4 codes
 * against the input's 4 int16 in vpmaddwd's two lanes (pairs <= 8.3e6, a lane's 8 <= 6.7e7). */
static inline __attribute__((always_inline)) void il16w_sums(const uint8_t *c, const int16_t *x, const int nn, __m256 s[4]) {
    __m256i a[4], b[4];
#pragma GCC unroll 4
    for (int i = 0; i < nn; i++) a[i] = b[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int q = 0; q < 8; q++) {
        const __m256i wa = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + 64 * q)));
        const __m256i wb = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + 16 + 64 * q)));
#pragma GCC unroll 4
        for (int i = 0; i < nn; i++) {
            int64_t c4;
            memcpy(&c4, x + 32 * i + 4 * q, 8);
            const __m256i xb = _mm256_set1_epi64x(c4);
            a[i] = _mm256_add_epi32(a[i], _mm256_madd_epi16(wa, xb));
            b[i] = _mm256_add_epi32(b[i], _mm256_madd_epi16(wb, xb));
            __asm__("" : "+x"(a[i]), "+x"(b[i])); /* one chain each: GCC's add tree spilled 64 products */
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < nn; i++) { /* hadd: rows 0 1 4 5 | 2 3 6 7; the 64-bit lanes back in order */
        const __m256i I = _mm256_permute4x64_epi64(_mm256_hadd_epi32(a[i], b[i]), 0xD8);
        s[i] = _mm256_cvtepi32_ps(I);
    }
}

/* the block scales D of half h (rows 8 h ..) of record p: float16, 1 (int8) */
static inline __attribute__((always_inline)) __m256 il16_scales8(int kind, const uint8_t *p, int h) {
    if (kind == K_I8) return _mm256_set1_ps(1.0f);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * h)));
}

/* the 8-bit lane mask of `keep`'s half h (rows 8 h .. 8 h + 7 of a group) for maskstore */
static inline __m256i il16_mask8(unsigned keep, int h) {
    const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)(keep >> (8 * h))), bits), bits);
}

/* the block offsets M of half h of record p (Q4 kinds): float16 (Q4_1), or -8 D (Q4_0, Loom) */
static inline __attribute__((always_inline)) __m256 il16_mins8(int kind, const uint8_t *p, int h, __m256 D) {
    if (il16_sym(kind)) return _mm256_mul_ps(D, _mm256_set1_ps(-8.0f));
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 32 + 16 * h)));
}

/* out's 8 rows of `keep`'s half h from acc: int8 rows times their scales (aux, rows 16 g + 8 h ..) */
static inline __attribute__((always_inline)) void il16_store8(int kind, const mm_args *A, float *out, int64_t g, unsigned keep,
                                                             int h, __m256 acc) {
    if (kind == K_I8) acc = _mm256_mul_ps(acc, _mm256_loadu_ps(A->aux + 16 * g + 8 * h));
    _mm256_maskstore_ps(out + 16 * g + 8 * h, il16_mask8(keep, h), acc);
}

/* rows [16 g, 16 g + 16) x the nn (<= 3) inputs of X (il16_inputs) into out rows 0..; the rows
 * of `keep` stored. Both halves of a block in turn: each code vector is a cache line, read while
 * it is at hand. kind is a constant here. */
static inline __attribute__((always_inline)) void il16_tile8(int kind, const mm_args *A, const uint8_t *rp, int64_t g,
                                                            const int8_t *X, unsigned keep, const int nn, const int x1) {
    const int q8 = il16_q8(kind);
    const int64_t rec = il16_rec(kind);
    __m256 acc[2][3];
#pragma GCC unroll 3
    for (int i = 0; i < nn; i++) acc[0][i] = acc[1][i] = _mm256_setzero_ps();
    const uint8_t *p = rp + g * A->nb * rec;
    const float *sc = (const float *)(X + A->nb * 8 * 64);
    for (int64_t b = 0; b < A->nb; b++, p += rec, X += 8 * 64, sc += 16) {
#pragma GCC unroll 9
        for (int l = 0; l < rec; l += 64) prefetch_line((const char *)p + IL16_PF + l);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256 D = il16_scales8(kind, p, h);
            const __m256 M = il16_mins8(kind, p, h, D);
            __m256 s[4];
            if (q8)
                il16w_sums(p + il16_codes_at(kind) + 32 * h, (const int16_t *)X, nn, s);
            else {
                __m256i w[8];
                il16_codes8(p + il16_codes_at(kind) + 32 * h, w);
#pragma GCC unroll 3
                for (int i = 0; i < nn; i++) s[i] = il16_dot8(w, X + i * 64, x1);
            }
#pragma GCC unroll 3
            for (int i = 0; i < nn; i++) {
                acc[h][i] = _mm256_fmadd_ps(s[i], _mm256_mul_ps(D, _mm256_set1_ps(sc[2 * i])), acc[h][i]);
                if (!q8) acc[h][i] = _mm256_fmadd_ps(M, _mm256_set1_ps(sc[2 * i + 1]), acc[h][i]);
            }
        }
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++)
#pragma GCC unroll 3
        for (int i = 0; i < nn; i++) il16_store8(kind, A, A->out + i * A->ldo, g, keep, h, acc[h][i]);
}

static int il16p_range(int kind, const mm_args *A, const uint8_t *rp, int64_t r0, int64_t r1);

/* formats/interleave16.h's il16_range: per group of 16 rows, the inputs 4 at a time; from IL16P_MIN inputs
 * il16p_range (the same bits: 1B Q4_0 16-token prompt 1.38 vs 3.5 ms a [8192 x 2048] matrix) */
#define IL16_TILE8(KIND, NN) /* x1 (il16_x1) a constant too: Q4 kinds only */                  \
    if (IL16_ONE(KIND)) il16_tile8(KIND, A, rp, g, X, keep, NN, 1);                             \
    else il16_tile8(KIND, A, rp, g, X, keep, NN, 0);
#define IL16_CASES8(KIND)                                                                     \
    switch (A->n) {                                                                          \
    case 3: IL16_TILE8(KIND, 3) break;                                                        \
    case 2: IL16_TILE8(KIND, 2) break;                                                        \
    default: IL16_TILE8(KIND, 1)                                                              \
    }
static int il16_range(int kind, const mm_args *A, const uint8_t *rp, int64_t r0, int64_t r1) {
    if (A->n >= IL16P_MIN) return il16p_range(kind, A, rp, r0, r1);
    const int x1 = il16_x1(kind, A);
    const int8_t *X = il16_inputs(A, 0, (int)A->n, il16_q8(kind) ? IL16X_WIDE : IL16X_COPY, x1);
    if (!X) return -1;
    for (int64_t g = r0 / 16; g * 16 < r1; g++) {
        const unsigned keep = il16_keep(g, r0, r1);
        IL16_KIND_SWITCH(kind, IL16_CASES8)
    }
    return 0;
}

/* 4 inputs or more (prompts, batched decode): rows [16 g + 8 h, +8) x inputs t0..t0+nn (nn <=
 * 4), one half at a time (a group's records, k / 32 x 288-576 bytes, stay in L1/L2 for the input
 * tiles; 8 code vectors + 4 accumulators fit the 16 registers, where il16_tile8's two halves
 * spilled), x's two codes read in place (quantize_x: 64 bytes a block) and the same integer sums
 * and float steps per lane as il16_tile8: the same bits whichever tile a row takes. kind is a
 * constant here; out rows t0.. (A->out, A->ldo), the rows of `keep` (8 bits). */
static inline __attribute__((always_inline)) void il16p_tile(int kind, const mm_args *A, const uint8_t *rp, int64_t g, int h, int64_t t0,
                                                            const int16_t *xw, const float *xs, unsigned keep, int first, const int nn,
                                                            const int x1) {
    const int q8 = il16_q8(kind);
    const int64_t rec = il16_rec(kind);
    __m256 acc[4];
#pragma GCC unroll 4
    for (int i = 0; i < nn; i++) acc[i] = _mm256_setzero_ps();
    const uint8_t *p = rp + g * A->nb * rec + 32 * h;
    for (int64_t b = 0; b < A->nb; b++, p += rec) {
        if (first) /* the group's first pass reads its records from memory */
#pragma GCC unroll 9
            for (int l = 0; l < rec; l += 64) prefetch_line((const char *)p + IL16_PF + l);
        const __m256 D = il16_scales8(kind, p - 32 * h, h);
        const __m256 M = il16_mins8(kind, p - 32 * h, h, D);
        __m256 s[4];
        if (q8)
            il16w_sums(p + il16_codes_at(kind), xw + 128 * b, nn, s); /* il16p_range: [b][4][32] */
        else {
            __m256i w[8];
            il16_codes8(p + il16_codes_at(kind), w);
#pragma GCC unroll 4
            for (int i = 0; i < nn; i++) s[i] = il16_dot8(w, A->xq + ((t0 + i) * A->nb + b) * 64, x1); /* quantize_x: 64 bytes a block */
        }
#pragma GCC unroll 4
        for (int i = 0; i < nn; i++) {
            const int64_t xi = (t0 + i) * A->nb + b;
            acc[i] = _mm256_fmadd_ps(s[i], _mm256_mul_ps(D, _mm256_set1_ps(q8 ? A->dx[xi] * (1.0f / XL_SCALE) : A->dx[xi])), acc[i]);
            if (!q8) acc[i] = _mm256_fmadd_ps(M, _mm256_set1_ps(xs[xi]), acc[i]); /* il16p_range's sums (il16_xsum) */
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < nn; i++) il16_store8(kind, A, A->out + (t0 + i) * A->ldo, g, keep, h, acc[i]);
}

#define IL16P_TILE(KIND, NN)                                                                  \
    if (IL16_ONE(KIND)) il16p_tile(KIND, A, rp, g, h, t, xt, xs, keep, t == t0 && !h, NN, 1);  \
    else il16p_tile(KIND, A, rp, g, h, t, xt, xs, keep, t == t0 && !h, NN, 0);
#define IL16P_CASES(KIND)                                                                     \
    switch (nn) {                                                                            \
    case 4: IL16P_TILE(KIND, 4) break;                                                        \
    case 3: IL16P_TILE(KIND, 3) break;                                                        \
    case 2: IL16P_TILE(KIND, 2) break;                                                        \
    default: IL16P_TILE(KIND, 1)                                                              \
    }

/* rows [r0, r1) for A's n inputs (one thread) with il16p_tile: inputs in blocks whose codes (1 MB)
 * stay in L2 while every group of 16 rows meets them (Q8_0: as int16, il16w_x, in the thread's
 * buffer); a group that straddles r0 or r1 stores its own rows only. -1: no buffer */
static int il16p_range(int kind, const mm_args *A, const uint8_t *rp, int64_t r0, int64_t r1) {
    int64_t blk = (((int64_t)1 << 20) / (A->nb * 64)) & ~(int64_t)3;
    if (blk < 16) blk = 16;
    int16_t *xw = NULL;
    if ((il16_q8(kind)) && !(xw = (int16_t *)thread_buffer((size_t)((blk < A->n ? blk : A->n) + 3) * A->nb * 16))) return -1;
    const int x1 = il16_x1(kind, A);
    const float *xs = A->xs;
    if (x1) { /* the offsets' x sums as il16_inputs forms them (Q4 kinds; xw is Q8's) */
        float *o = thread_buffer((size_t)(A->n * A->nb));
        if (!o) return -1;
        for (int64_t i = 0; i < A->n * A->nb; i++) o[i] = il16_xsum(A, 1, i);
        xs = o;
    }
    for (int64_t t0 = 0; t0 < A->n; t0 += blk) {
        const int64_t t1 = A->n - t0 < blk ? A->n : t0 + blk;
        if (xw)
            for (int64_t t = t0; t < t1; t++)
                for (int64_t b = 0; b < A->nb; b++) /* [tile of 4][b][4][32]: il16w_sums' one pointer */
                    il16w_x(A->xq + (t * A->nb + b) * 64, xw + ((t - t0) / 4 * A->nb + b) * 128 + (t - t0) % 4 * 32);
        for (int64_t g = r0 / 16; g * 16 < r1; g++) {
            const unsigned keep = il16_keep(g, r0, r1);
            for (int h = 0; h < 2; h++) {
                if (!((keep >> (8 * h)) & 255u)) continue;
                for (int64_t t = t0; t < t1; t += 4) {
                    const int nn = t1 - t < 4 ? (int)(t1 - t) : 4;
                    const int16_t *xt = xw ? xw + (t - t0) * A->nb * 32 : NULL; /* (t - t0) / 4 tiles of nb x 128 */
                    IL16_KIND_SWITCH(kind, IL16P_CASES)
                }
            }
        }
    }
    return 0;
}
#define PK_IL16P 1 /* il16_range takes prompts too (il16p_range from IL16P_MIN inputs) */
#endif

#endif /* POLY_FORMATS_INTERLEAVE16_AVX2_H */

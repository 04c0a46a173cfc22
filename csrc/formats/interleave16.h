/* Q4_0 / Q4_1 / Q8_0 rows repacked in groups of 16 (poly.runtime.repack.repack16) for the fused
 * step's decode and short-prompt rows (AVX-512 VNNI here, 8-lane builds in formats/interleave16_avx2.h): one vector lane per weight row, so
 * the integer dot product of a whole 32-block lands in that row's lane and the block's scale
 * applies to 16 rows in one FMA (in the stored layout each row's block needs its own
 * horizontal work). Per 16 rows and block: D[16] as float16 (Q4_1: then M[16]), then 4 x 64
 * code bytes, byte 4 r + i of vector q = the stored byte 4 q + i of row r (low nibble: element
 * 4 q + i, high: 16 + 4 q + i). Q4_0 and Loom Q4 take M = -8 D in the tile (no M stored: 288
 * bytes a block, Q4_0's stored size, where a stored M made it 320). x takes the q8 scheme's two
 * int8 codes per element (quantize_x: x ~= dx * (h + l / 254), ~1/32000 of the block's
 * max|x|), or in the auto mode for Q4_0 and Loom Q4 the first code alone (il16_x1).
 * Why: batched decode (the server's 8 streams) is compute-bound, and the float tiles reach
 * ~80 % of two FMA pipes; vpdpbusd does 64 multiply-adds an instruction. A row's result does
 * not depend on the other rows or inputs of the call (lanes and inputs are independent), so a
 * sequence decodes the same alone and batched. */
#ifndef POLY_FORMATS_INTERLEAVE16_H
#define POLY_FORMATS_INTERLEAVE16_H
#include "core/common.h"
#include "core/prefetch.h"
#include "rows/avx512.h"
#include "formats/kinds.h"

#define IL16_REC 320 /* bytes per 16 rows and 32-block of Q4_1: D[16], M[16] float16, 4 x 64 codes (stored: 320) */
#define IL16_REC4 288 /* Q4_0 and Loom Q4: D[16] float16, 4 x 64 codes (Q4_0 stored: 288) */
#define IL16_REC8 544 /* Q8_0: D[16] float16, 8 x 64 code bytes (stored: 544) */
#define IL16_RECI 512 /* int8 rows (.entity q8): 8 x 64 code bytes; the scales are per row (aux) */
/* the symmetric 4-bit kinds: M = -8 D, not stored */
static inline int il16_sym(int kind) { return KINDS[kind]->il16 == IL16_SYM; }
/* 8-bit codes (Q8_0, int8 rows), else 4-bit */
static inline int il16_q8(int kind) { return KINDS[kind]->il16 >= IL16_Q8; }
static inline int64_t il16_rec(int kind) {
    const int L = KINDS[kind]->il16;
    return L == IL16_Q8 ? IL16_REC8 : L == IL16_I8 ? IL16_RECI : L == IL16_SYM ? IL16_REC4 : IL16_REC;
}
/* where a record's code vectors start: after D[16] (and Q4_1's M[16]); int8 rows hold codes alone */
static inline int64_t il16_codes_at(int kind) {
    const int L = KINDS[kind]->il16;
    return L == IL16_I8 ? 0 : L == IL16_Q8 || L == IL16_SYM ? 32 : 64;
}
/* IL16_KIND_SWITCH (the tiles' kind a constant per layout): formats/kinds.h */
/* the bytes of an [m, k] matrix repacked by 16, or -1 when its kind or shape is not repacked
 * (the `rp` arguments of decode and gemm) */
static inline int64_t il16_bytes(int kind, int64_t m, int64_t k) {
    const int ok = kind >= 0 && kind < K_COUNT && KINDS[kind]->il16 && m % 16 == 0 && k % 32 == 0;
    return ok ? m / 16 * (k / 32) * il16_rec(kind) : -1;
}
#define IL16_L2 (384 << 10) /* bytes of records a block of groups keeps in L2 while every 8 inputs pass */
#define IL16P_MIN 4 /* inputs from which the 8-lane il16_range takes il16p_range (formats/interleave16_avx2.h) */
#if PK_SIMD
#define PK_IL16 1

/* the rows of group g (16 g .. 16 g + 15) inside [r0, r1), as bits: a group that straddles a
 * thread's range is computed whole and stores its own rows (the same lanes whatever the split) */
static inline unsigned il16_keep(int64_t g, int64_t r0, int64_t r1) {
    const int64_t lo = g * 16 < r0 ? r0 - g * 16 : 0, hi = g * 16 + 16 > r1 ? r1 - g * 16 : 16;
    return ((1u << hi) - 1) & ~((1u << lo) - 1);
}

/* Q8_0's sums on 8 lanes take x's two codes as one int16, 254 h + l (|.| <= 32,385): every
 * build forms float(I), I = 254 sum(w h) + sum(w l) rounded once (formats/interleave16_avx2.h il16w_sums; the
 * VNNI tile by one FMA of its two exact sums), times D * (dx / 254) */
static inline void il16w_x(const int8_t *xq, int16_t *o) {
    for (int j = 0; j < 32; j += 16) {
        const __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(xq + j)));
        const __m256i l = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(xq + 32 + j)));
        _mm256_storeu_si256((__m256i *)(o + j), _mm256_add_epi16(_mm256_mullo_epi16(h, _mm256_set1_epi16(254)), l));
    }
}
enum { IL16X_COPY, IL16X_FLIP, IL16X_WIDE }; /* il16_inputs' forms: x's two codes, Q8_0's on VNNI, on 8 lanes */

/* whether A's rows take x's first code alone: the auto mode's Q4_0 and Loom Q4 (8 byte products
 * a block and 8 rows where two codes took 16, as llama.cpp's Q8_0 activations; 1B Q4_0 prompts
 * of 128/512 tokens +45 %, decode +5 % on Zen 3). The symmetric 4-bit formats' own rounding
 * dwarfs x's one code. Q4_1 (the shipped SmolLM2 file: greedy equal to transformers, 64/64 with
 * our f32 where one code gave 33), Q8_0 and int8 keep both codes. */
static inline int il16_x1(int kind, const mm_args *A) { return A->x1 && il16_sym(kind); }
/* a tile of KIND on x's one code: x1 (il16_x1, a run-time flag) and a Q4 kind (a constant, so the
 * Q8 tiles never instantiate a one-code variant) */
#define IL16_ONE(KIND) (x1 && !il16_q8(KIND))
/* the offset term's x sum of block xb: with one code the codes' own sum times dx, so a block's
 * result is exactly the weights times the quantized x (the rounding errors weighted by the
 * weights, not by the unsigned codes: ~half the error on Q4_0); else the float sum */
static inline float il16_xsum(const mm_args *A, int x1, int64_t xb) {
    if (!x1) return A->xs[xb];
    int32_t t = 0;
    for (int l = 0; l < 32; l++) t += A->xq[xb * 64 + l];
    return A->dx[xb] * (float)t;
}

/* the nn (<= 8) inputs' codes, block by block, as il16_tile reads them: codes [nb][8][64] then
 * (dx, xs) [nb][8][2] (Q8_0: dx / 254), so one pointer and constant offsets reach every input (with a pointer
 * per input the tile ran out of general registers and spilled in its inner loop) */
static const int8_t *il16_inputs(const mm_args *A, int64_t c, int nn, int form, int x1) {
    int8_t *X = (int8_t *)thread_buffer((size_t)A->nb * 8 * (64 + 8) / 4);
    if (!X) return NULL;
    float *sc = (float *)(X + A->nb * 8 * 64);
    for (int64_t b = 0; b < A->nb; b++)
        for (int i = 0; i < nn; i++) {
            const int64_t xb = (c + i) * A->nb + b;
            int8_t *o = X + (b * 8 + i) * 64;
            if (form == IL16X_WIDE) il16w_x(A->xq + xb * 64, (int16_t *)o);
            else memcpy(o, A->xq + xb * 64, 64);
            if (form == IL16X_FLIP) /* Q8_0: the codes as unsigned bytes, c + 128 (vpdpbusd's u8 side) */
                for (int j = 0; j < 64; j++) o[j] = (int8_t)((uint8_t)o[j] ^ 0x80);
            sc[(b * 8 + i) * 2] = form == IL16X_COPY ? A->dx[xb] : A->dx[xb] * (1.0f / XL_SCALE); /* Q8_0: dx / 254 */
            sc[(b * 8 + i) * 2 + 1] = il16_xsum(A, x1, xb);
        }
    return X;
}

#if PK_AVX512 && defined(__AVX512VNNI__)

/* rows [16 g, 16 g + 16) x the nn (<= 8) inputs of X (il16_inputs) into out rows c..; lanes
 * outside `keep` not stored. Q4: codes (u8) times x's codes (s8), + M * sum(x) per block; Q8_0:
 * x's codes as unsigned bytes (c + 128, il16_inputs) times the signed codes, less 128 * the
 * row's code sum (S, one vpdpbusd of ones per code vector, shared by the nn inputs: not stored,
 * so a record is the stored block's 544 bytes), so the int32 sums are the signed products; int8 rows (K_I8) as Q8_0 with
 * D = 1, the row scales (aux) applied once at the end. kind is a constant here. */
static inline __attribute__((always_inline)) void il16_tile(int kind, const mm_args *A, const uint8_t *rp, int64_t g,
                                                           const int8_t *X, int64_t c, __mmask16 keep, const int nn, const int x1) {
    const int q8 = il16_q8(kind), i8 = kind == K_I8, sym = il16_sym(kind);
    const int64_t rec = il16_rec(kind), co = il16_codes_at(kind);
    __m512 acc[8];
    const __m512i m15 = _mm512_set1_epi8(15);
    const __m512 rl = _mm512_set1_ps(1.0f / XL_SCALE);
#pragma GCC unroll 8
    for (int i = 0; i < nn; i++) acc[i] = _mm512_setzero_ps();
    const uint8_t *p = rp + g * A->nb * rec;
    const float *sc = (const float *)(X + A->nb * 8 * 64);
    for (int64_t b = 0; b < A->nb; b++, p += rec, X += 8 * 64, sc += 16) {
#pragma GCC unroll 9
        for (int l = 0; l < rec; l += 64) prefetch_line((const char *)p + 2048 + l);
        const __m512 D = i8 ? _mm512_set1_ps(1.0f) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        /* Q4_1's M (Q4_0 and Loom: M = -8 D; Q8_0 and int8: none) */
        const __m512 M = sym || q8 ? _mm512_mul_ps(D, _mm512_set1_ps(-8.0f))
                                   : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)));
        __m512i w[8], S = _mm512_setzero_si512();
        if (q8) { /* S: 128 * each row's code sum (ones as the unsigned bytes) */
            const __m512i ones = _mm512_set1_epi8(1);
#pragma GCC unroll 8
            for (int q = 0; q < 8; q++) {
                w[q] = _mm512_loadu_si512((const void *)(p + co + 64 * q));
                S = _mm512_dpbusd_epi32(S, ones, w[q]);
            }
            S = _mm512_slli_epi32(S, 7);
        } else {
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) { /* low nibbles: elements 4 q + i, high: 16 + 4 q + i */
                const __m512i v = _mm512_loadu_si512((const void *)(p + co + 64 * q));
                w[q] = _mm512_and_si512(v, m15);
                w[q + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m15);
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < nn; i++) {
            const int32_t *h = (const int32_t *)(X + i * 64); /* 32 high codes, then 32 low codes */
            __m512i ih = _mm512_setzero_si512(), il = ih;
#pragma GCC unroll 8
            for (int q = 0; q < 8; q++) {
                const __m512i xh = _mm512_set1_epi32(h[q]), xl = _mm512_set1_epi32(h[8 + q]);
                ih = q8 ? _mm512_dpbusd_epi32(ih, xh, w[q]) : _mm512_dpbusd_epi32(ih, w[q], xh);
                if (!x1) il = q8 ? _mm512_dpbusd_epi32(il, xl, w[q]) : _mm512_dpbusd_epi32(il, w[q], xl);
            }
            if (q8) { /* float(254 sum(w h) + sum(w l)), one rounding of the exact sum (il16w_sums) */
                const __m512 I = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(ih, S)), _mm512_set1_ps(XL_SCALE),
                                                 _mm512_cvtepi32_ps(_mm512_sub_epi32(il, S)));
                acc[i] = _mm512_fmadd_ps(I, _mm512_mul_ps(D, _mm512_set1_ps(sc[2 * i])), acc[i]);
                continue;
            }
            const __m512 s = x1 ? _mm512_cvtepi32_ps(ih) : _mm512_fmadd_ps(_mm512_cvtepi32_ps(il), rl, _mm512_cvtepi32_ps(ih));
            acc[i] = _mm512_fmadd_ps(s, _mm512_mul_ps(D, _mm512_set1_ps(sc[2 * i])), acc[i]);
            acc[i] = _mm512_fmadd_ps(M, _mm512_set1_ps(sc[2 * i + 1]), acc[i]);
        }
    }
    const __m512 rs = i8 ? _mm512_loadu_ps(A->aux + 16 * g) : _mm512_set1_ps(1.0f);
#pragma GCC unroll 8
    for (int i = 0; i < nn; i++) _mm512_mask_storeu_ps(A->out + (c + i) * A->ldo + 16 * g, keep, i8 ? _mm512_mul_ps(acc[i], rs) : acc[i]);
}

/* rows [r0, r1) for A's n inputs, 8 at a time: the groups they touch; a group that straddles r0
 * or r1 is computed whole and stores its own rows (the same lanes, bit for bit, whatever the
 * split between threads). -1: no buffer for the inputs */
#define IL16_TILE(KIND, NN) /* x1 (il16_x1) a constant too: Q4 kinds only */                  \
    if (IL16_ONE(KIND)) il16_tile(KIND, A, rp, g, X, c, keep, NN, 1);                          \
    else il16_tile(KIND, A, rp, g, X, c, keep, NN, 0);
#define IL16_CASES(KIND)                                                                      \
    switch (nn) {                                                                            \
    case 8: IL16_TILE(KIND, 8) break;                                                         \
    case 7: IL16_TILE(KIND, 7) break;                                                         \
    case 6: IL16_TILE(KIND, 6) break;                                                         \
    case 5: IL16_TILE(KIND, 5) break;                                                         \
    case 4: IL16_TILE(KIND, 4) break;                                                         \
    case 3: IL16_TILE(KIND, 3) break;                                                         \
    case 2: IL16_TILE(KIND, 2) break;                                                         \
    default: IL16_TILE(KIND, 1)                                                               \
    }
static int il16_range(int kind, const mm_args *A, const uint8_t *rp, int64_t r0, int64_t r1) {
    const int64_t g0 = r0 / 16, g1 = (r1 + 15) / 16, per = IL16_L2 / (A->nb * il16_rec(kind));
    const int64_t gb = A->n <= 8 ? g1 - g0 : per > 1 ? per : 1; /* groups a block */
    const int x1 = il16_x1(kind, A);
    for (int64_t b0 = g0; b0 < g1; b0 += gb) /* a prompt's rows read from memory once, not once per 8 inputs */
        for (int64_t c = 0; c < A->n; c += 8) {
            const int nn = A->n - c < 8 ? (int)(A->n - c) : 8;
            const int8_t *X = il16_inputs(A, c, nn, il16_q8(kind) ? IL16X_FLIP : IL16X_COPY, x1);
            if (!X) return -1;
            for (int64_t g = b0; g < g1 && g < b0 + gb; g++) {
                const __mmask16 keep = (__mmask16)il16_keep(g, r0, r1);
                IL16_KIND_SWITCH(kind, IL16_CASES)
            }
        }
    return 0;
}
#define PK_IL16P 1 /* prompts of any length on the repacked rows (blocks of groups in L2) */
#endif /* VNNI */
#endif /* PK_SIMD */

#endif /* POLY_FORMATS_INTERLEAVE16_H */

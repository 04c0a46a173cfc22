/* Register tiles of the quantized row kernels: the AVX2 8-lane tile (the AVX-512 ones are in
 * rows/avx512.h), quant_row (one weight row) and quant_row2 (two). */
#ifndef POLY_ROWS_QUANT_TILES_H
#define POLY_ROWS_QUANT_TILES_H
#include "core/common.h"
#include "formats/pq_decode.h"
#include "rows/avx512.h"
#include "rows/dense_dot.h"
#include "formats/block_decode.h"

#if PK_SIMD && !PK_AVX512
/* quant_row's 8-lane tile: the nn input rows from c on (see quant_tile512). Every input the same
 * steps (the block's codes times x, then D, and M times x's block sum on the side), so a row's
 * result does not depend on its company (the server's batched rows equal a sequence alone) */
static inline __attribute__((always_inline)) void quant_tile(int kind, const mm_args *A, int64_t r, int64_t c,
                                                             const int nn) {
    __m256 acc[ROW_TILE];
    float macc[ROW_TILE];
    pq_cache pc = {NULL};
#pragma GCC unroll 16
    for (int i = 0; i < nn; i++) { acc[i] = _mm256_setzero_ps(); macc[i] = 0.0f; }
    for (int64_t b = 0; b < A->nb; b++) {
        __m256 v[4];
        float D, M;
        dec_simd(kind, A, r, b, v, &D, &M, &pc);
        const __m256 vd = _mm256_set1_ps(D);
#pragma GCC unroll 16
        for (int i = 0; i < nn; i++) {
            const float *xb = A->x + (c + i) * A->k + b * 32;
            __m256 s = _mm256_mul_ps(v[0], _mm256_loadu_ps(xb));
            s = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), s);
            s = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xb + 16), s);
            s = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), s);
            acc[i] = _mm256_fmadd_ps(vd, s, acc[i]);
            macc[i] += M * A->xs[(c + i) * A->nb + b];
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < nn; i++) A->out[(c + i) * A->ldo + r] = hsum(acc[i]) + macc[i];
}
#elif PK_AVX512
#define quant_tile quant_tile512
#endif

/* One output row: decode each block once, dot it with every input row (SIMD: in tiles of
 * ROW_TILE rows, then the rest as one tile, each tile re-decoding the row). */
static inline __attribute__((always_inline)) void quant_row(int kind, const mm_args *A, int64_t r, int64_t n) {
#if PK_SIMD
#define QTILE(c, nn) quant_tile(kind, A, r, c, nn)
    FOR_TILES(n, QTILE);
#undef QTILE
#else
    float acc[MAX_N], macc[MAX_N];
    pq_cache pc = {NULL}; /* K-quant scales, once per super-block */
    for (int64_t i = 0; i < n; i++) acc[i] = macc[i] = 0.0f;
    for (int64_t b = 0; b < A->nb; b++) {
        float q[32], D, M;
        dec_scalar(kind, A, r, b, q, &D, &M, &pc);
        for (int64_t i = 0; i < n; i++) {
            const float *xb = A->x + i * A->k + b * 32;
            float s[8] = {0};
            for (int l = 0; l < 32; l++) s[l & 7] += q[l] * xb[l];
            acc[i] += D * (((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])));
            macc[i] += M * A->xs[i * A->nb + b];
        }
    }
    for (int64_t i = 0; i < n; i++) A->out[i * A->ldo + r] = acc[i] + macc[i];
#endif
}

/* quant_row for rows r and r + 1: the same sums in the same order (a row's value does not
 * depend on whether it ran in a pair), AVX-512 sharing each x load between the two rows */
static inline __attribute__((always_inline)) void quant_row2(int kind, const mm_args *A, int64_t r, int64_t n) {
#if PK_AVX512
#define QTILE2(c, nn)                                                                         \
    do {                                                                                      \
        quant_rows512(kind, A, r, c, nn, 2);                                                  \
    } while (0)
    FOR_TILES(n, QTILE2);
#undef QTILE2
#else
    quant_row(kind, A, r, n);
    quant_row(kind, A, r + 1, n);
#endif
}

/* input rows the row kernels take per pass over a matrix: each weight row is dotted with all of
 * them, so they should stay near L1 (a 16-row pass at k 1,536, 96 KB of x, ran 2x slower than
 * two 8-row passes; with weight rows in pairs, 8 rows of 48 KB in one pass beat two of 4 by ~4 %
 * on SmolLM2's 8-row step). Only for matrices that stay in the caches between passes: a 1B model's
 * matrices (tens of MB) come from memory, where a second pass over the weights costs far more
 * than x from L2 (its 16-token f32 prefill ran at 0.41x llama.cpp with 4-row pieces). */
static inline int64_t row_piece(const mm_args *A) {
    if (A->m * A->rb > ((int64_t)8 << 20)) return MAX_N;
    return A->k * 4 * ROW_TILE <= 65536 ? ROW_TILE : (ROW_TILE > 4 ? 4 : ROW_TILE);
}

#endif /* POLY_ROWS_QUANT_TILES_H */

/* Dense rows times several input rows: register tiles (dense_tile) and the row entry point
 * (dense_row). Included by pk_kernels.h after the dense loaders (load8/load16, dense_dot). */
#ifndef PK_DENSE_H
#define PK_DENSE_H

#if PK_SIMD
#if PK_AVX512
#define DL 16 /* lanes of the dense tiles */
typedef __m512 dvec;
#define DLOAD(kind, row, j) load16(kind, row, j)
#define DLOADX(p) _mm512_loadu_ps(p)
#define DFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define DZERO() _mm512_setzero_ps()
#define DSUM(v) _mm512_reduce_add_ps(v)
#else
#define DL 8
typedef __m256 dvec;
#define DLOAD(kind, row, j) load8(kind, row, j)
#define DLOADX(p) _mm256_loadu_ps(p)
#define DFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define DZERO() _mm256_setzero_ps()
#define DSUM(v) hsum(v)
#endif
/* one dense row times the nn input rows from c on (nn constant after inlining: accumulators in
 * registers), each weight vector converted once for all of them; two accumulators per row keep
 * the FMA chains short. The k % DL tail sums in the scalar loop. */
static inline __attribute__((always_inline)) void dense_tile(int kind, const mm_args *A, const uint8_t *row,
                                                             int64_t r, int64_t c, const int nn, float scale) {
    dvec a0[ROW_TILE], a1[ROW_TILE];
#pragma GCC unroll 16
    for (int i = 0; i < nn; i++) a0[i] = a1[i] = DZERO();
    const int64_t k = A->k, k2 = k / (2 * DL) * (2 * DL);
    int64_t j = 0;
    for (; j < k2; j += 2 * DL) {
        const dvec w0 = DLOAD(kind, row, j), w1 = DLOAD(kind, row, j + DL);
#pragma GCC unroll 16
        for (int i = 0; i < nn; i++) {
            const float *xi = A->x + (c + i) * k + j;
            a0[i] = DFMA(w0, DLOADX(xi), a0[i]);
            a1[i] = DFMA(w1, DLOADX(xi + DL), a1[i]);
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < nn; i++) {
        const float *xi = A->x + (c + i) * k;
        float s = DSUM(a0[i]) + DSUM(a1[i]);
        for (int64_t t = j; t < k; t++) s += load1(kind, row, t) * xi[t];
        A->out[(c + i) * A->ldo + r] = scale * s;
    }
}
#endif

static inline __attribute__((always_inline)) void dense_row(int kind, const mm_args *A, int64_t r) {
    const int64_t esz = kind == K_F32 ? 4 : (kind == K_I8 ? 1 : 2);
    const uint8_t *row = A->w + r * A->k * esz;
    const float scale = kind == K_I8 ? A->aux[r] : 1.0f;
    const int64_t n = A->n;
#if PK_SIMD
    if (n > 1) { /* several input rows: register tiles (one row keeps dense_dot's numerics) */
#define DTILE(c, nn) dense_tile(kind, A, row, r, c, nn, scale)
        FOR_TILES(n, DTILE);
#undef DTILE
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++)
        A->out[i * A->ldo + r] = scale * dense_dot(kind, row, A->x + i * A->k, A->k);
}

#endif /* PK_DENSE_H */

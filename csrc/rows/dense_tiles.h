/* Dense rows times several input rows: register tiles (dense_tile) and the row entry point
 * (dense_row). */
#ifndef POLY_ROWS_DENSE_TILES_H
#define POLY_ROWS_DENSE_TILES_H
#include "core/common.h"
#include "core/prefetch.h"
#include "rows/avx512.h"
#include "rows/dense_dot.h"

/* bytes an element of a dense row: float32, int8 codes, or a 16-bit float */
static inline int64_t dense_esz(int kind) { return kind == K_F32 ? 4 : (kind == K_I8 ? 1 : 2); }

#if PK_SIMD
#if PK_AVX512
#define DL 16 /* lanes of the dense tiles */
typedef __m512 dvec;
#define DLOAD(kind, row, j) load16(kind, row, j)
#define DLOADX(p) _mm512_loadu_ps(p)
#define DFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define DZERO() _mm512_setzero_ps()
#define DSUM(v) _mm512_reduce_add_ps(v)
#define DSTEP (2 * DL) /* k a tile step */
#define DN 4           /* inputs a pass of dense_group */
#else
#define DL 8
typedef __m256 dvec;
#define DLOAD(kind, row, j) load8(kind, row, j)
#define DLOADX(p) _mm256_loadu_ps(p)
#define DFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define DZERO() _mm256_setzero_ps()
#define DSUM(v) hsum(v)
#define DSTEP DL
#define DN 3 /* 12 accumulators, 3 x vectors and a row's: the 16 ymm registers */
#endif
#define DG 4 /* rows a tile of dense_group */
/* With several inputs a row's bytes are asked for in the tile's loop, TILE_PF ahead (one
 * burst of prefetch_row's per row stalled on the full miss buffers: 1B f16 16-token prompt
 * 117 -> 127 tok/s without it, 140 with these) */
#ifndef TILE_PF
#define TILE_PF 2048
#endif
static inline __attribute__((always_inline)) void tile_prefetch(const uint8_t *p, const int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) prefetch_line((const char *)p + TILE_PF + o);
}
#if PK_AVX512
/* a dense row's nn sums from its tile (lane_sums), then the k % DL tail in the scalar loop, times
 * the row scale */
static inline __attribute__((always_inline)) void dense_sums(int kind, const mm_args *A, const uint8_t *row, int64_t r,
                                                             int64_t c, const int nn, float scale, const dvec *a,
                                                             int64_t j) {
    float s[16];
    lane_sums(a, NULL, nn, s);
#pragma GCC unroll 8
    for (int i = 0; i < nn; i++) {
        const float *xi = A->x + (c + i) * A->k;
        for (int64_t t = j; t < A->k; t++) s[i] += load1(kind, row, t) * xi[t];
        A->out[(c + i) * A->ldo + r] = scale * s[i];
    }
}

/* `rows` dense rows from r (1, 2 or 4: each x load feeds 2 * rows FMAs) times the nn input rows
 * from c on; nn and rows are constants after inlining (accumulators in registers, rows * nn <=
 * 16), each weight vector converted once for all inputs, one accumulator per (row, input) */
static inline __attribute__((always_inline)) void dense_tile(int kind, const mm_args *A, int64_t r, int64_t c,
                                                             const int nn, const int rows, const uint8_t *pf, int64_t pstep) {
    const int64_t esz = dense_esz(kind), k = A->k, k2 = k / (2 * DL) * (2 * DL);
    const uint8_t *row = A->w + r * k * esz;
    dvec a[4][8];
#pragma GCC unroll 4
    for (int q = 0; q < rows; q++)
#pragma GCC unroll 16
        for (int i = 0; i < nn; i++) a[q][i] = DZERO();
    int64_t j = 0;
    for (; j < k2; j += 2 * DL) {
        dvec w0[4], w1[4];
        if (pstep) /* the next group's rows, spread over this group's passes (dense_row4) */
            for (int64_t o = 0; o < pstep; o += 64) prefetch_l2((const char *)pf + j / DSTEP * pstep + o);
#pragma GCC unroll 4
        for (int q = 0; q < rows; q++) {
            if (!pstep) tile_prefetch(row + (q * k + j) * esz, 2 * DL * esz);
            w0[q] = DLOAD(kind, row + q * k * esz, j);
            w1[q] = DLOAD(kind, row + q * k * esz, j + DL);
        }
#pragma GCC unroll 16
        for (int i = 0; i < nn; i++) {
            const float *xi = A->x + (c + i) * k + j;
            const dvec x0 = DLOADX(xi), x1 = DLOADX(xi + DL);
#pragma GCC unroll 4
            for (int q = 0; q < rows; q++) a[q][i] = DFMA(w1[q], x1, DFMA(w0[q], x0, a[q][i]));
        }
    }
#pragma GCC unroll 4
    for (int q = 0; q < rows; q++)
        dense_sums(kind, A, row + q * k * esz, r + q, c, nn, kind == K_I8 ? A->aux[r + q] : 1.0f, a[q], j);
}
#else
/* AVX2: `rows` dense rows from r (1, 2 or 4, a constant after inlining) times the nn input rows
 * from c on, one accumulator a (row, input) over steps of 8. Four rows x 3 inputs hold the 3 x
 * vectors and load the rows' one at a time (16 registers: 7 loads for 12 FMAs); the one-row tile
 * before it, two loads an FMA, ran a [8192 x 2048] f32 product of 16 inputs at 33 GFLOP/s one
 * thread, this one 80. A row's sums do not depend on `rows` (nor so on how threads split rows). */
static inline __attribute__((always_inline)) void dense_tile(int kind, const mm_args *A, int64_t r, int64_t c,
                                                             const int nn, const int rows, const uint8_t *pf, int64_t pstep) {
    const int64_t esz = dense_esz(kind), k = A->k, k1 = k / DL * DL;
    const uint8_t *row = A->w + r * k * esz;
    dvec a[4][8];
#pragma GCC unroll 4
    for (int q = 0; q < rows; q++)
#pragma GCC unroll 8
        for (int i = 0; i < nn; i++) a[q][i] = DZERO();
    int64_t j = 0;
    for (; j < k1; j += DL) {
        if (pstep) /* the next group's rows, spread over this group's passes (dense_row4) */
            for (int64_t o = 0; o < pstep; o += 64) prefetch_l2((const char *)pf + j / DSTEP * pstep + o);
        if (rows <= 2) { /* the rows' vectors held, x loaded an input at a time */
            dvec w[2];
#pragma GCC unroll 2
            for (int q = 0; q < rows; q++) {
                if (!pstep && !(j & (2 * DL - 1))) tile_prefetch(row + (q * k + j) * esz, 2 * DL * esz);
                w[q] = DLOAD(kind, row + q * k * esz, j);
            }
#pragma GCC unroll 8
            for (int i = 0; i < nn; i++) {
                const dvec xi = DLOADX(A->x + (c + i) * k + j);
#pragma GCC unroll 2
                for (int q = 0; q < rows; q++) a[q][i] = DFMA(w[q], xi, a[q][i]);
            }
        } else { /* x's vectors held, the rows' loaded one at a time */
            dvec x[8];
#pragma GCC unroll 8
            for (int i = 0; i < nn; i++) x[i] = DLOADX(A->x + (c + i) * k + j);
#pragma GCC unroll 4
            for (int q = 0; q < rows; q++) {
                if (!pstep && !(j & (2 * DL - 1))) tile_prefetch(row + (q * k + j) * esz, 2 * DL * esz);
                const dvec w = DLOAD(kind, row + q * k * esz, j);
#pragma GCC unroll 8
                for (int i = 0; i < nn; i++) a[q][i] = DFMA(w, x[i], a[q][i]);
            }
        }
    }
#pragma GCC unroll 4
    for (int q = 0; q < rows; q++)
#pragma GCC unroll 8
        for (int i = 0; i < nn; i++) {
            const float *xi = A->x + (c + i) * k;
            float t = DSUM(a[q][i]);
            for (int64_t u = j; u < k; u++) t += load1(kind, row + q * k * esz, u) * xi[u];
            A->out[(c + i) * A->ldo + r + q] = (kind == K_I8 ? A->aux[r + q] : 1.0f) * t;
        }
}
#endif
#endif

#if PK_SIMD
#if PK_AVX512
#define DADD(a, b) _mm512_add_ps(a, b)
#else
#define DADD(a, b) _mm256_add_ps(a, b)
#endif
/* `rows` dense rows from r (1..4, a constant after inlining) times one input, two accumulators a
 * row: each x load feeds every row of the group, and a row's sums do not depend on `rows` (so
 * on how the rows were split between threads) */
static inline __attribute__((always_inline)) void dense_group1(int kind, const mm_args *A, int64_t r, const int rows) {
    const int64_t esz = dense_esz(kind), k = A->k, k2 = k / (2 * DL) * (2 * DL);
    const uint8_t *row = A->w + r * k * esz;
    dvec a[4], b[4];
#pragma GCC unroll 4
    for (int q = 0; q < rows; q++) a[q] = b[q] = DZERO();
    int64_t j = 0;
    for (; j < k2; j += 2 * DL) {
        const dvec x0 = DLOADX(A->x + j), x1 = DLOADX(A->x + j + DL);
#pragma GCC unroll 4
        for (int q = 0; q < rows; q++) {
            a[q] = DFMA(DLOAD(kind, row + q * k * esz, j), x0, a[q]);
            b[q] = DFMA(DLOAD(kind, row + q * k * esz, j + DL), x1, b[q]);
        }
    }
#pragma GCC unroll 4
    for (int q = 0; q < rows; q++) {
        float s = DSUM(DADD(a[q], b[q]));
        for (int64_t t = j; t < k; t++) s += load1(kind, row + q * k * esz, t) * A->x[t];
        A->out[r + q] = (kind == K_I8 ? A->aux[r + q] : 1.0f) * s;
    }
}
#endif

static inline __attribute__((always_inline)) void dense_row(int kind, const mm_args *A, int64_t r) {
    const int64_t esz = dense_esz(kind);
    const int64_t n = A->n;
#if PK_SIMD
    if (n > 1) { /* several input rows: register tiles (one row keeps dense_dot's four chains: the
                  * tiles' one chain of dependent FMAs a row bound a 1B int8 decode, 43 -> 30 tok/s) */
#define DTILE(c, nn) dense_tile(kind, A, r, c, nn, 1, NULL, 0)
        FOR_TILES(n, DTILE);
#undef DTILE
        return;
    }
#endif
    const uint8_t *row = A->w + r * A->k * esz;
    const float scale = kind == K_I8 ? A->aux[r] : 1.0f;
    for (int64_t i = 0; i < n; i++)
        A->out[i * A->ldo + r] = scale * dense_dot(kind, row, A->x + i * A->k, A->k);
}

/* rows r and r + 1 for several inputs (n > 1): the same sums as dense_row, sharing each x load
 * between the two rows (a 16-token 1B f32 prompt read its x from L2 once per row) */
static inline __attribute__((always_inline)) void dense_row2(int kind, const mm_args *A, int64_t r) {
#if PK_SIMD
#define DTILE2(c, nn) dense_tile(kind, A, r, c, nn, 2, NULL, 0)
    FOR_TILES(A->n, DTILE2);
#undef DTILE2
#else
    dense_row(kind, A, r);
    dense_row(kind, A, r + 1);
#endif
}

/* rows r .. r + 3 for several inputs: tiles of DG rows x DN inputs (AVX-512 4 x 4, each x load
 * feeding eight FMAs: a 1B f16 16-token prompt was bound by reading x from L2 for every pair of
 * rows; AVX2 4 x 3), the inputs in passes of DN; the same sums as dense_row. The passes share
 * asking for the next group's rows, into L2 (into L1 they evicted this group's f32 rows): each
 * pass asking for its own rows ahead needed the group's bytes in flight at once (one thread,
 * [8192 x 2048] 16 inputs: f32 60 -> 80 GFLOP/s, f16 78 -> 106) */
#if PK_SIMD
static inline __attribute__((always_inline)) void dense_group(int kind, const mm_args *A, int64_t r) {
    const int64_t esz = dense_esz(kind), gb = DG * A->k * esz, steps = A->k / DSTEP, passes = (A->n + DN - 1) / DN;
    const int64_t pstep = steps ? ((gb + passes * steps - 1) / (passes * steps) + 63) & ~(int64_t)63 : 0;
    const uint8_t *pf = A->w + (r + DG) * A->k * esz;
    const int ok = r + 2 * DG <= A->m && pstep;
#define DTILE_G(c, nn) dense_tile(kind, A, r, c, nn, DG, ok ? pf + (c) / DN * steps * pstep : NULL, ok ? pstep : 0)
    int64_t c = 0;
    for (; c + DN <= A->n; c += DN) DTILE_G(c, DN);
    if (A->n - c >= 2) { DTILE_G(c, 2); c += 2; }
    if (A->n - c >= 1) DTILE_G(c, 1);
#undef DTILE_G
}

#endif

static inline __attribute__((always_inline)) void dense_row4(int kind, const mm_args *A, int64_t r) {
#if PK_SIMD
    for (int64_t q = 0; q < 4; q += DG) dense_group(kind, A, r + q);
#else
    dense_row2(kind, A, r);
    dense_row2(kind, A, r + 2);
#endif
}

/* A decode step's dense rows (one input). No prefetch_row bursts: one sequential stream a row
 * keeps the hardware prefetcher ahead, and a burst of a row's lines filled the miss buffers
 * (Zen 4 f16 [8192 x 2048]: 18-23 -> 23-31 GB/s). Past DENSE_X1 bytes of x (the FFN's down rows,
 * k = 8192: 32 KB of float32, all of Zen 4's L1d) x would come from L2 for every row: rows go in
 * fours sharing each x load ([2048 x 8192]: 19-20 -> 27-28 GB/s). */
#ifndef DENSE_X1
#define DENSE_X1 16384
#endif
static inline __attribute__((always_inline)) void dense_rows1(int kind, const mm_args *A, int64_t r0, int64_t r1) {
    int64_t r = r0;
#if PK_SIMD
    if (A->k * 4 > DENSE_X1) {
        for (; r + 3 < r1; r += 4) dense_group1(kind, A, r, 4);
        for (; r < r1; r++) dense_group1(kind, A, r, 1);
        return;
    }
#endif
    for (; r < r1; r++) dense_row(kind, A, r);
}

#endif /* POLY_ROWS_DENSE_TILES_H */

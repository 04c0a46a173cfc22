/* gemm(kind, x, out, w, aux, n, k, m, threads): out [n, m] = x [n, k] @ W.T for any number of
 * input rows and any stored form the dequantizer reads (prefill).
 *
 * Why not dequantize + BLAS sgemm: on a 2-core machine the OpenMP threads of the C kernels spin
 * after each region while OpenBLAS's threads run (and the other way round), measured as up to
 * 40 % of an MoE prefill; and the dequantized tile makes a round trip through memory. Here one
 * OpenMP region does everything: each thread takes panels of GR weight rows, dequantizes them
 * (bitwise like the numpy decoders), packs them k-major in chunks of KC (P[kk][GR], in L2),
 * and a register tile of GT tokens x GR rows accumulates with FMA over the chunk. */
#ifndef POLY_GEMM_PANELS_H
#define POLY_GEMM_PANELS_H
#include "core/common.h"
#include "core/prefetch.h"
#include "rows/avx512.h"
#include "rows/dense_dot.h"
#include "core/activations.h"
#include "gemm/vector.h"

#define GR (2 * GL) /* weight rows per panel: two vectors */
#if PK_AVX512
#define GT 12 /* tokens per register tile: 24 of the 32 vector registers accumulate */
#else
#define GT 6 /* 12 of the 16 */
#endif
/* TILE(nt) for a count nt of tokens 1..GT, each case a tile of constant size (the tiles' loops
 * and registers unrolled per size); other counts: nothing */
#if GT > 6
#define GT_WIDE(TILE) case 12: TILE(12); break; case 11: TILE(11); break; case 10: TILE(10); break; \
    case 9: TILE(9); break; case 8: TILE(8); break; case 7: TILE(7); break;
#else
#define GT_WIDE(TILE)
#endif
#define GT_SWITCH(nt, TILE)                                                                                 \
    switch (nt) {                                                                                           \
    GT_WIDE(TILE)                                                                                           \
    case 6: TILE(6); break; case 5: TILE(5); break; case 4: TILE(4); break; case 3: TILE(3); break;        \
    case 2: TILE(2); break; case 1: TILE(1); break; default: break;                                        \
    }
#ifndef KC
#define KC 512 /* k per packed chunk: GR * KC floats (64 KiB on AVX-512, in L2; 256 or 384: the same speed) */
#endif

/* The bytes a panel reads next (the next chunk of its F16 rows, or the next panel's stored rows),
 * asked for a cache line an iteration of the tiles' loops: the packing otherwise waited on
 * memory (a third of a 1B f16 42-token prompt) */
typedef struct {
    const char *p;        /* the current row's bytes */
    int64_t stride, bytes; /* between rows, a row's bytes to ask for */
    int64_t rows, at;      /* rows left, offset in the current row */
} pf_cur;

static inline __attribute__((always_inline)) void pf_step(pf_cur *c) {
    if (c->rows <= 0) return;
#if PK_AVX512
    prefetch_line(c->p + c->at);
#else /* into L2: AVX2's chunk P (32 KB) fills L1 (one thread, f32 42 rows 58-79 -> 84-88 GFLOP/s) */
    prefetch_l2(c->p + c->at);
#endif
    if ((c->at += 64) >= c->bytes) { c->at = 0; c->p += c->stride; c->rows--; }
}

/* one token's two accumulators to out[0..rows) (+)= */
static inline void gemm_store(float *o, gvec c0, gvec c1, int64_t rows, int add) {
    float t[GR];
    GVEC_STORE(t, c0);
    GVEC_STORE(t + GL, c1);
    if (add)
        for (int64_t r = 0; r < rows; r++) o[r] += t[r];
    else
        for (int64_t r = 0; r < rows; r++) o[r] = t[r];
}

/* Named accumulators, not arrays: with arrays gcc kept a stack copy of every accumulator in
 * the AVX2 build (a store per FMA, 110 instead of ~250 GFLOP/s). */
#define T_ACC(i) gvec c0_##i = GVEC_ZERO(), c1_##i = GVEC_ZERO();
#define T_FMA(i)                                                                             \
    if (NT > i) {                                                                            \
        const gvec b = GVEC_BCAST(x + i * ldx + kk);                                             \
        c0_##i = GVEC_FMA(b, w0, c0_##i);                                                      \
        c1_##i = GVEC_FMA(b, w1, c1_##i);                                                      \
    }
#define T_OUT(i) \
    if (NT > i) gemm_store(out + i * ldo, c0_##i, c1_##i, rows, add);
#define T_ALL(M) M(0) M(1) M(2) M(3) M(4) M(5) T_HI(M)
#if GT > 6
#define T_HI(M) M(6) M(7) M(8) M(9) M(10) M(11)
#else
#define T_HI(M)
#endif

/* out[i, 0..rows) (+)= sum over kk < kc of x[i, kk] * P[kk][r] for i < NT (a constant) */
static inline __attribute__((always_inline)) void gemm_tile(const float *P, const float *x, int64_t ldx, int64_t kc,
                                                            float *out, int64_t ldo, int64_t rows, int add, const int NT,
                                                            pf_cur *pf) {
    T_ALL(T_ACC)
    for (int64_t kk = 0; kk < kc; kk++) {
        pf_step(pf);
        const gvec w0 = GVEC_LOAD(P + kk * GR), w1 = GVEC_LOAD(P + kk * GR + GL);
        T_ALL(T_FMA)
    }
    T_ALL(T_OUT)
}

/* every token of x against one packed chunk, GT tokens at a time (the rest with a smaller tile) */
static void gemm_chunk(const float *P, const float *x, int64_t n, int64_t ldx, int64_t kc, float *out, int64_t ldo,
                       int64_t rows, int add, pf_cur *pf) {
    int64_t i = 0;
#define G_TILE(NT) gemm_tile(P, x + i * ldx, ldx, kc, out + i * ldo, ldo, rows, add, NT, pf)
    for (; i + GT <= n; i += GT) G_TILE(GT);
    GT_SWITCH(n - i, G_TILE)
#undef G_TILE
}

/* P[kk][r] = src[r * lds + kk] for kk < kc, r < rows (rows past them zero): k-major panel; src
 * float32, float16 or bfloat16 (kind K_F32/K_F16/K_BF16: the stored rows packed straight, no
 * dequantized copy) */
static inline __attribute__((always_inline)) void gemm_pack_any(const void *src, int64_t lds, int64_t rows, int64_t kc,
                                                                float *P, const int kind) {
    int64_t kk = 0;
    const int64_t esz = kind == K_F32 ? 4 : 2;
    const uint8_t *s = (const uint8_t *)src;
#if PK_SIMD
    if (rows == GR) { /* whole 8 x 8 blocks on 8 lanes: ~0.4 instructions an element, not 2; eight rows
                       * at a time (at k 2048 all GR rows' lines at one column share an L1 set:
                       * a column of blocks at a time re-read each line from L2, 42 tokens 0.7x) */
        for (int64_t r = 0; r < GR; r += 8)
            for (int64_t c = 0; c + 8 <= kc; c += 8)
                transpose8(s + esz * (r * lds + c), lds, P + c * GR + r, GR, kind);
        kk = kc & ~(int64_t)7;
    }
#endif
    if (rows < GR) memset(P, 0, (size_t)(kc * GR) * 4);
    for (; kk < kc; kk++)
        for (int64_t r = 0; r < rows; r++) P[kk * GR + r] = load1(kind, s + esz * r * lds, kk);
}

static void gemm_pack(const float *src, int64_t lds, int64_t rows, int64_t kc, float *P) {
    gemm_pack_any(src, lds, rows, kc, P, K_F32);
}

#endif /* POLY_GEMM_PANELS_H */

/* Float32 / float16 rows laid out by 16, k-major (poly.runtime.repack.km16, made once per matrix
 * when the fused plan is built, KM16_KINDS): group g holds rows 16 g .. 16 g
 * + 15 as [k][16] elements, i.e. already the gemm panels' packed chunk P[kk][GR] (AVX-512: two
 * groups' vectors a panel). A prompt's panels read it in the tile (float16: a vcvtph2ps per vector)
 * instead of packing the stored rows chunk by chunk (13 % of an AVX2 1B f16 42-token prompt; one
 * thread [8192 x 2048] f16, 42 rows: 95 -> 107 GFLOP/s, 16 rows 77 -> 100; 1B F32 42-token
 * prompt AVX-512 72-87 -> 99-102 tok/s). Decode rows (n = 1) run each row's sums in the panels'
 * order (a chunk's FMA chain from zero, chunks added in turn), so a row's result is the same
 * whatever the other rows of a call. */
#ifndef POLY_FORMATS_FLOAT_KMAJOR16_H
#define POLY_FORMATS_FLOAT_KMAJOR16_H
#include "core/common.h"
#include "rows/avx512.h"
#include "gemm/dequant.h"
#include "gemm/vector.h"
#include "gemm/panels.h"

#if PK_KM16
#define FG (GR / 16) /* groups a panel: 1 on AVX2 (a group's two halves), 2 on AVX-512 (one each) */
#if PK_AVX512
#define KM16_H(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#else
#define KM16_H(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#endif
/* 16 rows' elements at column kk of a [k][16] group: float32 (F32 a constant 1) or float16 */
#define KM16_LOAD(H, kk) (F32 ? GVEC_LOAD((const float *)(H) + (kk) * 16) : KM16_H((const uint16_t *)(H) + (kk) * 16))

/* out[i, 0..rows) (+)= sum over kk < kc of x[i, kk] * W[kk][r] for i < NT: gemm_tile on the
 * layout, the panel's two vectors of rows at H0 and H1 */
static inline __attribute__((always_inline)) void km16_tile(const void *H0, const void *H1, const float *x, int64_t ldx,
                                                           int64_t kc, float *out, int64_t ldo, int64_t rows, int add,
                                                           const int NT, pf_cur *pf, const int F32) {
    T_ALL(T_ACC)
    for (int64_t kk = 0; kk < kc; kk++) {
        pf_step(pf);
        const gvec w0 = KM16_LOAD(H0, kk), w1 = KM16_LOAD(H1, kk);
        T_ALL(T_FMA)
    }
    T_ALL(T_OUT)
}

#define KM16_T(NT) km16_tile(H0, H1, x + i * ldx, ldx, kc, out + i * ldo, ldo, rows, add, NT, pf, F32)
static inline __attribute__((always_inline)) void km16_chunk(const void *H0, const void *H1, const float *x, int64_t n,
                                                            int64_t ldx, int64_t kc, float *out, int64_t ldo,
                                                            int64_t rows, int add, pf_cur *pf, const int F32) {
    int64_t i = 0;
    for (; i + GT <= n; i += GT) KM16_T(GT);
    GT_SWITCH(n - i, KM16_T)
}

/* AVX-512 float16: the tile converts the panel's elements again for every 12 tokens; past two
 * tiles the chunk is converted once into P and the packed tiles take it (one thread [8192 x 2048]:
 * 42 rows 101 -> 103 GFLOP/s, 128 rows 102 -> 108; 16 or 24 rows lose 3-6 %; on AVX2 every
 * count loses: its 128-bit conversions are cheap). The same FMA chains as km16_tile: the same bits. */
#define KM16_CONVERT PK_AVX512
static inline void km16_convert_h(const uint16_t *A, const uint16_t *B, int64_t kc, float *P) {
    for (int64_t kk = 0; kk < kc; kk++) {
        GVEC_STORE(P + kk * GR, KM16_H(A + kk * 16));
        GVEC_STORE(P + kk * GR + GL, KM16_H(B + kk * 16));
    }
}

/* km16_chunk for float16 (P: KC * GR floats when KM16_CONVERT and n > 2 GT) */
static void km16_chunk_h(const void *A, const void *B, const float *x, int64_t n, int64_t ldx, int64_t kc, float *out,
                        int64_t ldo, int64_t rows, int add, pf_cur *pf, float *P) {
    if (!KM16_CONVERT || n <= 2 * GT) {
        km16_chunk(A, B, x, n, ldx, kc, out, ldo, rows, add, pf, 0);
        return;
    }
    km16_convert_h((const uint16_t *)A, (const uint16_t *)B, kc, P);
    gemm_chunk(P, x, n, ldx, kc, out, ldo, rows, add, pf);
}

/* the panel from row r0 (a multiple of 16; rows <= GR of it to out, the matrix's m rows) against n
 * inputs, chunk by chunk; next: the first row of the panel this thread takes next (-1: none), its
 * first chunk asked for meanwhile. On AVX-512 a last panel of one group reads it twice. */
static void km16_group(int kind, const void *hk, int64_t k, int64_t m, const float *x, int64_t ldx, int64_t n,
                      float *out, int64_t ldo, int64_t r0, int64_t rows, int64_t next) {
    const int64_t es = kind == K_F32 ? 4 : 2, gb = 16 * k * es; /* a group's bytes */
    const char *G0 = (const char *)hk + r0 * k * es, *G1 = FG == 1 ? G0 + 8 * es : r0 + 16 < m ? G0 + gb : G0;
    float P[KM16_CONVERT && n > 2 * GT && kind == K_F16 ? KC * GR : 1] __attribute__((aligned(64)));
    for (int64_t c0 = 0; c0 < k; c0 += KC) {
        const int64_t kc = k - c0 < KC ? k - c0 : KC, c1 = c0 + kc;
        pf_cur pf = {0};
        pf.stride = gb;
        if (c1 < k) { pf.p = G0 + c1 * 16 * es; pf.bytes = 16 * es * (k - c1 < KC ? k - c1 : KC); }
        else if (next >= 0) { pf.p = (const char *)hk + next * k * es; pf.bytes = 16 * es * (k < KC ? k : KC); }
        pf.rows = pf.p ? FG : 0; /* past the matrix's last row: a prefetch never faults */
        const char *A = G0 + c0 * 16 * es, *B = G1 + c0 * 16 * es;
        if (kind == K_F32) km16_chunk(A, B, x + c0, n, ldx, kc, out, ldo, rows, c0 > 0, &pf, 1);
        else km16_chunk_h(A, B, x + c0, n, ldx, kc, out, ldo, rows, c0 > 0, &pf, P);
    }
}

/* one input against the panels from row r0 on (whole ones, out = their 2 GR rows): each row's sums
 * in km16_group's order, two panels' chains at once (one panel's two chains wait on the FMA latency) */
static inline __attribute__((always_inline)) void km16_dec2(const char *A, int64_t k, const float *x, float *out,
                                                           const int F32) {
    const int64_t es = F32 ? 4 : 2, h1 = FG == 1 ? 8 * es : 16 * k * es; /* a panel's second vector */
    const char *B = A + GR * k * es;
    for (int64_t c0 = 0; c0 < k; c0 += KC) {
        const int64_t c1 = k - c0 < KC ? k : c0 + KC;
        gvec a0 = GVEC_ZERO(), a1 = a0, b0 = a0, b1 = a0;
        for (int64_t kk = c0; kk < c1; kk++) {
            const gvec v = GVEC_BCAST(x + kk);
            a0 = GVEC_FMA(v, KM16_LOAD(A, kk), a0);
            a1 = GVEC_FMA(v, KM16_LOAD(A + h1, kk), a1);
            b0 = GVEC_FMA(v, KM16_LOAD(B, kk), b0);
            b1 = GVEC_FMA(v, KM16_LOAD(B + h1, kk), b1);
        }
        gemm_store(out, a0, a1, GR, c0 > 0);
        gemm_store(out + GR, b0, b1, GR, c0 > 0);
    }
}

/* rows [r0, r1) against n inputs x (row stride ldx), out row i at out + i * ldo (no bias): panels
 * from the first group's row on straight to out, a panel the range cuts through by a scratch tile */
static void km16_range(int kind, const void *hk, int64_t k, const float *x, int64_t ldx, int64_t n, float *out,
                      int64_t ldo, int64_t r0, int64_t r1) {
    float t[MAX_N * GR];
    const int64_t es = kind == K_F32 ? 4 : 2;
    for (int64_t a = r0 / 16 * 16; a < r1;) {
        const int64_t lo = a > r0 ? a : r0, hi = a + GR < r1 ? a + GR : r1;
        if (n == 1 && lo == a && a + 2 * GR <= r1) {
            const char *A = (const char *)hk + a * k * es;
            if (kind == K_F32) km16_dec2(A, k, x, out + a, 1);
            else km16_dec2(A, k, x, out + a, 0);
            a += 2 * GR;
            continue;
        }
        if (lo == a) {
            km16_group(kind, hk, k, r1, x, ldx, n, out + a, ldo, a, hi - a, a + GR < r1 ? a + GR : -1);
        } else
            for (int64_t c = 0; c < n; c += MAX_N) { /* MAX_N inputs at a time through the tile */
                const int64_t nc = n - c < MAX_N ? n - c : MAX_N;
                km16_group(kind, hk, k, hi, x + c * ldx, ldx, nc, t, GR, a, hi - a, -1);
                for (int64_t i = 0; i < nc; i++) memcpy(out + (c + i) * ldo + lo, t + i * GR + (lo - a), (size_t)(hi - lo) * 4);
            }
        a += GR;
    }
}
#else
static void km16_group(int kind, const void *hk, int64_t k, int64_t m, const float *x, int64_t ldx, int64_t n,
                      float *out, int64_t ldo, int64_t r0, int64_t rows, int64_t next) {
    (void)kind; (void)hk; (void)k; (void)m; (void)x; (void)ldx; (void)n; (void)out; (void)ldo; (void)r0; (void)rows;
    (void)next;
}
static void km16_range(int kind, const void *hk, int64_t k, const float *x, int64_t ldx, int64_t n, float *out,
                      int64_t ldo, int64_t r0, int64_t r1) {
    (void)kind; (void)hk; (void)k; (void)x; (void)ldx; (void)n; (void)out; (void)ldo; (void)r0; (void)r1;
}
#endif

#endif /* POLY_FORMATS_FLOAT_KMAJOR16_H */

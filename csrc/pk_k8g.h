/* K-quant prompts (the q8 scheme's "auto" mode, AVX-512 builds, K8G_ROWS to K8G_MAX input rows):
 * a panel of weight rows is decoded once into int16 weights w = u * s (code times its 16-weight
 * integer scale; |w| <= 63 * 128), offsets and D (K8G_SB bytes per row and super-block, in the
 * thread's gemm buffer); x takes int16 codes with one scale per 256 (x ~= dx * c, |c| <= X16_MAX,
 * quantize_x16), and register tiles of 3 rows x 4 inputs sum w . c in int32 over a super-block,
 * one vpdpwssd per 32 weights, then add D * dx * sum - offsets . (sums of x per 16) once per
 * super-block. 13-bit activations: ~1e-4 of an output, where llama.cpp's 8-bit Q8_K codes gave
 * ~1e-2 (docs/performance.md, session 5). Included by pk_kernels.h after pk_k8.h. */
#ifndef PK_K8G_H
#define PK_K8G_H

/* auto mode: K-quant products of K8G_ROWS to K8G_MAX input rows. On AVX-512 both this and the
 * float gemm peak at 32 multiply-adds per cycle and core (vpdpwssd, or two FMA pipes); here the weights are
 * decoded once per panel instead of per 8-row tile, which wins for short prompts (1B Q4_K_M:
 * 16 rows 1.4-1.9x the float tiles, 64 rows 1.17x the float gemm); from ~256 rows both run alike
 * and the float path, exact, stays. */
#define K8G_ROWS 4
/* AVX2 (no VNNI, 16-byte-pair madd + add): slower than the float tiles from 16 rows (Q4_K
 * [5632 x 2048]: 8 rows 1.08x, 16 rows 0.91x, 64 rows 0.56x), so the AVX-512 build only */
#define K8G_MAX (PK_AVX512 ? 128 : 0)
#define K8G_SB 640 /* decoded super-block: 256 int16 weights, 16 float offsets, D (+pad) */
#if PK_AVX512 /* the kernels: AVX-512 builds only */
#define K8G_T 4 /* inputs per register tile: 3 x 4 int32 + 3 x 4 float accumulators (4 x 3: */
#define K8G_R 3 /* 1B Q4_K_M prompts of 16 / 42 tokens 138 / 185 tok/s, 3 x 4: 151 / 199) */
typedef __m512i k8v;
typedef __m512 k8f;
#define K8_STEP 32 /* int16 lanes per vector */
#define K8_LOADI(p) _mm512_loadu_si512((const void *)(p))
#define K8_ZEROI() _mm512_setzero_si512()
#define K8_ZEROF() _mm512_setzero_ps()
#define K8_CVT(v) _mm512_cvtepi32_ps(v)
#define K8_F(v) _mm512_set1_ps(v)
#define K8_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define K8_FNMA(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define K8_SUM(v) _mm512_reduce_add_ps(v)
#ifdef __AVX512VNNI__
#define K8_DPW(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define K8_DPW(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif

/* rows [r0, r0 + rows) decoded into buf: per row and super-block, K8G_SB bytes */
static void k8g_decode(int kind, const mm_args *A, int64_t r0, int64_t rows, uint8_t *buf) {
    const int64_t nsb = A->nb / 8;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t sb = 0; sb < nsb; sb++) {
            const uint8_t *p = A->w + (r0 + r) * A->rb + sb * BLOCK_BYTES[kind];
            uint8_t *d = buf + (r * nsb + sb) * K8G_SB;
            k8_sb S;
            k8_scales(kind, p, &S);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) { /* sub-block j: 32 weights at 64 j bytes */
                const __m256i u = k8_codes(kind, p, j);
                const __m256i w0 = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(u)), _mm256_set1_epi16(S.s[2 * j]));
                const __m256i w1 = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(u, 1)), _mm256_set1_epi16(S.s[2 * j + 1]));
                _mm256_storeu_si256((__m256i *)(d + 64 * j), w0);
                _mm256_storeu_si256((__m256i *)(d + 64 * j + 32), w1);
            }
            memcpy(d + 512, S.o, 64);
            memcpy(d + 576, &S.D, 4);
        }
}

/* decoded rows r.. (R of them) x inputs t0.. (T): out[t][col + r] */
static inline __attribute__((always_inline)) void k8g_tile(const mm_args *A, const uint8_t *buf, int64_t nsb, int64_t r,
                                                           int64_t t0, float *out, int64_t ldo, int64_t col, const int R,
                                                           const int T) {
    const int16_t *x16 = (const int16_t *)A->xq;
    k8f fa[K8G_R][K8G_T];
#pragma GCC unroll 4
    for (int rr = 0; rr < R; rr++)
#pragma GCC unroll 4
        for (int tt = 0; tt < T; tt++) fa[rr][tt] = K8_ZEROF();
    for (int64_t sb = 0; sb < nsb; sb++) {
        k8v ia[K8G_R][K8G_T];
#pragma GCC unroll 4
        for (int rr = 0; rr < R; rr++)
#pragma GCC unroll 4
            for (int tt = 0; tt < T; tt++) ia[rr][tt] = K8_ZEROI();
#pragma GCC unroll 16
        for (int v = 0; v < 256 / K8_STEP; v++) {
            k8v w[K8G_R];
#pragma GCC unroll 4
            for (int rr = 0; rr < R; rr++) w[rr] = K8_LOADI(buf + ((r + rr) * nsb + sb) * K8G_SB + v * K8_STEP * 2);
#pragma GCC unroll 4
            for (int tt = 0; tt < T; tt++) {
                const k8v x = K8_LOADI(x16 + ((t0 + tt) * A->nb + sb * 8) * 32 + v * K8_STEP);
#pragma GCC unroll 4
                for (int rr = 0; rr < R; rr++) ia[rr][tt] = K8_DPW(ia[rr][tt], w[rr], x);
            }
        }
#pragma GCC unroll 4
        for (int rr = 0; rr < R; rr++) {
            const uint8_t *d = buf + ((r + rr) * nsb + sb) * K8G_SB;
            const float *o = (const float *)(d + 512);
            float D;
            memcpy(&D, d + 576, 4);
#pragma GCC unroll 4
            for (int tt = 0; tt < T; tt++) {
                const int64_t b = (t0 + tt) * A->nb + sb * 8;
                const float *xs = A->xs16 + b * 2;
                fa[rr][tt] = K8_FMA(K8_CVT(ia[rr][tt]), K8_F(D * A->dx[b]), fa[rr][tt]);
                fa[rr][tt] = K8_FNMA(_mm512_loadu_ps(o), _mm512_loadu_ps(xs), fa[rr][tt]);
            }
        }
    }
#pragma GCC unroll 4
    for (int rr = 0; rr < R; rr++)
#pragma GCC unroll 4
        for (int tt = 0; tt < T; tt++) out[(t0 + tt) * ldo + col + r + rr] = K8_SUM(fa[rr][tt]);
}

#define K8G_TILES(R)                                                                         \
    { switch (tn) {                                                                          \
    case 4: k8g_tile(A, buf, nsb, r, t, out, ldo, r0, R, 4); break;                          \
    case 3: k8g_tile(A, buf, nsb, r, t, out, ldo, r0, R, 3); break;                          \
    case 2: k8g_tile(A, buf, nsb, r, t, out, ldo, r0, R, 2); break;                          \
    default: k8g_tile(A, buf, nsb, r, t, out, ldo, r0, R, 1);                                \
    } }

/* inputs per pass over a panel set: their int16 codes (2 k bytes each, 768 KB in all) stay in L2
 * while every panel of the thread meets them; each pass decodes its panels again (1B Q4_K_M,
 * 42 rows: 256 KB 175 tok/s, 768 KB 193, 1.5 MB 187) */
static inline int64_t k8g_block(int64_t k) {
    const int64_t t = ((int64_t)768 << 10) / (2 * k);
    return t < 16 ? 16 : t;
}

/* A for the inputs [t, ...): its codes, scales and sums from input t on */
static inline mm_args k8g_from(const mm_args *A, int64_t t) {
    mm_args V = *A;
    V.xq = A->xq + t * 2 * A->k;
    V.dx = A->dx + t * A->nb;
    V.xs16 = A->xs16 + t * 2 * A->nb;
    return V;
}

/* out[t][r0 + r] for the n inputs prepared in A (int16 codes with one scale per 256, xs16) and
 * the rows [r0, r0 + rows) of A's matrix; buf holds rows * nb / 8 * K8G_SB bytes */
static void k8g_rows(int kind, const mm_args *A, int64_t n, float *out, int64_t ldo, int64_t r0, int64_t rows,
                     uint8_t *buf) {
    const int64_t nsb = A->nb / 8;
    k8g_decode(kind, A, r0, rows, buf);
    for (int64_t t = 0; t < n; t += K8G_T) {
        const int64_t tn = n - t < K8G_T ? n - t : K8G_T;
        int64_t r = 0;
        for (; r + K8G_R <= rows; r += K8G_R) K8G_TILES(K8G_R)
        if (K8G_R > 2 && rows - r >= 2) { K8G_TILES(2) r += 2; }
        if (r < rows) K8G_TILES(1)
    }
}

/* rows [r0, r1) in panels of pr rows, the inputs in blocks of k8g_block (one thread) */
static void k8g_range(int kind, const mm_args *A, int64_t n, float *out, int64_t ldo, int64_t r0, int64_t r1,
                      int64_t pr, uint8_t *buf) {
    const int64_t tb = k8g_block(A->k);
    for (int64_t t = 0; t < n; t += tb) {
        const mm_args V = k8g_from(A, t);
        for (int64_t rp = r0; rp < r1; rp += pr)
            k8g_rows(kind, &V, n - t < tb ? n - t : tb, out + t * ldo, ldo, rp, r1 - rp < pr ? r1 - rp : pr, buf);
    }
}
#endif

#endif /* PK_K8G_H */

/* Float16 rows laid out by 16, k-major (poly.runtime.repack.f16k, made once per matrix when the
 * fused plan is built, on 8-lane builds): group g holds rows 16 g .. 16 g + 15 as [k][16] halves,
 * i.e. already the gemm panels' packed chunk P[kk][GR] in float16. A prompt's panels convert it
 * in the tile (two vcvtph2ps per 12 FMAs) instead of packing the stored rows chunk by chunk
 * (the packing was 13 % of an AVX2 1B f16 42-token prompt; one thread [8192 x 2048] f16, 42
 * rows: 95 -> 107 GFLOP/s; 16 rows 77 -> 100). Decode rows (n = 1) run each row's sums in the
 * panels' order (a chunk's FMA chain from zero, chunks added in turn), so a row's result is the
 * same whatever the other rows of a call. Included by pk_gemm.h after gemm_chunk. */
#ifndef PK_F16K_H
#define PK_F16K_H

#if PK_F16K
/* out[i, 0..rows) (+)= sum over kk < kc of x[i, kk] * H[kk][r] for i < NT: gemm_tile on halves */
static inline __attribute__((always_inline)) void f16k_tile(const uint16_t *H, const float *x, int64_t ldx, int64_t kc,
                                                            float *out, int64_t ldo, int64_t rows, int add, const int NT,
                                                            pf_cur *pf) {
    T_ALL(T_ACC)
    for (int64_t kk = 0; kk < kc; kk++) {
        pf_step(pf);
        const gv w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(H + kk * 16))),
                 w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(H + kk * 16 + 8)));
        T_ALL(T_FMA)
    }
    T_ALL(T_OUT)
}

static void f16k_chunk(const uint16_t *H, const float *x, int64_t n, int64_t ldx, int64_t kc, float *out, int64_t ldo,
                       int64_t rows, int add, pf_cur *pf) {
    int64_t i = 0;
    for (; i + GT <= n; i += GT) f16k_tile(H, x + i * ldx, ldx, kc, out + i * ldo, ldo, rows, add, GT, pf);
    switch (n - i) {
    case 5: f16k_tile(H, x + i * ldx, ldx, kc, out + i * ldo, ldo, rows, add, 5, pf); break;
    case 4: f16k_tile(H, x + i * ldx, ldx, kc, out + i * ldo, ldo, rows, add, 4, pf); break;
    case 3: f16k_tile(H, x + i * ldx, ldx, kc, out + i * ldo, ldo, rows, add, 3, pf); break;
    case 2: f16k_tile(H, x + i * ldx, ldx, kc, out + i * ldo, ldo, rows, add, 2, pf); break;
    case 1: f16k_tile(H, x + i * ldx, ldx, kc, out + i * ldo, ldo, rows, add, 1, pf); break;
    default: break;
    }
}

/* group g (rows 16 g .., rows <= 16 of them to out) against n inputs, chunk by chunk; next: the
 * first row of the group this thread takes next (-1: none), its first chunk asked for meanwhile */
static void f16k_group(const uint16_t *hk, int64_t k, const float *x, int64_t ldx, int64_t n, float *out, int64_t ldo,
                       int64_t g, int64_t rows, int64_t next) {
    const uint16_t *G = hk + g * 16 * k; /* [k][16] */
    for (int64_t c0 = 0; c0 < k; c0 += KC) {
        const int64_t kc = k - c0 < KC ? k - c0 : KC, c1 = c0 + kc;
        pf_cur pf = {0};
        if (c1 < k) { pf.p = (const char *)(G + c1 * 16); pf.bytes = 32 * (k - c1 < KC ? k - c1 : KC); pf.rows = 1; }
        else if (next >= 0) { pf.p = (const char *)(hk + next * k); pf.bytes = 32 * (k < KC ? k : KC); pf.rows = 1; }
        f16k_chunk(G + c0 * 16, x + c0, n, ldx, kc, out, ldo, rows, c0 > 0, &pf);
    }
}

/* one input against groups g and g + 1 (both whole, out = their 32 rows): each row's sums in
 * f16k_group's order, two groups' chains at once (one group's two chains wait on the FMA latency) */
static void f16k_dec2(const uint16_t *hk, int64_t k, const float *x, float *out, int64_t g) {
    const uint16_t *A = hk + g * 16 * k, *B = A + 16 * k;
    for (int64_t c0 = 0; c0 < k; c0 += KC) {
        const int64_t c1 = k - c0 < KC ? k : c0 + KC;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
        for (int64_t kk = c0; kk < c1; kk++) {
            const __m256 v = _mm256_broadcast_ss(x + kk);
            a0 = _mm256_fmadd_ps(v, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(A + kk * 16))), a0);
            a1 = _mm256_fmadd_ps(v, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(A + kk * 16 + 8))), a1);
            b0 = _mm256_fmadd_ps(v, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(B + kk * 16))), b0);
            b1 = _mm256_fmadd_ps(v, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(B + kk * 16 + 8))), b1);
        }
        gemm_store(out, a0, a1, 16, c0 > 0);
        gemm_store(out + 16, b0, b1, 16, c0 > 0);
    }
}

/* rows [r0, r1) against n inputs x (row stride ldx), out row i at out + i * ldo (no bias): whole
 * groups straight to out, a group the range cuts through by a scratch tile */
static void f16k_range(const uint16_t *hk, int64_t k, const float *x, int64_t ldx, int64_t n, float *out, int64_t ldo,
                       int64_t r0, int64_t r1) {
    float t[MAX_N * 16];
    for (int64_t g = r0 / 16, end = (r1 + 15) / 16; g < end;) {
        const int64_t a = 16 * g, lo = a > r0 ? a : r0, hi = a + 16 < r1 ? a + 16 : r1;
        if (n == 1 && lo == a && a + 32 <= r1) { f16k_dec2(hk, k, x, out + a, g); g += 2; continue; }
        if (lo == a && hi == a + 16) {
            f16k_group(hk, k, x, ldx, n, out + a, ldo, g, 16, g + 1 < end ? a + 16 : -1);
        } else
            for (int64_t c = 0; c < n; c += MAX_N) { /* MAX_N inputs at a time through the tile */
                const int64_t nc = n - c < MAX_N ? n - c : MAX_N;
                f16k_group(hk, k, x + c * ldx, ldx, nc, t, 16, g, 16, -1);
                for (int64_t i = 0; i < nc; i++) memcpy(out + (c + i) * ldo + lo, t + i * 16 + (lo - a), (size_t)(hi - lo) * 4);
            }
        g++;
    }
}
#else
static void f16k_group(const uint16_t *hk, int64_t k, const float *x, int64_t ldx, int64_t n, float *out,
                              int64_t ldo, int64_t g, int64_t rows, int64_t next) {
    (void)hk; (void)k; (void)x; (void)ldx; (void)n; (void)out; (void)ldo; (void)g; (void)rows; (void)next;
}
static void f16k_range(const uint16_t *hk, int64_t k, const float *x, int64_t ldx, int64_t n, float *out,
                              int64_t ldo, int64_t r0, int64_t r1) {
    (void)hk; (void)k; (void)x; (void)ldx; (void)n; (void)out; (void)ldo; (void)r0; (void)r1;
}
#endif

#endif /* PK_F16K_H */

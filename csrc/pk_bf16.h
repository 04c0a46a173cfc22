/* BF16 prompts on vdpbf16ps (the auto mode, AVX-512 builds on a CPU with AVX512_BF16): x rounded
 * to bfloat16 (round to nearest even, as llama.cpp's BF16 x BF16 dots), two products of a weight
 * pair per 32-bit lane, so an instruction does 32 multiply-adds where the float gemm's FMA does 16
 * (1B BF16 prompts were FMA-bound at 0.71-0.92x llama.cpp). The products of two bfloat16 are exact
 * in float32: the only rounding beyond the float path's is x's (relative 2^-9 an element).
 *
 * A panel of GR = 32 rows is packed per chunk of KC columns as P[kp][r] = row r's bf16 pair at
 * columns 2kp, 2kp + 1: one 32-bit word of the stored row, so packing is gemm_pack_any's 32-bit
 * transpose of the stored words. A tile converts its tokens' chunk of x to bf16 pairs once (1/32
 * of its instructions) and broadcasts a pair per token against the two vectors of weight pairs.
 * Only where the gemm panels run (GEMM_ROWS rows and more): below, packing costs more than it
 * saves (1B [8192 x 2048], 4 rows: 2.6 ms against the row kernels' 1.7). Included by pk_gemm.h. */
#ifndef PK_BF16_H
#define PK_BF16_H

#if PK_AVX512
#define PK_BF16_TARGET __attribute__((target("avx512bf16")))

/* whether this CPU runs vdpbf16ps (the AVX-512 build is compiled without it: Ice Lake and
 * Skylake-X have AVX-512 but not BF16) */
static int pk_bf16_ok(void) {
    static int ok = -1;
    if (ok < 0) ok = __builtin_cpu_supports("avx512bf16") ? 1 : 0;
    return ok;
}

#define BF_ACC(i) __m512 b0_##i = _mm512_setzero_ps(), b1_##i = _mm512_setzero_ps();
#define BF_DOT(i)                                                                            \
    if (NT > i) {                                                                            \
        const __m512bh b = (__m512bh)_mm512_set1_epi32((int)xb[i * (KC / 2) + kp]);          \
        b0_##i = _mm512_dpbf16_ps(b0_##i, w0, b);                                            \
        b1_##i = _mm512_dpbf16_ps(b1_##i, w1, b);                                            \
    }
#define BF_OUT(i) \
    if (NT > i) gemm_store(out + i * ldo, b0_##i, b1_##i, rows, add);
#define BF_ALL(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)

/* out[i, 0..rows) (+)= the chunk's products for tokens i < NT (a constant, <= GT = 12); kc even */
static inline __attribute__((always_inline)) PK_BF16_TARGET void bf16_tile(const uint32_t *P, const float *x, int64_t ldx,
                                                                          int64_t kc, float *out, int64_t ldo, int64_t rows,
                                                                          int add, const int NT, pf_cur *pf) {
    uint32_t xb[GT * (KC / 2)]; /* the tokens' x as bf16 pairs */
    for (int i = 0; i < NT; i++) {
        int64_t kk = 0;
        for (; kk + 32 <= kc; kk += 32) {
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i * ldx + kk + 16), _mm512_loadu_ps(x + i * ldx + kk));
            _mm512_storeu_si512((void *)(xb + i * (KC / 2) + kk / 2), (__m512i)v);
        }
        if (kk < kc) { /* the last pairs: zeros past kc */
            const __mmask16 lo = (__mmask16)((1u << (kc - kk < 16 ? kc - kk : 16)) - 1);
            const __mmask16 hi = (__mmask16)(kc - kk > 16 ? (1u << (kc - kk - 16)) - 1 : 0);
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, x + i * ldx + kk + 16),
                                                   _mm512_maskz_loadu_ps(lo, x + i * ldx + kk));
            _mm512_mask_storeu_epi32(xb + i * (KC / 2) + kk / 2, (__mmask16)((1u << ((kc - kk) / 2)) - 1), (__m512i)v);
        }
    }
    BF_ALL(BF_ACC)
    for (int64_t kp = 0; kp < kc / 2; kp++) {
        pf_step(pf);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(P + kp * GR));
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(P + kp * GR + GL));
        BF_ALL(BF_DOT)
    }
    BF_ALL(BF_OUT)
}

#define BF_TILE(T) bf16_tile(P, x + i * ldx, ldx, kc, out + i * ldo, ldo, rows, add, T, pf)
/* tokens [i, i + nt) (nt <= GT) in one tile */
static inline __attribute__((always_inline)) PK_BF16_TARGET void bf16_span(const uint32_t *P, const float *x, int64_t i, int64_t nt,
                                                                          int64_t ldx, int64_t kc, float *out, int64_t ldo,
                                                                          int64_t rows, int add, pf_cur *pf) {
    switch (nt) {
    case 12: BF_TILE(12); break;
    case 11: BF_TILE(11); break;
    case 10: BF_TILE(10); break;
    case 9: BF_TILE(9); break;
    case 8: BF_TILE(8); break;
    case 7: BF_TILE(7); break;
    case 6: BF_TILE(6); break;
    case 5: BF_TILE(5); break;
    case 4: BF_TILE(4); break;
    case 3: BF_TILE(3); break;
    case 2: BF_TILE(2); break;
    case 1: BF_TILE(1); break;
    default: break;
    }
}

/* tiles of equal size (16 tokens: 8 + 8, not 12 + 4: a small tile loads the weights for few dots) */
static PK_BF16_TARGET void bf16_chunk(const uint32_t *P, const float *x, int64_t n, int64_t ldx, int64_t kc, float *out,
                                      int64_t ldo, int64_t rows, int add, pf_cur *pf) {
    const int64_t tiles = (n + GT - 1) / GT;
    for (int64_t t = 0, i = 0; t < tiles; t++) {
        const int64_t nt = n / tiles + (t < n % tiles);
        bf16_span(P, x, i, nt, ldx, kc, out, ldo, rows, add, pf);
        i += nt;
    }
}

/* gemm_panel for BF16 rows [r0, r0 + rows) with D->bf (k even): chunks packed as 32-bit words */
static PK_BF16_TARGET void bf16_panel(const dq_args *D, const float *x, int64_t n, float *out, int64_t m, int64_t r0,
                                      int64_t rows, float *P, int64_t next) {
    const int64_t k = D->k;
    const uint8_t *w = D->w + r0 * D->rb;
    for (int64_t c0 = 0; c0 < k; c0 += KC) {
        const int64_t kc = k - c0 < KC ? k - c0 : KC;
        pf_cur pf = pf_chunk(K_BF16, D, r0, rows, next, c0 + kc, 2);
        gemm_pack_any(w + 2 * c0, k / 2, rows, kc / 2, P, K_F32); /* bf16 pairs as 32-bit words */
        bf16_chunk((const uint32_t *)P, x + c0, n, k, kc, out + r0, m, rows, c0 > 0, &pf);
    }
}
#else
static inline int pk_bf16_ok(void) { return 0; }
#endif

/* whether a product of kind's rows takes the bf16 panels: the auto mode (q8 2), BF16, k even */
static inline int bf16_rows(int kind, int q8, int64_t k) { return q8 == 2 && kind == K_BF16 && k % 2 == 0 && pk_bf16_ok(); }

#endif /* PK_BF16_H */

/* BF16 prompts' gemm panels on vdpbf16ps (csrc/formats/vdpbf16_rows.h has the why and the row tiles):
 * GEMM_ROWS rows and more.
 *
 * A panel of GR = 32 rows is packed per chunk of KC columns as P[kp][r] = row r's bf16 pair at
 * columns 2kp, 2kp + 1: one 32-bit word of the stored row, so packing is gemm_pack_any's 32-bit
 * transpose of the stored words. A tile converts its tokens' chunk of x to bf16 pairs once (1/32
 * of its instructions) and broadcasts a pair per token against the two vectors of weight pairs. */
#ifndef POLY_FORMATS_VDPBF16_PANELS_H
#define POLY_FORMATS_VDPBF16_PANELS_H
#include "core/common.h"
#include "rows/avx512.h"
#include "formats/vdpbf16_rows.h"
#include "gemm/dequant.h"
#include "gemm/vector.h"
#include "gemm/panels.h"
#include "gemm/prefetch.h"

#if PK_AVX512
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
static inline __attribute__((always_inline)) PK_VDPBF16_TARGET void bf16_tile(const uint32_t *P, const float *x, int64_t ldx,
                                                                          int64_t kc, float *out, int64_t ldo, int64_t rows,
                                                                          int add, const int NT, pf_cur *pf) {
    uint32_t xb[GT * (KC / 2)]; /* the tokens' x as bf16 pairs */
    for (int i = 0; i < NT; i++) bf16_x(x + i * ldx, kc, (uint16_t *)(xb + i * (KC / 2)));
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
static inline __attribute__((always_inline)) PK_VDPBF16_TARGET void bf16_span(const uint32_t *P, const float *x, int64_t i, int64_t nt,
                                                                          int64_t ldx, int64_t kc, float *out, int64_t ldo,
                                                                          int64_t rows, int add, pf_cur *pf) {
    GT_SWITCH(nt, BF_TILE)
}

/* tiles of equal size (16 tokens: 8 + 8, not 12 + 4: a small tile loads the weights for few dots) */
static PK_VDPBF16_TARGET void bf16_chunk(const uint32_t *P, const float *x, int64_t n, int64_t ldx, int64_t kc, float *out,
                                      int64_t ldo, int64_t rows, int add, pf_cur *pf) {
    const int64_t tiles = (n + GT - 1) / GT;
    for (int64_t t = 0, i = 0; t < tiles; t++) {
        const int64_t nt = n / tiles + (t < n % tiles);
        bf16_span(P, x, i, nt, ldx, kc, out, ldo, rows, add, pf);
        i += nt;
    }
}

/* gemm_panel for BF16 rows [r0, r0 + rows) with D->bf (k even): chunks packed as 32-bit words */
static PK_VDPBF16_TARGET void bf16_panel(int kind, const dq_args *D, const float *x, int64_t ldx, int64_t n, float *out, int64_t m,
                                      int64_t r0, int64_t rows, float *P, int64_t next) {
    const int64_t k = D->k;
    const uint8_t *w = D->w + r0 * D->rb;
    for (int64_t c0 = 0; c0 < k; c0 += KC) {
        const int64_t kc = k - c0 < KC ? k - c0 : KC;
        pf_cur pf = pf_chunk(kind, D, r0, rows, next, c0 + kc, 2);
        gemm_pack_any(w + 2 * c0, k / 2, rows, kc / 2, P, K_F32); /* bf16 pairs as 32-bit words */
        bf16_chunk((const uint32_t *)P, x + c0, n, ldx, kc, out + r0, m, rows, c0 > 0, &pf);
    }
}
#endif

#endif /* POLY_FORMATS_VDPBF16_PANELS_H */

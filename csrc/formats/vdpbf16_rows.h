/* BF16 prompts on vdpbf16ps (the auto mode, AVX-512 builds on a CPU with AVX512_BF16): x rounded
 * to bfloat16 (round to nearest even, as llama.cpp's BF16 x BF16 dots), two products of a weight
 * pair per 32-bit lane, so an instruction does 32 multiply-adds where the float path's FMA does
 * 16 (1B BF16 prompts were FMA-bound at 0.68-0.98x llama.cpp on Zen 4). The products of two
 * bfloat16 are exact in float32: the only rounding beyond the float path's is x's (relative 2^-9
 * an element). Prompts of KQP_MIN to MAX_N rows: the row tiles here, x converted once per call
 * (mm_args xb); from GEMM_ROWS rows the gemm panels (formats/vdpbf16_panels.h). Decode rows stay on the float
 * path (bandwidth-bound; a row's numbers the same alone and in company). */
#ifndef POLY_FORMATS_VDPBF16_ROWS_H
#define POLY_FORMATS_VDPBF16_ROWS_H
#include "core/common.h"
#include "formats/kinds.h"
#include "rows/avx512.h"
#include "rows/dense_tiles.h"
#include "formats/kquant_panels.h"

#if PK_AVX512
#define PK_VDPBF16_TARGET __attribute__((target("avx512bf16")))

/* whether this CPU runs vdpbf16ps (the AVX-512 build is compiled without it: Ice Lake and
 * Skylake-X have AVX-512 but not BF16) */
static int pk_bf16_ok(void) {
    static int ok = -1;
    if (ok < 0) ok = __builtin_cpu_supports("avx512bf16") ? 1 : 0;
    return ok;
}

/* x[0..k) rounded to bf16 (nearest even) into xb */
static inline PK_VDPBF16_TARGET void bf16_x(const float *x, int64_t k, uint16_t *xb) {
    int64_t j = 0;
    for (; j + 32 <= k; j += 32)
        _mm512_storeu_si512((void *)(xb + j), (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + j + 16), _mm512_loadu_ps(x + j)));
    if (j < k) {
        const int64_t t = k - j;
        const __mmask16 lo = (__mmask16)((1u << (t < 16 ? t : 16)) - 1), hi = (__mmask16)(t > 16 ? (1u << (t - 16)) - 1 : 0);
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, x + j + 16), _mm512_maskz_loadu_ps(lo, x + j));
        _mm512_mask_storeu_epi16(xb + j, (__mmask32)((1ull << t) - 1), (__m512i)v);
    }
}

static inline float bf16_f(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* rows r .. r + R (R 4 or 1) times the nn (<= 4) inputs from c on, x as bf16 (A->xb): one
 * accumulator per (row, input), each x load feeding R dots; the sums in reduce16's order */
static inline __attribute__((always_inline)) PK_VDPBF16_TARGET void bf16_rtile(const mm_args *A, int64_t r, int64_t c,
                                                                           const int nn, const int R) {
    const int64_t k = A->k, k32 = k / 32 * 32;
    const uint16_t *w = (const uint16_t *)A->w + r * k;
    __m512 a[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j < k32; j += 32) {
        __m512bh wv[4];
#pragma GCC unroll 4
        for (int q = 0; q < R; q++) {
            tile_prefetch((const uint8_t *)(w + q * k + j), 64);
            wv[q] = (__m512bh)_mm512_loadu_si512((const void *)(w + q * k + j));
        }
#pragma GCC unroll 4
        for (int i = 0; i < nn; i++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(A->xb + (c + i) * k + j));
#pragma GCC unroll 4
            for (int q = 0; q < R; q++) a[4 * q + i] = _mm512_dpbf16_ps(a[4 * q + i], wv[q], xv);
        }
    }
    float s[16];
    _mm512_storeu_ps(s, reduce16(a));
#pragma GCC unroll 4
    for (int q = 0; q < R; q++)
#pragma GCC unroll 4
        for (int i = 0; i < nn; i++) {
            float t = s[4 * q + i];
            for (int64_t l = j; l < k; l++) t += bf16_f(w[q * k + l]) * bf16_f(A->xb[(c + i) * k + l]);
            A->out[(c + i) * A->ldo + r + q] = t;
        }
}

#define BF_RT(nn) (R == 4 ? bf16_rtile(A, r, c, nn, 4) : bf16_rtile(A, r, c, nn, 1))
/* BF16 rows [r0, r1) for A->n (<= MAX_N) inputs with A->xb set: quads of rows, then one */
static PK_VDPBF16_TARGET void bf16_range(const mm_args *A, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1;) {
        const int R = r + 4 <= r1 ? 4 : 1;
        int64_t c = 0;
        for (; c + 4 <= A->n; c += 4) BF_RT(4);
        switch (A->n - c) {
        case 3: BF_RT(3); break;
        case 2: BF_RT(2); break;
        case 1: BF_RT(1); break;
        default: break;
        }
        r += R;
    }
}
#undef BF_RT
#else
static inline int pk_bf16_ok(void) { return 0; }
static inline void bf16_x(const float *x, int64_t k, uint16_t *xb) { (void)x, (void)k, (void)xb; }
static inline void bf16_range(const mm_args *A, int64_t r0, int64_t r1) { (void)A, (void)r0, (void)r1; }
#endif

/* a flag on the entries' q8 (2 | Q8_EXACT_BFLOAT16): BF16 rows stay on the float path. Python sets it
 * for HF weights (bfloat16 arrays: parity with transformers); GGUF's BF16 takes llama.cpp's dots */
#define Q8_EXACT_BFLOAT16 4

/* whether a product of kind's rows takes the bf16 paths: the auto mode (q8 2, no Q8_EXACT_BFLOAT16),
 * BF16, k even */
/* whether the auto mode (q8) on this CPU takes them at all */
static inline int bf16_auto(int q8) { return q8 == 2 && pk_bf16_ok(); }
static inline int bf16_rows(int kind, int q8, int64_t k) { return q8 == 2 && KINDS[kind]->vdpbf && k % 2 == 0 && pk_bf16_ok(); }

/* whether n rows of a prompt take the bf16 row tiles (below the panels) */
static inline int bf16_tiles(int64_t n) { return n >= KQP_MIN && n <= MAX_N; }

#endif /* POLY_FORMATS_VDPBF16_ROWS_H */

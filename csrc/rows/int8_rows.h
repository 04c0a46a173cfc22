/* The int8-activation kernels (q8 scheme, POLY_ACT_Q8=1): integer dot products of the stored
 * codes with x as int8 codes. */
#ifndef POLY_ROWS_INT8_ROWS_H
#define POLY_ROWS_INT8_ROWS_H
#include "core/common.h"
#include "formats/kinds.h"
#include "core/half.h"
#include "formats/pq_decode.h"
#include "rows/dense_dot.h"
#include "formats/block_decode.h"
#include "formats/block32.h"
#include "rows/quant_tiles.h"
#include "formats/kquant_rows.h"

#if PK_SIMD
/* q8 scheme: integer dot products of the stored codes with the int8 activation codes
 * (like llama.cpp's q8 activations, plus a residual code): exact int32 sums, * D * dx per block. */
static inline __m256i dot_u8s8(__m256i u, __m256i s) { /* 8 int32 sums of 4 u8*s8 products */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline __m256i dot_s8s8(__m256i q, __m256i s) {
    return dot_u8s8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(s, q));
}

/* pq8_row for the .pq8_sb kinds (IQ4_XS) a super-block at a time: its 8 scales and d decoded once, not per
 * sub-block (the row was instruction-bound on them: 1B decode 35 tok/s, IQ4_NL's 50) */
static inline __attribute__((always_inline)) void iq4xs_row(int kind, const mm_args *A, int64_t r, int64_t n) {
    const uint8_t *row = A->w + r * A->rb;
    __m256 acc[2][MAX_N];
    for (int64_t i = 0; i < n; i++) acc[0][i] = acc[1][i] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < A->nb / 8; sb++) {
        const uint8_t *p = row + sb * 136;
        const float d = h2f(p);
        float D[8]; /* as pq_scales_one */
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) D[j] = d * (float)pq_iq4xs_scale(p, j);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const __m256i q = pq_codes_simd(kind, p, j);
            const int64_t b = sb * 8 + j;
            for (int64_t i = 0; i < n; i++) {
                const __m256i xh = _mm256_loadu_si256((const __m256i *)(A->xq + (i * A->nb + b) * 64));
                const __m256 t = _mm256_mul_ps(_mm256_set1_ps(D[j]), _mm256_cvtepi32_ps(dot_s8s8(q, xh)));
                acc[j & 1][i] = _mm256_fmadd_ps(_mm256_set1_ps(A->dx[i * A->nb + b]), t, acc[j & 1][i]);
            }
        }
    }
    for (int64_t i = 0; i < n; i++) A->out[i * A->ldo + r] = hsum(_mm256_add_ps(acc[0][i], acc[1][i]));
}

/* Q5_0/Q5_1/IQ4 rows on x's first code alone (the auto mode, formats/kquant_rows.h pq8_kind), like llama.cpp's
 * q8_0 activations: the stored weights times x's codes (Q5_0 signed, Q5_1's min on the codes'
 * sums too: on x's float sums the rounding error doubled), exact int32 sums a block. Two blocks
 * an iteration into two accumulators: one chain of dependent FMAs bound the row (1B Q5_1
 * decode 29 tok/s, 8 cycles a block). */
static inline __attribute__((always_inline)) void pq8_row(int kind, const mm_args *A, int64_t r, int64_t n) {
    if (KINDS[kind]->pq8_sb) { iq4xs_row(kind, A, r, n); return; }
    const uint8_t *row = A->w + r * A->rb;
    const __m256i one = _mm256_set1_epi8(1);
    __m256 acc[2][MAX_N];
    pq_cache pc = {NULL};
    for (int64_t i = 0; i < n; i++) acc[0][i] = acc[1][i] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < A->nb; b0 += 2)
#pragma GCC unroll 2
        for (int u = 0; u < 2; u++) {
            const int64_t b = b0 + u;
            if (b >= A->nb) break;
            float D, M, m2[2];
            int sgn;
            __m256 lane;
            const __m256i q = pq_q8_codes(kind, row, b, &D, &M, &sgn, &lane, m2, &pc, 1);
            for (int64_t i = 0; i < n; i++) {
                const __m256i xh = _mm256_loadu_si256((const __m256i *)(A->xq + (i * A->nb + b) * 64));
                __m256 t = _mm256_mul_ps(_mm256_set1_ps(D), _mm256_cvtepi32_ps(sgn ? dot_s8s8(q, xh) : dot_u8s8(q, xh)));
                if (KINDS[kind]->m32) t = _mm256_fmadd_ps(_mm256_set1_ps(M), _mm256_cvtepi32_ps(dot_u8s8(one, xh)), t);
                acc[u][i] = _mm256_fmadd_ps(_mm256_set1_ps(A->dx[i * A->nb + b]), t, acc[u][i]);
            }
        }
    for (int64_t i = 0; i < n; i++) A->out[i * A->ldo + r] = hsum(_mm256_add_ps(acc[0][i], acc[1][i]));
}

static inline __attribute__((always_inline)) void quant_row_q8(int kind, const mm_args *A, int64_t r, int64_t n) {
    if (k8_kind(kind)) { k8_row(kind, A, r, n); return; } /* csrc/formats/kquant_rows.h: whole super-blocks */
    if (A->x1 && pq8_kind(kind)) { pq8_row(kind, A, r, n); return; }
    const uint8_t *row = A->w + r * A->rb;
    __m256 vacc[MAX_N];
    float macc[MAX_N];
    pq_cache pc = {NULL};
    for (int64_t i = 0; i < n; i++) { vacc[i] = _mm256_setzero_ps(); macc[i] = 0.0f; }
    for (int64_t b = 0; b < A->nb; b++) {
        __m256i q;
        float D, M = 0.0f;
        int sgn = 0;
        __m256 lane = _mm256_set1_ps(1.0f);
        float m2[2] = {0.0f, 0.0f}; /* .m16 kinds: offsets of the two 16-element halves */
        if (b32_q8_codes(kind, A, r, b, &q, &D, &M, &sgn)) {} /* formats/block32.h */
        else switch (kind) {
        case K_I8: q = _mm256_loadu_si256((const __m256i *)(A->w + r * A->k + b * 32)); D = A->aux[r]; sgn = 1; break;
        default: /* the GGUF kinds (formats/kquant_blocks.h, formats/pq_decode.h) */
            if (!kq_q8_codes(kind, row, b, &q, &D, &M, &sgn, &lane)) q = pq_q8_codes(kind, row, b, &D, &M, &sgn, &lane, m2, &pc, 0);
        }
        for (int64_t i = 0; i < n; i++) {
            const int8_t *xb = A->xq + (i * A->nb + b) * 64; /* [32 high codes, 32 low codes] */
            __m256i xh = _mm256_loadu_si256((const __m256i *)xb), xl = _mm256_loadu_si256((const __m256i *)(xb + 32));
            __m256i ih = sgn ? dot_s8s8(q, xh) : dot_u8s8(q, xh), il = sgn ? dot_s8s8(q, xl) : dot_u8s8(q, xl);
            __m256 s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(il), _mm256_set1_ps(1.0f / XL_SCALE), _mm256_cvtepi32_ps(ih));
            if (!pq_uniform(kind)) s = _mm256_mul_ps(s, lane);
            if (KINDS[kind]->m16) {
                const float *xf = A->x + i * A->k + b * 32; /* the two 16-element sums of x */
                macc[i] += m2[0] * hsum(_mm256_add_ps(_mm256_loadu_ps(xf), _mm256_loadu_ps(xf + 8))) +
                           m2[1] * hsum(_mm256_add_ps(_mm256_loadu_ps(xf + 16), _mm256_loadu_ps(xf + 24)));
            }
            vacc[i] = _mm256_fmadd_ps(_mm256_set1_ps(D * A->dx[i * A->nb + b]), s, vacc[i]);
            macc[i] += M * A->xs[i * A->nb + b];
        }
    }
    for (int64_t i = 0; i < n; i++) A->out[i * A->ldo + r] = hsum(vacc[i]) + macc[i];
}
#define Q8ROW(KIND, n) quant_row_q8(KIND, A, r, n)
#else
#define Q8ROW(KIND, n) quant_row(KIND, A, r, n)
#endif

#endif /* POLY_ROWS_INT8_ROWS_H */

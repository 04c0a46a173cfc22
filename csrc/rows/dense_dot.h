/* Dense rows (float32, float16, bfloat16, int8 codes x row scale) of any k: the loaders and one row's dot product. */
#ifndef POLY_ROWS_DENSE_DOT_H
#define POLY_ROWS_DENSE_DOT_H
#include "core/common.h"
#include "core/half.h"
#include "rows/avx512.h"
#include "formats/kinds.h"
#include "formats/bf16.h"

/* ---- dense rows (any k): float32, float16, bfloat16, int8 codes x row scale ------------- */

static inline float load1(int kind, const uint8_t *row, int64_t j) {
    switch (kind) {
    case K_F32: return ((const float *)row)[j];
    case K_F16: return h2f(row + 2 * j);
    default: return KINDS[kind]->bf16 ? bf16_1(row, j) : (float)((const int8_t *)row)[j];
    }
}

#if PK_SIMD
static inline __m256 load8(int kind, const uint8_t *row, int64_t j) {
    switch (kind) {
    case K_F32: return _mm256_loadu_ps((const float *)row + j);
    case K_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * j)));
    default:
        if (KINDS[kind]->bf16) return bf16_8(row, j); /* formats/bf16.h */
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + j))));
    }
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}
#endif

/* Dense rows (float16/bfloat16/int8 codes; float32 matrices go to BLAS) sum in float32 with
 * four independent 8-wide accumulators, like BLAS sgemv: the same precision class as the
 * dequantize + sgemm prefill path, at memory speed. */
static inline __attribute__((always_inline)) float dense_dot(int kind, const uint8_t *row,
                                                             const float *x, int64_t k) {
    int64_t j = 0;
    float s = 0.0f;
#if PK_SIMD
#if PK_AVX512
    s = dense_dot512(kind, row, x, k, &j);
#endif
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; j + 32 <= k; j += 32) {
        a0 = _mm256_fmadd_ps(load8(kind, row, j), _mm256_loadu_ps(x + j), a0);
        a1 = _mm256_fmadd_ps(load8(kind, row, j + 8), _mm256_loadu_ps(x + j + 8), a1);
        a2 = _mm256_fmadd_ps(load8(kind, row, j + 16), _mm256_loadu_ps(x + j + 16), a2);
        a3 = _mm256_fmadd_ps(load8(kind, row, j + 24), _mm256_loadu_ps(x + j + 24), a3);
    }
    for (; j + 8 <= k; j += 8) a0 = _mm256_fmadd_ps(load8(kind, row, j), _mm256_loadu_ps(x + j), a0);
    s += hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
    float acc[8] = {0};
    for (; j + 8 <= k; j += 8)
        for (int l = 0; l < 8; l++) acc[l] += load1(kind, row, j + l) * x[j + l];
    for (int l = 0; l < 8; l++) s += acc[l];
#endif
    for (; j < k; j++) s += load1(kind, row, j) * x[j];
    return s;
}

#endif /* POLY_ROWS_DENSE_DOT_H */

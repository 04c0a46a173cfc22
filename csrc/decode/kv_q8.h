/* The q8_0 KV cache's rows (llama.cpp's q8_0 K/V: 32 values a block, int8 codes and a float16
 * scale, 8.5 bits a value against float16's 16). A position's row holds the codes of every KV head
 * [kvh * hd] then the scales [kvh * hd / 32] (poly/nn/kvcache.py q8_rows). Attention reads a head's
 * codes at k and its scales at k + so (so: the group's scale offset from its codes), converts the
 * codes to float in registers and applies a block's scale once per 32 values: at long context a
 * position costs 17/32 of float16's bytes for the same instructions a value. */
#ifndef POLY_DECODE_KV_Q8_H
#define POLY_DECODE_KV_Q8_H
#include "core/common.h"
#include "core/half.h"

#define KV8_BLOCK 32

/* a position's row bytes for kvd values of each of k and v (es: 4 float32, 2 float16, 1 q8_0) */
static inline int64_t kv_row_bytes(int64_t kvd, int es) {
    return es == 1 ? kvd + kvd / KV8_BLOCK * 2 : kvd * es;
}

/* n values (a multiple of 32) of src as one q8_0 row at dst: llama.cpp's quantize_row_q8_0 as
 * poly/nn/kvcache.py q8_quantize computes it (d = amax / 127, codes x * (1/d) rounded half away) */
static void kv8_store(uint8_t *dst, const float *src, int64_t n) {
    int8_t *codes = (int8_t *)dst;
    uint8_t *sc = dst + n;
    for (int64_t b = 0; b < n / KV8_BLOCK; b++) {
        const float *x = src + b * KV8_BLOCK;
        float amax = 0.0f;
        for (int j = 0; j < KV8_BLOCK; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < KV8_BLOCK; j++) {
            volatile float y = x[j] * inv; /* as numpy: the product rounded before the half is added */
            codes[b * KV8_BLOCK + j] = (int8_t)truncf(y + copysignf(0.5f, y));
        }
        const uint16_t h = f2h(d);
        sc[2 * b] = (uint8_t)(h & 255);
        sc[2 * b + 1] = (uint8_t)(h >> 8);
    }
}

/* value j of a q8_0 head row (codes at p, scales at p + so) */
static inline __attribute__((always_inline)) float kv8_ld1(const uint8_t *p, int64_t so, int64_t j) {
    return h2f(p + so + 2 * (j / KV8_BLOCK)) * (float)((const int8_t *)p)[j];
}

/* q . k over hd values of one q8_0 head row, scalar */
static inline float kv8_dot(const uint8_t *k, int64_t so, const float *q, int64_t hd) {
    float s = 0.0f;
    for (int64_t b = 0; b < hd / KV8_BLOCK; b++) {
        float t = 0.0f;
        for (int j = 0; j < KV8_BLOCK; j++) t += q[b * KV8_BLOCK + j] * (float)((const int8_t *)k)[b * KV8_BLOCK + j];
        s += h2f(k + so + 2 * b) * t;
    }
    return s;
}

#if PK_SIMD
/* 8 codes at p as floats */
static inline __attribute__((always_inline)) __m256 kv8_ld8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* the 8 block scales of block b of the rows k[0..7] as one vector */
static inline __attribute__((always_inline)) __m256 kv8_scales8(const uint8_t *const k[8], int64_t so, int64_t b) {
#define S16(j) (*(const short *)(k[j] + so + 2 * b))
    return _mm256_cvtph_ps(_mm_setr_epi16(S16(0), S16(1), S16(2), S16(3), S16(4), S16(5), S16(6), S16(7)));
#undef S16
}

/* the 8 dot products q . k[j] (q8_0 rows, hd % 32 == 0) as one vector: per block the 8 keys'
 * float sums are reduced together by one transpose-add, then times their 8 scales */
static inline __attribute__((always_inline)) __m256 kv8_dot8x(const uint8_t *const k[8], int64_t so, const float *q,
                                                              int64_t hd) {
    __m256 out = _mm256_setzero_ps();
    for (int64_t b = 0; b < hd / KV8_BLOCK; b++) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t c = b * KV8_BLOCK; c < (b + 1) * KV8_BLOCK; c += 8) {
            const __m256 qv = _mm256_loadu_ps(q + c);
            a0 = _mm256_fmadd_ps(kv8_ld8(k[0] + c), qv, a0);
            a1 = _mm256_fmadd_ps(kv8_ld8(k[1] + c), qv, a1);
            a2 = _mm256_fmadd_ps(kv8_ld8(k[2] + c), qv, a2);
            a3 = _mm256_fmadd_ps(kv8_ld8(k[3] + c), qv, a3);
            a4 = _mm256_fmadd_ps(kv8_ld8(k[4] + c), qv, a4);
            a5 = _mm256_fmadd_ps(kv8_ld8(k[5] + c), qv, a5);
            a6 = _mm256_fmadd_ps(kv8_ld8(k[6] + c), qv, a6);
            a7 = _mm256_fmadd_ps(kv8_ld8(k[7] + c), qv, a7);
        }
        const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
        const __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
        out = _mm256_fmadd_ps(s, kv8_scales8(k, so, b), out);
    }
    return out;
}

/* acc[0..NV) += p * V (one q8_0 head row v, scales at v + so; NV * 8 = hd, NV % 4 == 0) */
static inline __attribute__((always_inline)) void kv8_axpy(__m256 *acc, float p, const uint8_t *v, int64_t so,
                                                           const int NV) {
    for (int b = 0; b < NV / 4; b++) {
        const __m256 pb = _mm256_set1_ps(p * h2f(v + so + 2 * b));
        for (int c = 4 * b; c < 4 * b + 4; c++) acc[c] = _mm256_fmadd_ps(pb, kv8_ld8(v + 8 * c), acc[c]);
    }
}
#endif

#endif /* POLY_DECODE_KV_Q8_H */

/* The K-quant prompt panels' inputs: x's int8 codes and sums, and the weight streams' prefetch. */
#ifndef POLY_FORMATS_KQUANT_PANELS_PREP_H
#define POLY_FORMATS_KQUANT_PANELS_PREP_H
#include "core/common.h"
#include "core/prefetch.h"
#include "rows/avx512.h"
#include "rows/dense_dot.h"
#include "core/activations.h"
#include "formats/kquant_panels.h"
#include "formats/kquant_interleave8_panels.h"
static inline void kqp_prefetch(int kind, const uint8_t *w, int64_t rb, const uint8_t *rk, int64_t nsb, int64_t r0,
                                int64_t rows, int64_t sb) {
    if (sb + KQP_PF >= nsb) return;
    if (rk) { kil8_prefetch(kind, rk, nsb, r0, rows, sb + KQP_PF); return; }
    const int64_t sbb = kqp_sbb(kind);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t l = 0; l < sbb; l += 64) prefetch_line((const char *)w + (r0 + r) * rb + (sb + KQP_PF) * sbb + l);
}

/* x's codes for the 32-blocks [b0, b1): the 32 codes c at xq + cb b; at xo + ocb b int32 -32 and
 * -4 times their sums per 16 (the Q6_K / Q3_K code offsets, folded into the integer sums), then
 * float dx * sum(c) per 32 (KQP_SLOTS, form -1: the fused step's buffers, cb 64, xo at xq + 32,
 * where any kind may read an input), or just the slots of `form` (gemm: packed, ocb 2); dx per
 * block; dx * sum(c) per 16 in xs16 (the other kinds' offsets meet x's codes, not x) */
static inline void quantize_xi(const float *x, int8_t *xq, int64_t cb, int32_t *xo, int64_t ocb, float *dx, float *xs16,
                               int64_t b0, int64_t b1, int form) {
    for (int64_t b = b0; b < b1; b++) {
        const float *xb = x + b * 32;
        int8_t *c = xq + b * cb;
        const float amax = absmax(xb, 32);
        if (!isfinite(amax)) {
            dx[b] = NAN; xs16[2 * b] = xs16[2 * b + 1] = NAN;
            memset(c, 0, 32); memset(xo + b * ocb, 0, (size_t)ocb * 4);
            continue;
        }
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int32_t s[2] = {0, 0};
#if PK_AVX512 /* |x * id| <= 127 already: rounding needs no clamp */
        for (int h = 0; h < 2; h++) {
            const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * h), _mm512_set1_ps(id)));
            _mm_storeu_si128((__m128i *)(c + 16 * h), _mm512_cvtepi32_epi8(v));
            s[h] = _mm512_reduce_add_epi32(v);
        }
#elif PK_SIMD /* the same codes on 8 lanes (rint = the default rounding of cvtps) */
        __m256i v[4];
        for (int q = 0; q < 4; q++) v[q] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * q), _mm256_set1_ps(id)));
        _mm256_storeu_si256((__m256i *)c, pack32i(v[0], v[1], v[2], v[3]));
        for (int h = 0; h < 2; h++) s[h] = hsum_i32(_mm256_add_epi32(v[2 * h], v[2 * h + 1]));
#else
        for (int l = 0; l < 32; l++) {
            const int v = (int)fminf(fmaxf(rintf(xb[l] * id), -127.0f), 127.0f);
            c[l] = (int8_t)v;
            s[l >> 4] += v;
        }
#endif
        const float s32 = d * (float)(s[0] + s[1]); /* Q4_K/Q5_K: one min per 32 */
        int32_t o[KQP_SLOTS + 2] = {-32 * s[0], -32 * s[1], -4 * s[0], -4 * s[1], 0, -128 * (s[0] + s[1])}; /* ocb 2: room */
        memcpy(o + 4, &s32, 4);
        if (form < 0) memcpy(xo + b * ocb, o, KQP_SLOTS * 4);
        else memcpy(xo + b * ocb, o + kqp_slot(form, 1), (size_t)ocb * 4);
        dx[b] = d;
        xs16[2 * b] = d * (float)s[0];
        xs16[2 * b + 1] = d * (float)s[1];
    }
}

#endif /* POLY_FORMATS_KQUANT_PANELS_PREP_H */

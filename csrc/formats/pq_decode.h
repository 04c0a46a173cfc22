/* The 32-element sub-block decoder of the GGUF kinds (record .pq): a sub-block's scales (pq_sc,
 * cached a super-block at a time for the .super kinds) and int8 codes from the kinds' own files
 * (formats/gguf_blocks.h, formats/kquant_blocks.h), made into floats for the float rows, int8
 * codes for the int8 rows, or dequantized rows bitwise equal to gguf-py. */
#ifndef POLY_FORMATS_PQ_DECODE_H
#define POLY_FORMATS_PQ_DECODE_H
#include "core/common.h"
#include "formats/block_bits.h"
#include "formats/gguf_blocks.h"
#include "formats/kinds.h"

static inline int pq_kind(int kind) { return KINDS[kind]->pq; }
/* kinds whose 32-element sub-block has one scale and one offset (value = D * code + M) */
static inline int pq_uniform(int kind) { return !KINDS[kind]->halves; }

static inline __attribute__((always_inline)) const uint8_t *pq_scales(int kind, const uint8_t *row, int64_t b, pq_sc *s, pq_cache *pc) {
    if (!(PK_SIMD && KINDS[kind]->super)) return pq_scales_one(kind, row, b, s);
    const uint8_t *p = row + (b >> 3) * BLOCK_BYTES[kind];
    if (pc->p != p) pq_fill(kind, row, b & ~(int64_t)7, p, pc);
    *s = pc->s[b & 7];
    return p;
}

/* Matmul decoder (float path): the 32 values of sub-block b themselves (D = 1, M = 0). */
static inline __attribute__((always_inline)) void pq_dec_scalar(int kind, const uint8_t *row, int64_t b, float *q, pq_cache *pc) {
    pq_sc s;
    int8_t c[32];
    const uint8_t *p = pq_scales(kind, row, b, &s, pc);
    pq_codes_scalar(kind, p, b, c);
    for (int l = 0; l < 32; l++) q[l] = s.d[l >> 4] * (float)c[l] + s.m[l >> 4];
}

#if PK_SIMD
/* Matmul decoder (float path): the codes with D, M when the sub-block is uniform, else the values
 * themselves (D = 1, M = 0). */
static inline __attribute__((always_inline)) void pq_dec_simd(int kind, const uint8_t *row, int64_t b, __m256 v[4], float *D, float *M,
                               pq_cache *pc) {
    pq_sc s;
    const uint8_t *p = pq_scales(kind, row, b, &s, pc);
    pq_widen(pq_codes_simd(kind, p, b), v);
    if (pq_uniform(kind)) { *D = s.d[0]; *M = s.m[0]; return; }
    for (int l = 0; l < 4; l++)
        v[l] = _mm256_fmadd_ps(v[l], _mm256_set1_ps(s.d[l >> 1]), _mm256_set1_ps(s.m[l >> 1]));
    *D = 1.0f; *M = 0.0f;
}
#endif

#if PK_SIMD
/* int8-activation path: codes of sub-block b with D, M (uniform kinds) or per-half scales in
 * `lane` (lanes 0-3 = elements 0-15) and, for the .m16 kinds, per-half offsets m2; sgn: signed
 * codes; x1: x's first code alone (formats/gguf_blocks.h pq_q8_raw) */
static inline __attribute__((always_inline)) __m256i pq_q8_codes(int kind, const uint8_t *row, int64_t b, float *D, float *M, int *sgn,
                                  __m256 *lane, float *m2, pq_cache *pc, const int x1) {
    pq_sc s;
    const uint8_t *p = pq_scales(kind, row, b, &s, pc);
    __m256i q;
    if (pq_q8_raw(kind, p, &s, x1, &q, D, M)) { *sgn = 0; return q; }
    *sgn = KINDS[kind]->sgn;
    if (pq_uniform(kind)) { *D = s.d[0]; *M = s.m[0]; }
    else {
        *D = 1.0f; *M = 0.0f;
        *lane = _mm256_set_m128(_mm_set1_ps(s.d[1]), _mm_set1_ps(s.d[0]));
        m2[0] = s.m[0]; m2[1] = s.m[1];
    }
    return pq_codes_simd(kind, p, b);
}
#endif


/* Dequantize a row of k elements, bitwise equal to gguf-py: one multiply, then one add. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif
static inline void pq_dq_row(int kind, const uint8_t *row, int64_t k, float *dst) {
    pq_cache pc = {NULL};
    for (int64_t b = 0; b < k / 32; b++, dst += 32) {
        pq_sc s;
        const uint8_t *p = pq_scales(kind, row, b, &s, &pc);
#if PK_SIMD
        __m256 v[4];
        pq_widen(pq_codes_simd(kind, p, b), v);
        for (int l = 0; l < 4; l++) {
            __m256 y = _mm256_mul_ps(_mm256_set1_ps(s.d[l >> 1]), v[l]);
            if (s.has_m) y = _mm256_add_ps(y, _mm256_set1_ps(s.m[l >> 1]));
            _mm256_storeu_ps(dst + 8 * l, y);
        }
#else
        int8_t c[32];
        pq_codes_scalar(kind, p, b, c);
        for (int l = 0; l < 32; l++) {
            const float y = s.d[l >> 4] * (float)c[l];
            dst[l] = s.has_m ? y + s.m[l >> 4] : y;
        }
#endif
    }
}
#pragma GCC pop_options

#endif /* POLY_FORMATS_PQ_DECODE_H */

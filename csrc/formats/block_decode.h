/* The 32-element quantized blocks of every stored kind, decoded to floats (scalar and 8-lane): value = q * D + M. */
#ifndef POLY_FORMATS_BLOCK_DECODE_H
#define POLY_FORMATS_BLOCK_DECODE_H
#include "core/common.h"
#include "core/half.h"
#include "formats/pq_decode.h"

/* ---- 32-element quantized blocks ---------------------------------------------------------- */

/* Scalar decoders: codes of block b of row r as floats q[32], value = q * D + M. */
static inline void q4_nibbles(const uint8_t *p, uint8_t x, float *q) {
    for (int l = 0; l < 16; l++) {
        q[l] = (float)((p[l] ^ x) & 15);
        q[l + 16] = (float)((p[l] ^ x) >> 4);
    }
}

static inline __attribute__((always_inline)) void dec_scalar(int kind, const mm_args *A, int64_t r, int64_t b, float *q, float *D, float *M,
                              pq_cache *pc) {
    const uint8_t *row = A->w + r * A->rb;
    switch (kind) {
    case K_LOOM_Q4: /* nibble ^ 8 = code + 8; x is reordered so lows then highs line up */
        q4_nibbles(A->w + (r * A->nb + b) * 16, 0x88, q);
        *D = A->aux[r * A->nb + b]; *M = -8.0f * *D; return;
    case K_Q4_0:
        q4_nibbles(row + b * 18 + 2, 0, q); *D = h2f(row + b * 18); *M = -8.0f * *D; return;
    case K_Q4_1:
        q4_nibbles(row + b * 20 + 4, 0, q); *D = h2f(row + b * 20); *M = h2f(row + b * 20 + 2); return;
    case K_Q8_0: {
        const int8_t *c = (const int8_t *)(row + b * 34 + 2);
        for (int l = 0; l < 32; l++) q[l] = (float)c[l];
        *D = h2f(row + b * 34); *M = 0.0f; return;
    }
    default:
        if (kq_dec_scalar(kind, row, b, q, D, M)) return;
        pq_dec_scalar(kind, row, b, q, pc); *D = 1.0f; *M = 0.0f; return;
    }
}

#if PK_SIMD
static inline void widen_i8(__m256i b, __m256 v[4]) {
    __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

static inline void nib16(const uint8_t *p, uint8_t x, __m256 v[4]) { /* lows 0..15, highs 16..31 */
    __m128i b = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_set1_epi8((char)x));
    __m128i m = _mm_set1_epi8(15);
    widen_u8(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m)), v);
}

static inline __attribute__((always_inline)) void dec_simd(int kind, const mm_args *A, int64_t r, int64_t b, __m256 v[4], float *D, float *M,
                            pq_cache *pc) {
    const uint8_t *row = A->w + r * A->rb;
    switch (kind) {
    case K_LOOM_Q4:
        nib16(A->w + (r * A->nb + b) * 16, 0x88, v); *D = A->aux[r * A->nb + b]; *M = -8.0f * *D; return;
    case K_Q4_0: nib16(row + b * 18 + 2, 0, v); *D = h2f(row + b * 18); *M = -8.0f * *D; return;
    case K_Q4_1: nib16(row + b * 20 + 4, 0, v); *D = h2f(row + b * 20); *M = h2f(row + b * 20 + 2); return;
    case K_Q8_0:
        widen_i8(_mm256_loadu_si256((const __m256i *)(row + b * 34 + 2)), v);
        *D = h2f(row + b * 34); *M = 0.0f; return;
    default:
        if (kq_dec_simd(kind, row, b, v, D, M)) return;
        pq_dec_simd(kind, row, b, v, D, M, pc); return;
    }
}
#endif

#endif /* POLY_FORMATS_BLOCK_DECODE_H */

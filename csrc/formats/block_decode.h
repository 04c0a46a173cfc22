/* The 32-element quantized blocks of every stored kind, decoded to floats (scalar and 8-lane): value = q * D + M;
 * each kind's decoder is in its own file (formats/block32.h, formats/kquant_blocks.h, formats/pq_decode.h). */
#ifndef POLY_FORMATS_BLOCK_DECODE_H
#define POLY_FORMATS_BLOCK_DECODE_H
#include "core/common.h"
#include "core/half.h"
#include "formats/block32.h"
#include "formats/kquant_blocks.h"
#include "formats/pq_decode.h"

/* Scalar decoders: codes of block b of row r as floats q[32], value = q * D + M. */
static inline __attribute__((always_inline)) void dec_scalar(int kind, const mm_args *A, int64_t r, int64_t b, float *q, float *D, float *M,
                              pq_cache *pc) {
    const uint8_t *row = A->w + r * A->rb;
    if (b32_dec_scalar(kind, A, r, b, q, D, M) || kq_dec_scalar(kind, row, b, q, D, M)) return;
    pq_dec_scalar(kind, row, b, q, pc); *D = 1.0f; *M = 0.0f;
}

#if PK_SIMD
static inline __attribute__((always_inline)) void dec_simd(int kind, const mm_args *A, int64_t r, int64_t b, __m256 v[4], float *D, float *M,
                            pq_cache *pc) {
    const uint8_t *row = A->w + r * A->rb;
    if (b32_dec_simd(kind, A, r, b, v, D, M) || kq_dec_simd(kind, row, b, v, D, M)) return;
    pq_dec_simd(kind, row, b, v, D, M, pc);
}
#endif

#endif /* POLY_FORMATS_BLOCK_DECODE_H */

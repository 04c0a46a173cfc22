/* BF16's own file (bfloat16 rows, GGUF's BF16): its record (core/common.h kind_rec, collected in
 * formats/kinds.h) and its elements as float32, one, 8 or 16 at a time (rows/dense_dot.h's
 * loaders): the 16 bits are a float32's high half. Its prompts on vdpbf16ps:
 * formats/vdpbf16_rows.h, formats/vdpbf16_panels.h. */
#ifndef POLY_FORMATS_BF16_H
#define POLY_FORMATS_BF16_H
#include "core/common.h"

static const kind_rec REC_BF16 = {.bf16 = 1, .vdpbf = 1};

static inline float bf16_1(const uint8_t *row, int64_t j) {
    uint32_t u = (uint32_t)((const uint16_t *)row)[j] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if PK_SIMD
static inline __m256 bf16_8(const uint8_t *row, int64_t j) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * j))), 16));
}
#endif

#if PK_AVX512
static inline __m512 bf16_16(const uint8_t *row, int64_t j) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 2 * j))), 16));
}
#endif

#endif /* POLY_FORMATS_BF16_H */

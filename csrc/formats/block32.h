/* The 32-element one-scale kinds' own file: Loom Q4 (the .entity q4 bake: a flat stream of
 * 16-byte nibble blocks, float32 block scales in aux, x's blocks reordered evens then odds), and
 * GGUF Q4_0, Q4_1, Q8_0. Their records (core/common.h kind_rec, collected in formats/kinds.h)
 * and the code that knows their bytes: a block's codes, scale D and offset M (value = q * D + M)
 * for the float rows, the int8 rows, the 16-lane rows and the dequantized rows. */
#ifndef POLY_FORMATS_BLOCK32_H
#define POLY_FORMATS_BLOCK32_H
#include "core/common.h"
#include "core/half.h"
#include "formats/block_bits.h"

static const kind_rec REC_LOOM_Q4 = {.aux = AUX_BLOCKS, .flat = 1, .loom8 = 1, .nib4 = 1, .il16 = IL16_SYM};
static const kind_rec REC_Q4_0 = {.nib4 = 1, .il16 = IL16_SYM};
static const kind_rec REC_Q4_1 = {.nib4 = 1, .il16 = IL16_MIN};
static const kind_rec REC_Q8_0 = {.il16 = IL16_Q8};

/* Scalar decoders: codes of block b of row r as floats q[32], value = q * D + M. */
static inline void q4_nibbles(const uint8_t *p, uint8_t x, float *q) {
    for (int l = 0; l < 16; l++) {
        q[l] = (float)((p[l] ^ x) & 15);
        q[l + 16] = (float)((p[l] ^ x) >> 4);
    }
}

/* block b of row r as floats q[32] (formats/block_decode.h dec_scalar); 0 for the other kinds */
static inline __attribute__((always_inline)) int b32_dec_scalar(int kind, const mm_args *A, int64_t r, int64_t b, float *q, float *D, float *M) {
    const uint8_t *row = A->w + r * A->rb;
    switch (kind) {
    case K_LOOM_Q4: /* nibble ^ 8 = code + 8; x is reordered so lows then highs line up */
        q4_nibbles(A->w + (r * A->nb + b) * 16, 0x88, q);
        *D = A->aux[r * A->nb + b]; *M = -8.0f * *D; return 1;
    case K_Q4_0:
        q4_nibbles(row + b * 18 + 2, 0, q); *D = h2f(row + b * 18); *M = -8.0f * *D; return 1;
    case K_Q4_1:
        q4_nibbles(row + b * 20 + 4, 0, q); *D = h2f(row + b * 20); *M = h2f(row + b * 20 + 2); return 1;
    case K_Q8_0: {
        const int8_t *c = (const int8_t *)(row + b * 34 + 2);
        for (int l = 0; l < 32; l++) q[l] = (float)c[l];
        *D = h2f(row + b * 34); *M = 0.0f; return 1;
    }
    default: return 0;
    }
}

#if PK_SIMD
/* ... on 8 lanes (dec_simd) */
static inline __attribute__((always_inline)) int b32_dec_simd(int kind, const mm_args *A, int64_t r, int64_t b, __m256 v[4], float *D, float *M) {
    const uint8_t *row = A->w + r * A->rb;
    switch (kind) {
    case K_LOOM_Q4:
        nib16(A->w + (r * A->nb + b) * 16, 0x88, v); *D = A->aux[r * A->nb + b]; *M = -8.0f * *D; return 1;
    case K_Q4_0: nib16(row + b * 18 + 2, 0, v); *D = h2f(row + b * 18); *M = -8.0f * *D; return 1;
    case K_Q4_1: nib16(row + b * 20 + 4, 0, v); *D = h2f(row + b * 20); *M = h2f(row + b * 20 + 2); return 1;
    case K_Q8_0:
        widen_i8(_mm256_loadu_si256((const __m256i *)(row + b * 34 + 2)), v);
        *D = h2f(row + b * 34); *M = 0.0f; return 1;
    default: return 0;
    }
}

/* ... as 32 codes for the int8 rows (rows/int8_rows.h quant_row_q8): sgn for Q8_0's signed ones */
static inline __attribute__((always_inline)) int b32_q8_codes(int kind, const mm_args *A, int64_t r, int64_t b, __m256i *q, float *D, float *M,
                                                              int *sgn) {
    const uint8_t *row = A->w + r * A->rb;
    switch (kind) {
    case K_LOOM_Q4: *q = nib16_i(A->w + (r * A->nb + b) * 16, 0x88); *D = A->aux[r * A->nb + b]; *M = -8.0f * *D; return 1;
    case K_Q4_0: *q = nib16_i(row + b * 18 + 2, 0); *D = h2f(row + b * 18); *M = -8.0f * *D; return 1;
    case K_Q4_1: *q = nib16_i(row + b * 20 + 4, 0); *D = h2f(row + b * 20); *M = h2f(row + b * 20 + 2); return 1;
    case K_Q8_0: *q = _mm256_loadu_si256((const __m256i *)(row + b * 34 + 2)); *D = h2f(row + b * 34); *sgn = 1; return 1;
    default: return 0;
    }
}

/* ... as 32 int8 codes c (rows/avx512.h dec512) */
static inline __attribute__((always_inline)) int b32_codes(int kind, const mm_args *A, int64_t r, int64_t b, __m256i *c, float *D, float *M) {
    const uint8_t *row = A->w + r * A->rb;
    switch (kind) {
    case K_LOOM_Q4: /* nibble ^ 8 = code + 8 */
        *c = _mm256_xor_si256(pq_nib32(A->w + (r * A->nb + b) * 16), _mm256_set1_epi8(8));
        *D = A->aux[r * A->nb + b]; *M = -8.0f * *D; return 1;
    case K_Q4_0: *c = pq_nib32(row + b * 18 + 2); *D = h2f(row + b * 18); *M = -8.0f * *D; return 1;
    case K_Q4_1: *c = pq_nib32(row + b * 20 + 4); *D = h2f(row + b * 20); *M = h2f(row + b * 20 + 2); return 1;
    case K_Q8_0: *c = pq_ld(row + b * 34 + 2); *D = h2f(row + b * 34); *M = 0.0f; return 1;
    default: return 0;
    }
}
#endif

/* the 4-bit kinds (record .nib4): block b of row r's 16 nibble bytes q, D and M (value = D * code
 * + M), and the mask that turns its nibbles into unsigned codes (Loom: nibble ^ 8 = code + 8) */
static inline __attribute__((always_inline)) int b32_nib4(int kind, const mm_args *A, int64_t r, int64_t b, const uint8_t **q, float *D, float *M) {
    const uint8_t *row = A->w + r * A->rb;
    if (kind == K_LOOM_Q4) { *q = A->w + (r * A->nb + b) * 16; *D = A->aux[r * A->nb + b]; *M = -8.0f * *D; return 0x88; }
    else if (kind == K_Q4_0) { *q = row + b * 18 + 2; *D = h2f(row + b * 18); *M = -8.0f * *D; }
    else { *q = row + b * 20 + 4; *D = h2f(row + b * 20); *M = h2f(row + b * 20 + 2); }
    return 0;
}

/* Row r (bytes `row`; Loom: the flat stream w, scales aux) dequantized to k floats, bitwise like
 * the numpy decoders (gemm/dequant.h dq_row: contraction off); 0 for the other kinds */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif
static inline int b32_dq_row(int kind, const uint8_t *w, const float *aux, const uint8_t *row, int64_t r, int64_t k, float *dst) {
    switch (kind) {
    case K_LOOM_Q4: { /* blocks of the flat matrix may straddle rows: index elements */
        const int64_t e0 = r * k;
#if PK_SIMD
        if (k % 32 == 0) { /* whole blocks per row: nibbles (low = even element) on 8 lanes */
            const __m128i m15 = _mm_set1_epi8(15), m8 = _mm_set1_epi8(8);
            for (int64_t b = e0 >> 5; b < (e0 + k) >> 5; b++, dst += 32) {
                const __m128i p = _mm_loadu_si128((const __m128i *)(w + b * 16));
                const __m128i lo = _mm_and_si128(p, m15), hi = _mm_and_si128(_mm_srli_epi16(p, 4), m15);
                const __m128i c0 = _mm_sub_epi8(_mm_xor_si128(_mm_unpacklo_epi8(lo, hi), m8), m8);
                const __m128i c1 = _mm_sub_epi8(_mm_xor_si128(_mm_unpackhi_epi8(lo, hi), m8), m8);
                __m256 v[4];
                widen_i8(_mm256_set_m128i(c1, c0), v);
                for (int l = 0; l < 4; l++) _mm256_storeu_ps(dst + 8 * l, _mm256_mul_ps(v[l], _mm256_set1_ps(aux[b])));
            }
            return 1;
        }
#endif
        for (int64_t j = 0; j < k; j++) {
            const int64_t e = e0 + j, b = e >> 5, l = e & 31;
            const uint8_t byte = w[b * 16 + (l >> 1)];
            const int c = (int)(((l & 1) ? byte >> 4 : byte & 15) ^ 8) - 8;
            dst[j] = (float)c * aux[b];
        }
        return 1;
    }
    case K_Q4_0:
        for (int64_t b = 0; b < k / 32; b++, dst += 32) {
            const uint8_t *p = row + b * 18 + 2;
            const float d = h2f(row + b * 18);
#if PK_SIMD /* same operations as the scalar loop, 8 lanes: (q - 8) exactly, then one multiply */
            __m256 v[4];
            nib16(p, 0, v);
            for (int l = 0; l < 4; l++)
                _mm256_storeu_ps(dst + 8 * l, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_sub_ps(v[l], _mm256_set1_ps(8.0f))));
            continue;
#endif
            for (int l = 0; l < 16; l++) {
                dst[l] = d * (float)((p[l] & 15) - 8);
                dst[l + 16] = d * (float)((p[l] >> 4) - 8);
            }
        }
        return 1;
    case K_Q4_1:
        for (int64_t b = 0; b < k / 32; b++, dst += 32) {
            const uint8_t *p = row + b * 20 + 4;
            const float d = h2f(row + b * 20), m = h2f(row + b * 20 + 2);
#if PK_SIMD /* multiply, then add: rounded twice like numpy (contraction is off here) */
            __m256 v[4];
            nib16(p, 0, v);
            for (int l = 0; l < 4; l++)
                _mm256_storeu_ps(dst + 8 * l, _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(d), v[l]), _mm256_set1_ps(m)));
            continue;
#endif
            for (int l = 0; l < 16; l++) {
                dst[l] = d * (float)(p[l] & 15) + m;
                dst[l + 16] = d * (float)(p[l] >> 4) + m;
            }
        }
        return 1;
    case K_Q8_0:
        for (int64_t b = 0; b < k / 32; b++, dst += 32) {
            const int8_t *c = (const int8_t *)(row + b * 34 + 2);
            const float d = h2f(row + b * 34);
#if PK_SIMD
            __m256 v[4];
            widen_i8(_mm256_loadu_si256((const __m256i *)c), v);
            for (int l = 0; l < 4; l++) _mm256_storeu_ps(dst + 8 * l, _mm256_mul_ps(v[l], _mm256_set1_ps(d)));
            continue;
#endif
            for (int l = 0; l < 32; l++) dst[l] = (float)c[l] * d;
        }
        return 1;
    default: return 0;
    }
}
#pragma GCC pop_options

#endif /* POLY_FORMATS_BLOCK32_H */

/* The pieces every block decoder is made of, named by what they do (no stored kind in
 * here): a sub-block's scales record, the super-block scale cache, byte and nibble loads. */
#ifndef POLY_FORMATS_BLOCK_BITS_H
#define POLY_FORMATS_BLOCK_BITS_H
#include "core/common.h"

/* a 32-element sub-block's scales: value = d[h] * c + m[h] for half h (m only when has_m) */
typedef struct {
    float d[2], m[2];
    int has_m;
} pq_sc;

static inline void pq_same(pq_sc *s, float d, float m, int has_m) {
    s->d[0] = s->d[1] = d; s->m[0] = s->m[1] = m; s->has_m = has_m;
}

/* a row loop's cache of one super-block's 8 sub-block scales (p = NULL at the start) */
typedef struct {
    const uint8_t *p;
    pq_sc s[8];
} pq_cache;

#if PK_SIMD
static inline __m256i pq_ld(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 16 bytes -> 32: the low nibbles (elements 0-15), then the high nibbles (16-31) */
static inline __m256i pq_nib32(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

/* byte l = 0x10 when bit l of the little-endian uint32 at p is set, else 0 */
static inline __m256i pq_bit4(const uint8_t *p) {
    uint32_t x;
    memcpy(&x, p, 4);
    const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), spread); /* byte l = byte l/8 */
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);  /* 1 << (l % 8) */
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8(16));
}

/* byte l = (byte l of the 32 at p >> sh) & mask */
static inline __m256i pq_field(const uint8_t *p, int sh, int mask) {
    return _mm256_and_si256(_mm256_srli_epi16(pq_ld(p), sh), _mm256_set1_epi8((char)mask));
}

static inline __m256i pq_lut_of(const int8_t *table, __m256i nib) {
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table)), nib);
}

static inline void widen_u8(__m256i b, __m256 v[4]) { /* 32 uint8 -> 4 x 8 floats */
    __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

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

static inline __m256i nib16_i(const uint8_t *p, uint8_t x) {
    __m128i b = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_set1_epi8((char)x));
    __m128i m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

static inline void pq_widen(__m256i b, __m256 v[4]) { /* 32 int8 -> 4 x 8 floats */
    const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

/* a K-quant super-block's integer scales, offsets and D for the int8 rows (formats/kquant_rows.h) */
typedef struct {
    int16_t s[16]; /* integer scale per 16 elements */
    int16_t o[16]; /* integer offset per 16 elements: the offset is om * o */
    float D, om;
} k8_sb;

/* the 16 scales (int8 s8) and offsets (om * the int8 o8) of a super-block into S */
static inline void k8_put(k8_sb *S, __m128i s8, __m128i o8, float om) {
    _mm256_storeu_si256((__m256i *)S->s, _mm256_cvtepi8_epi16(s8));
    _mm256_storeu_si256((__m256i *)S->o, _mm256_cvtepi8_epi16(o8));
    S->om = om;
}
#endif

#if PK_AVX512
/* 32 bytes at q in both halves, 16-bit lanes shifted right by a (low half) and b (high half),
 * each byte masked: k8_codes' pq_field for two sub-blocks at once */
static inline __m512i k8_field2(const uint8_t *q, int a, int b, int mask) {
    const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)q));
    const __m512i sh = _mm512_inserti64x4(_mm512_set1_epi16((short)a), _mm256_set1_epi16((short)b), 1);
    return _mm512_and_si512(_mm512_srlv_epi16(v, sh), _mm512_set1_epi8((char)mask));
}
#endif

#endif /* POLY_FORMATS_BLOCK_BITS_H */

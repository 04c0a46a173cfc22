/* GGUF block kinds read through one 32-element sub-block decoder: Q5_0, Q5_1, Q2_K, Q3_K, Q5_K,
 * IQ4_NL, IQ4_XS, MXFP4 (and Q4_K / Q6_K for dequantizing).
 *
 * A sub-block b of a row gives 32 int8 codes c (element l in byte l) and, per half of 16
 * elements, a scale d[h] and an offset m[h]: value = d[h] * c + m[h] (the offset is added only
 * when has_m, so d * c = -0.0 stays -0.0 as in gguf-py). The scales are computed with the float32
 * operations of gguf-py's numpy dequantizers (gguf/quants.py), so dequantizing with one multiply
 * then one add (no FMA) is bitwise equal to them. Layouts: ggml-common.h block structs. */
#ifndef POLY_FORMATS_GGUF_BLOCKS_H
#define POLY_FORMATS_GGUF_BLOCKS_H
#include "core/common.h"
#include "core/half.h"

typedef struct {
    float d[2], m[2];
    int has_m;
} pq_sc;

static const int8_t PQ_KVALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

/* MXFP4 (GPT-OSS's experts; ggml's block_mxfp4): 17 bytes a block, the e8m0 exponent e, then 16
 * bytes of e2m1 codes (lows, then highs) into this table of twice the values; the scale is
 * 2^(e - 128), which halves them back (ggml_e8m0_to_fp32_half: exact for every byte) */
static const int8_t PQ_KVALUES_MX[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float pq_e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline int pq_kind(int kind) {
    return kind == K_Q4_K || kind == K_Q6_K || kind >= K_Q5_0;
}

/* Q3_K: 6-bit scale j of 16 (low 4 bits in bytes 0-7, high 2 bits in bytes 8-11), minus 32 */
static inline int pq_k3_scale(const uint8_t *s, int j) {
    const int lo = j < 8 ? s[j] & 15 : s[j - 8] >> 4;
    return (lo | (((s[8 + (j & 3)] >> (2 * (j >> 2))) & 3) << 4)) - 32;
}

/* IQ4_XS: 6-bit scale j of 8 of super-block p (low 4 bits in bytes 4-7, high 2 in the uint16 at
 * bytes 2-3), minus 32 */
static inline int pq_iq4xs_scale(const uint8_t *p, int j) {
    const int sh = p[2] | (p[3] << 8);
    return (((p[4 + j / 2] >> (4 * (j & 1))) & 15) | (((sh >> (2 * j)) & 3) << 4)) - 32;
}

/* sub-block j (32 elements) of 256 IQ4 elements from p (IQ4_NL: 8 blocks of 18 bytes, a scale
 * each; IQ4_XS: one super-block, the scales in its header): its scale and its 16 nibble bytes */
static inline float pq_iq4_d(int kind, const uint8_t *p, int j) {
    return kind == K_IQ4_NL ? h2f(p + 18 * j) : h2f(p) * (float)pq_iq4xs_scale(p, j);
}
static inline const uint8_t *pq_iq4_nibs(int kind, const uint8_t *p, int j) {
    return kind == K_IQ4_NL ? p + 18 * j + 2 : p + 8 + 16 * j;
}

/* Q4_K / Q5_K: scale and min j of 8, 6 bits each in 12 bytes (gguf-py Q4_K.get_scale_min) */
static inline void pq_k4_scale_min(int j, const uint8_t *s, int *sc, int *mn) {
    if (j < 4) { *sc = s[j] & 63; *mn = s[j + 4] & 63; }
    else { *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4); *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}

static inline void pq_same(pq_sc *s, float d, float m, int has_m) {
    s->d[0] = s->d[1] = d; s->m[0] = s->m[1] = m; s->has_m = has_m;
}

/* Scales of sub-block b (32 elements) of a row; returns the byte pointer of its super-block. */
static inline __attribute__((always_inline)) const uint8_t *pq_scales_one(int kind, const uint8_t *row, int64_t b, pq_sc *s) {
    const int j = (int)(b & 7);
    switch (kind) {
    case K_Q5_0: { const uint8_t *p = row + b * 22; pq_same(s, h2f(p), 0.0f, 0); return p; }
    case K_Q5_1: { const uint8_t *p = row + b * 24; pq_same(s, h2f(p), h2f(p + 2), 1); return p; }
    case K_IQ4_NL: { const uint8_t *p = row + b * 18; pq_same(s, h2f(p), 0.0f, 0); return p; }
    case K_MXFP4: { const uint8_t *p = row + b * 17; pq_same(s, pq_e8m0_half(p[0]), 0.0f, 0); return p; }
    case K_IQ4_XS: {
        const uint8_t *p = row + (b >> 3) * 136;
        pq_same(s, h2f(p) * (float)pq_iq4xs_scale(p, j), 0.0f, 0);
        return p;
    }
    case K_Q2_K: {
        const uint8_t *p = row + (b >> 3) * 84;
        const float d = h2f(p + 80), dmin = h2f(p + 82);
        for (int h = 0; h < 2; h++) {
            s->d[h] = d * (float)(p[2 * j + h] & 15);
            s->m[h] = -(dmin * (float)(p[2 * j + h] >> 4));
        }
        s->has_m = 1;
        return p;
    }
    case K_Q3_K: {
        const uint8_t *p = row + (b >> 3) * 110;
        const float d = h2f(p + 108);
        for (int h = 0; h < 2; h++) s->d[h] = d * (float)pq_k3_scale(p + 96, 2 * j + h);
        s->m[0] = s->m[1] = 0.0f; s->has_m = 0;
        return p;
    }
    case K_Q6_K: {
        const uint8_t *p = row + (b >> 3) * 210;
        const float d = h2f(p + 208);
        for (int h = 0; h < 2; h++) s->d[h] = d * (float)((const int8_t *)p)[192 + 2 * j + h];
        s->m[0] = s->m[1] = 0.0f; s->has_m = 0;
        return p;
    }
    default: { /* K_Q4_K, K_Q5_K: d * sc, dmin * mn */
        const int bytes = kind == K_Q4_K ? 144 : 176;
        const uint8_t *p = row + (b >> 3) * bytes;
        int sc, mn;
        pq_k4_scale_min(j, p + 4, &sc, &mn);
        pq_same(s, h2f(p) * (float)sc, -(h2f(p + 2) * (float)mn), 1);
        return p;
    }
    }
}

/* Q4_K / Q5_K: the 8 sub-block scales of a 256-element super-block, unpacked together once per
 * super-block (a row loop passes one cache, p = NULL at the start, to every pq_scales call).
 * The other kinds compute a sub-block's scales on their own: measured faster for them. */
typedef struct {
    const uint8_t *p;
    pq_sc s[8];
} pq_cache;

static inline int pq_super(int kind) { return PK_SIMD && (kind == K_Q4_K || kind == K_Q5_K); }

static inline void pq_fill(int kind, const uint8_t *row, int64_t b0, const uint8_t *p, pq_cache *pc) {
    pc->p = p;
#if PK_SIMD
    { /* K_Q4_K, K_Q5_K: the 6-bit scales and mins of all 8 at once */
        uint32_t w[3], sc[2], mn[2];
        memcpy(w, p + 4, 12);
        sc[0] = w[0] & 0x3f3f3f3fu; mn[0] = w[1] & 0x3f3f3f3fu;
        sc[1] = (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4);
        mn[1] = ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4);
        float d[8], m[8];
        /* built in registers: an 8-byte load of two 4-byte stores waits for them (no forwarding) */
        const __m256 vs = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)sc[1], (int)sc[0])));
        const __m256 vm = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)mn[1], (int)mn[0])));
        _mm256_storeu_ps(d, _mm256_mul_ps(_mm256_set1_ps(h2f(p)), vs));
        /* -(dmin * mn): a sign flip, exact also for 0 (0 - x would turn -0 into +0) */
        _mm256_storeu_ps(m, _mm256_xor_ps(_mm256_set1_ps(-0.0f), _mm256_mul_ps(_mm256_set1_ps(h2f(p + 2)), vm)));
        for (int j = 0; j < 8; j++) pq_same(&pc->s[j], d[j], m[j], 1);
        return;
    }
#endif
    for (int j = 0; j < 8; j++) pq_scales_one(kind, row, b0 + j, &pc->s[j]);
}

static inline __attribute__((always_inline)) const uint8_t *pq_scales(int kind, const uint8_t *row, int64_t b, pq_sc *s, pq_cache *pc) {
    if (!pq_super(kind)) return pq_scales_one(kind, row, b, s);
    const uint8_t *p = row + (b >> 3) * BLOCK_BYTES[kind];
    if (pc->p != p) pq_fill(kind, row, b & ~(int64_t)7, p, pc);
    *s = pc->s[b & 7];
    return p;
}

/* The codes, one element at a time (the reference the SIMD decoder is tested against). */
static inline void pq_codes_scalar(int kind, const uint8_t *p, int64_t b, int8_t *c) {
    const int j = (int)(b & 7);
    for (int l = 0; l < 32; l++) {
        const int nib_byte = l & 15, nib_sh = 4 * (l >> 4); /* Q4_0-style: lows, then highs */
        int v;
        switch (kind) {
        case K_Q5_0: case K_Q5_1: {
            const int off = kind == K_Q5_0 ? 6 : 8;
            const uint32_t qh = (uint32_t)p[off - 4] | ((uint32_t)p[off - 3] << 8) |
                                ((uint32_t)p[off - 2] << 16) | ((uint32_t)p[off - 1] << 24);
            v = ((p[off + nib_byte] >> nib_sh) & 15) | (int)(((qh >> l) & 1) << 4);
            if (kind == K_Q5_0) v -= 16;
            break;
        }
        case K_IQ4_NL: v = PQ_KVALUES[(p[2 + nib_byte] >> nib_sh) & 15]; break;
        case K_IQ4_XS: v = PQ_KVALUES[(p[8 + 16 * j + nib_byte] >> nib_sh) & 15]; break;
        case K_MXFP4: v = PQ_KVALUES_MX[(p[1 + nib_byte] >> nib_sh) & 15]; break;
        case K_Q2_K: v = (p[16 + 32 * (j >> 2) + l] >> (2 * (j & 3))) & 3; break;
        case K_Q3_K:
            v = ((p[32 + 32 * (j >> 2) + l] >> (2 * (j & 3))) & 3) - (((p[l] >> j) & 1) ? 0 : 4);
            break;
        case K_Q6_K: {
            const int h = j >> 2, t = j & 3;
            v = (((p[h * 64 + (t & 1) * 32 + l] >> (4 * (t >> 1))) & 15) |
                 (((p[128 + h * 32 + l] >> (2 * t)) & 3) << 4)) - 32;
            break;
        }
        case K_Q4_K: v = (p[16 + 32 * (j >> 1) + l] >> (4 * (j & 1))) & 15; break;
        default: /* K_Q5_K */
            v = ((p[48 + 32 * (j >> 1) + l] >> (4 * (j & 1))) & 15) | (((p[16 + l] >> j) & 1) << 4);
        }
        c[l] = (int8_t)v;
    }
}

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
static inline __m256i pq_lut(__m256i nib) { return pq_lut_of(PQ_KVALUES, nib); }

/* The same codes as pq_codes_scalar, on 32 lanes. */
static inline __attribute__((always_inline)) __m256i pq_codes_simd(int kind, const uint8_t *p, int64_t b) {
    const int j = (int)(b & 7);
    switch (kind) {
    case K_Q5_0: return _mm256_sub_epi8(_mm256_or_si256(pq_nib32(p + 6), pq_bit4(p + 2)), _mm256_set1_epi8(16));
    case K_Q5_1: return _mm256_or_si256(pq_nib32(p + 8), pq_bit4(p + 4));
    case K_IQ4_NL: return pq_lut(pq_nib32(p + 2));
    case K_IQ4_XS: return pq_lut(pq_nib32(p + 8 + 16 * j));
    case K_MXFP4: return pq_lut_of(PQ_KVALUES_MX, pq_nib32(p + 1));
    case K_Q2_K: return pq_field(p + 16 + 32 * (j >> 2), 2 * (j & 3), 3);
    case K_Q3_K: { /* low2 - 4 + 4 * hbit */
        const __m256i hb = _mm256_slli_epi16(pq_field(p, j, 1), 2);
        return _mm256_add_epi8(_mm256_sub_epi8(pq_field(p + 32 + 32 * (j >> 2), 2 * (j & 3), 3), _mm256_set1_epi8(4)), hb);
    }
    case K_Q6_K: {
        const int h = j >> 2, t = j & 3;
        const __m256i ql = pq_field(p + h * 64 + (t & 1) * 32, 4 * (t >> 1), 15);
        const __m256i qh = _mm256_slli_epi16(pq_field(p + 128 + h * 32, 2 * t, 3), 4);
        return _mm256_sub_epi8(_mm256_or_si256(ql, qh), _mm256_set1_epi8(32));
    }
    case K_Q4_K: return pq_field(p + 16 + 32 * (j >> 1), 4 * (j & 1), 15);
    default: /* K_Q5_K */
        return _mm256_or_si256(pq_field(p + 48 + 32 * (j >> 1), 4 * (j & 1), 15),
                               _mm256_slli_epi16(pq_field(p + 16, j, 1), 4));
    }
}

static inline void pq_widen(__m256i b, __m256 v[4]) { /* 32 int8 -> 4 x 8 floats */
    const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}
#endif

/* Matmul decoder (float path): the 32 values of sub-block b themselves (D = 1, M = 0). */
static inline __attribute__((always_inline)) void pq_dec_scalar(int kind, const uint8_t *row, int64_t b, float *q, pq_cache *pc) {
    pq_sc s;
    int8_t c[32];
    const uint8_t *p = pq_scales(kind, row, b, &s, pc);
    pq_codes_scalar(kind, p, b, c);
    for (int l = 0; l < 32; l++) q[l] = s.d[l >> 4] * (float)c[l] + s.m[l >> 4];
}

/* kinds whose 32-element sub-block has one scale and one offset (value = D * code + M) */
static inline int pq_uniform(int kind) { return kind != K_Q2_K && kind != K_Q3_K && kind != K_Q6_K; }

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
 * `lane` (lanes 0-3 = elements 0-15) and, for Q2_K, per-half offsets m2; sgn: signed codes.
 * x1 (x's first code alone): Q5_0's signed codes, M = 0, so the sum is the stored weights times
 * x's codes (the offset on x's float sums doubled the rounding error: 1.2e-2 of the output,
 * not 0.7e-2) */
static inline __attribute__((always_inline)) __m256i pq_q8_codes(int kind, const uint8_t *row, int64_t b, float *D, float *M, int *sgn,
                                  __m256 *lane, float *m2, pq_cache *pc, const int x1) {
    pq_sc s;
    const uint8_t *p = pq_scales(kind, row, b, &s, pc);
    if (kind == K_Q5_0 && !x1) { /* unsigned codes 0..31 with offset -16 d: no sign trick in the dot */
        *sgn = 0; *D = s.d[0]; *M = -16.0f * s.d[0];
        return _mm256_or_si256(pq_nib32(p + 6), pq_bit4(p + 2));
    }
    *sgn = kind == K_Q3_K || kind == K_IQ4_NL || kind == K_IQ4_XS || kind == K_Q5_0 || kind == K_MXFP4;
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

#endif /* POLY_FORMATS_GGUF_BLOCKS_H */

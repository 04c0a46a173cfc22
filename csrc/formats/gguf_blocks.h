/* The 32-element GGUF kinds' own file: Q5_0, Q5_1, IQ4_NL, IQ4_XS, MXFP4 (layouts: ggml-common.h
 * block structs). Their records (core/common.h kind_rec, collected in formats/kinds.h) and the
 * code that knows their bytes: a 32-element sub-block's scales and int8 codes, the entry points
 * of the sub-block decoder (formats/pq_decode.h), which hand the K-quants to
 * formats/kquant_blocks.h.
 *
 * A sub-block b of a row gives 32 int8 codes c (element l in byte l) and, per half of 16
 * elements, a scale d[h] and an offset m[h]: value = d[h] * c + m[h] (the offset is added only
 * when has_m, so d * c = -0.0 stays -0.0 as in gguf-py). The scales are computed with the float32
 * operations of gguf-py's numpy dequantizers (gguf/quants.py), so dequantizing with one multiply
 * then one add (no FMA) is bitwise equal to them. */
#ifndef POLY_FORMATS_GGUF_BLOCKS_H
#define POLY_FORMATS_GGUF_BLOCKS_H
#include "core/common.h"
#include "core/half.h"
#include "formats/block_bits.h"
#include "formats/kquant_blocks.h"

/* pq8: their float rows were compute-bound (1B Q5_0 decode 0.85x llama.cpp's); IQ4 prompts on
 * the int8 panels with KQP_IQ4 (whole 256-element runs: IQ4_NL's 8 blocks a record) */
static const kind_rec REC_Q5_0 = {.pq = 1, .sgn = 1, .pq8 = 1};
static const kind_rec REC_Q5_1 = {.pq = 1, .pq8 = 1, .m32 = 1};
static const kind_rec REC_IQ4_NL = {.pq = 1, .sgn = 1, .pq8 = 1, .kqp = 2, .kqp_form = KQP_OFF128, .kqp_pairs = 1};
static const kind_rec REC_IQ4_XS = {.pq = 1, .sgn = 1, .pq8 = 1, .pq8_sb = 1, .kqp = 2, .kqp_form = KQP_OFF128, .kqp_pairs = 1};
static const kind_rec REC_MXFP4 = {.pq = 1, .sgn = 1, .pq8 = 1};

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
/* the bytes pq_codes_simd reads for sub-block j of a 256-element run at p (IQ4_NL: block j) */
static inline const uint8_t *pq_sub(int kind, const uint8_t *p, int j) { return kind == K_IQ4_NL ? p + 18 * j : p; }

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
    default: return kq_scales_one(kind, row, b, s);
    }
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
        default: v = kq_code(kind, p, j, l);
        }
        c[l] = (int8_t)v;
    }
}

#if PK_SIMD
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
    default: return kq_codes_simd(kind, p, j);
    }
}

/* int8 rows on x's two codes: Q5_0's unsigned codes 0..31 with offset -16 d (no sign trick in
 * the dot); with x's first code alone (x1) its signed codes, M = 0, so the sum is the stored
 * weights times x's codes (the offset on x's float sums doubled the rounding error: 1.2e-2 of
 * the output, not 0.7e-2). 0: the kind's codes as pq_codes_simd gives them */
static inline int pq_q8_raw(int kind, const uint8_t *p, const pq_sc *s, int x1, __m256i *q, float *D, float *M) {
    if (kind != K_Q5_0 || x1) return 0;
    *D = s->d[0]; *M = -16.0f * s->d[0];
    *q = _mm256_or_si256(pq_nib32(p + 6), pq_bit4(p + 2));
    return 1;
}

#if PK_AVX512
/* codes of sub-blocks 2 q2 and 2 q2 + 1 side by side (bytes 0-31, 32-63) for the int8 rows */
static inline __attribute__((always_inline)) __m512i k8_codes2(int kind, const uint8_t *p, int q2) {
    const int j = 2 * q2;
    switch (kind) {
    case K_IQ4_NL: case K_IQ4_XS: { /* the table's codes + 128 (v ^ 0x80: the unsigned side of vpdpbusd) */
        const uint8_t *a = pq_iq4_nibs(kind, p, j), *b = pq_iq4_nibs(kind, p, j + 1);
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(pq_lut(pq_nib32(a))), pq_lut(pq_nib32(b)), 1);
        return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));
    }
    default: return kq_codes2(kind, p, q2);
    }
}
#endif
#endif

#endif /* POLY_FORMATS_GGUF_BLOCKS_H */

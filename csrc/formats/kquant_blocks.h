/* The K-quants' own file: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (256-element super-blocks; layouts:
 * ggml-common.h block structs). Their records (core/common.h kind_rec, collected in
 * formats/kinds.h) and every piece of code that knows their bytes: a sub-block's scales and
 * codes (formats/pq_decode.h calls them for a constant kind), the int8 rows' super-block
 * scales and unsigned codes (formats/kquant_rows.h), and the direct decoders of Q4_K/Q6_K. */
#ifndef POLY_FORMATS_KQUANT_BLOCKS_H
#define POLY_FORMATS_KQUANT_BLOCKS_H
#include "core/common.h"
#include "core/half.h"
#include "formats/block_bits.h"

static const kind_rec REC_Q2_K = {.pq = 1, .halves = 1, .k8 = 1, .m16 = 1, .kqp = 1, .kqp_form = KQP_MIN16, .kqp_pairs = 4};
static const kind_rec REC_Q3_K = {.pq = 1, .halves = 1, .sgn = 1, .k8 = 1, .kqp = 1, .kqp_form = KQP_OFF4, .kqp_pairs = 4};
static const kind_rec REC_Q4_K = {.pq = 1, .super = 1, .k8 = 1, .kqp = 1, .kqp_form = KQP_MIN32, .kqp_pairs = 8, .kil8 = KIL8_NIB};
static const kind_rec REC_Q5_K = {.pq = 1, .super = 1, .k8 = 1, .kqp = 1, .kqp_form = KQP_MIN32, .kqp_pairs = 4};
static const kind_rec REC_Q6_K = {.pq = 1, .halves = 1, .k8 = 1, .kqp = 1, .kqp_form = KQP_OFF32, .kqp_pairs = 2, .kil8 = KIL8_SIX};
/* (kqp_pairs: a pair of maddubs products is at most 2 * 127 * max code: Q4_K 15: 8 of them,
 * Q5_K 31: 4, Q6_K 63: 2, Q3_K 7 and Q2_K 3: all 4) */

/* Q3_K: 6-bit scale j of 16 (low 4 bits in bytes 0-7, high 2 bits in bytes 8-11), minus 32 */
static inline int pq_k3_scale(const uint8_t *s, int j) {
    const int lo = j < 8 ? s[j] & 15 : s[j - 8] >> 4;
    return (lo | (((s[8 + (j & 3)] >> (2 * (j >> 2))) & 3) << 4)) - 32;
}

/* Q4_K / Q5_K: scale and min j of 8, 6 bits each in 12 bytes (gguf-py Q4_K.get_scale_min) */
static inline void pq_k4_scale_min(int j, const uint8_t *s, int *sc, int *mn) {
    if (j < 4) { *sc = s[j] & 63; *mn = s[j + 4] & 63; }
    else { *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4); *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}

/* Scales of sub-block b (32 elements) of a row; returns the byte pointer of its super-block. */
static inline __attribute__((always_inline)) const uint8_t *kq_scales_one(int kind, const uint8_t *row, int64_t b, pq_sc *s) {
    const int j = (int)(b & 7);
    switch (kind) {
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

/* Q4_K / Q5_K (record .super): the 8 sub-block scales of a 256-element super-block, unpacked
 * together once per super-block (a row loop passes one pq_cache to every pq_scales call). The
 * other kinds compute a sub-block's scales on their own: measured faster for them. */
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
    for (int j = 0; j < 8; j++) kq_scales_one(kind, row, b0 + j, &pc->s[j]);
}

/* code l of sub-block j, one element at a time (the reference the SIMD decoder is tested against) */
static inline int kq_code(int kind, const uint8_t *p, int j, int l) {
    switch (kind) {
    case K_Q2_K: return (p[16 + 32 * (j >> 2) + l] >> (2 * (j & 3))) & 3;
    case K_Q3_K: return ((p[32 + 32 * (j >> 2) + l] >> (2 * (j & 3))) & 3) - (((p[l] >> j) & 1) ? 0 : 4);
    case K_Q6_K: {
        const int h = j >> 2, t = j & 3;
        return (((p[h * 64 + (t & 1) * 32 + l] >> (4 * (t >> 1))) & 15) |
                (((p[128 + h * 32 + l] >> (2 * t)) & 3) << 4)) - 32;
    }
    case K_Q4_K: return (p[16 + 32 * (j >> 1) + l] >> (4 * (j & 1))) & 15;
    default: /* K_Q5_K */
        return ((p[48 + 32 * (j >> 1) + l] >> (4 * (j & 1))) & 15) | (((p[16 + l] >> j) & 1) << 4);
    }
}

#if PK_SIMD
/* the same codes on 32 lanes */
static inline __attribute__((always_inline)) __m256i kq_codes_simd(int kind, const uint8_t *p, int j) {
    switch (kind) {
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

/* scales, offsets and D of super-block p (BLOCK_BYTES[kind] bytes), layouts as in formats/gguf_blocks.h */
static inline __attribute__((always_inline)) void k8_scales(int kind, const uint8_t *p, k8_sb *S) {
    switch (kind) {
    case K_Q4_K: case K_Q5_K: { /* 6-bit scales and mins of the 8 sub-blocks (bytes 4-15), as pq_fill */
        /* in vector lanes (the scalar unpack and its four inserts cost a quarter of a Q4_K row):
         * bytes 0-3 sc0-3 = q[0-3] & 63, 4-7 sc4-7 = q[8-11] & 15 | (q[0-3] >> 6) << 4, 8-11 m0-3
         * = q[4-7] & 63, 12-15 m4-7 = q[8-11] >> 4 | (q[4-7] >> 6) << 4 (q: the 12 bytes at p + 4) */
        const __m128i v = _mm_loadu_si128((const __m128i *)p);
        const __m128i a = _mm_shuffle_epi8(v, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
        const __m128i lo = _mm_or_si128(_mm_and_si128(a, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)),
                                        _mm_and_si128(_mm_srli_epi16(a, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15)));
        const __m128i hi = _mm_shuffle_epi8(_mm_srli_epi16(v, 2), _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
        const __m128i sm = _mm_or_si128(lo, _mm_and_si128(hi, _mm_set1_epi8(0x30)));
        S->D = h2f(p);
        k8_put(S, _mm_unpacklo_epi8(sm, sm), _mm_unpackhi_epi8(sm, sm), h2f(p + 2)); /* one per 16 */
        return;
    }
    case K_Q6_K: {
        const __m128i s8 = _mm_loadu_si128((const __m128i *)(p + 192));
        S->D = h2f(p + 208);
        k8_put(S, s8, s8, 32.0f * S->D);
        return;
    }
    case K_Q3_K: { /* 16 6-bit scales (pq_k3_scale): low 4 bits in bytes 0-7 (scales 0-7 the low
                    * nibbles, 8-15 the high ones), high 2 in bytes 8-11 (scale 4 g + b: bits 2 g of
                    * byte b); the 16 bytes at p + 94 end with the block (scales at 2-13) */
        const __m128i v = _mm_loadu_si128((const __m128i *)(p + 94));
        const __m128i l = _mm_shuffle_epi8(v, _mm_setr_epi8(2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5, 6, 7, 8, 9));
        const __m128i lo = _mm_or_si128(_mm_and_si128(l, _mm_setr_epi8(15, 15, 15, 15, 15, 15, 15, 15, 0, 0, 0, 0, 0, 0, 0, 0)),
                                        _mm_and_si128(_mm_srli_epi16(l, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15, 15, 15, 15, 15)));
        const __m128i h = _mm_srlv_epi32(_mm_shuffle_epi32(_mm_srli_si128(v, 10), 0), _mm_setr_epi32(0, 2, 4, 6));
        const __m128i s8 = _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi8(3)), 4)), _mm_set1_epi8(32));
        S->D = h2f(p + 108);
        k8_put(S, s8, s8, 4.0f * S->D);
        return;
    }
    default: { /* K_Q2_K: scale in the low nibble, min in the high one */
        const __m128i b = _mm_loadu_si128((const __m128i *)p), lo = _mm_set1_epi8(15);
        S->D = h2f(p + 80);
        k8_put(S, _mm_and_si128(b, lo), _mm_and_si128(_mm_srli_epi16(b, 4), lo), h2f(p + 82));
        return;
    }
    }
}

/* unsigned codes of sub-block j (element l in byte l; Q6_K 0..63 at most: maddubs can't saturate) */
static inline __attribute__((always_inline)) __m256i k8_codes(int kind, const uint8_t *p, int j) {
    switch (kind) {
    case K_Q4_K: return pq_field(p + 16 + 32 * (j >> 1), 4 * (j & 1), 15);
    case K_Q5_K:
        return _mm256_or_si256(pq_field(p + 48 + 32 * (j >> 1), 4 * (j & 1), 15), _mm256_slli_epi16(pq_field(p + 16, j, 1), 4));
    case K_Q6_K: {
        const int h = j >> 2, t = j & 3;
        const __m256i ql = pq_field(p + h * 64 + (t & 1) * 32, 4 * (t >> 1), 15);
        return _mm256_or_si256(ql, _mm256_slli_epi16(pq_field(p + 128 + h * 32, 2 * t, 3), 4));
    }
    case K_Q3_K:
        return _mm256_or_si256(pq_field(p + 32 + 32 * (j >> 2), 2 * (j & 3), 3), _mm256_slli_epi16(pq_field(p, j, 1), 2));
    default: return pq_field(p + 16 + 32 * (j >> 2), 2 * (j & 3), 3); /* K_Q2_K */
    }
}

/* Q4_K's float decode of block b of row r: its own scale and min, q * D + M (block_decode.h
 * dec_simd; Q6_K's goes through pq_dec_simd) */
static inline __attribute__((always_inline)) int kq_dec_simd(int kind, const uint8_t *row, int64_t b, __m256 v[4], float *D, float *M) {
    if (kind != K_Q4_K) return 0;
    const uint8_t *p = row + (b / 8) * 144, *qs = p + 16 + 32 * ((b % 8) / 2);
    int sc, mn;
    pq_k4_scale_min((int)(b % 8), p + 4, &sc, &mn);
    __m256i q = _mm256_loadu_si256((const __m256i *)qs);
    if (b & 1) q = _mm256_srli_epi16(q, 4);
    widen_u8(_mm256_and_si256(q, _mm256_set1_epi8(15)), v);
    *D = h2f(p) * (float)sc; *M = -h2f(p + 2) * (float)mn;
    return 1;
}

/* int8 rows (rows/int8_rows.h quant_row_q8) of Q4_K and Q6_K: block b's codes q with D, M, or
 * Q6_K's signed codes with its two 16-element scales in lane; 0 for the other kinds */
static inline __attribute__((always_inline)) int kq_q8_codes(int kind, const uint8_t *row, int64_t b, __m256i *qo, float *D, float *M,
                                                         int *sgn, __m256 *lane) {
    __m256i q;
    switch (kind) {
    case K_Q4_K: {
        const uint8_t *p = row + (b / 8) * 144, *qs = p + 16 + 32 * ((b % 8) / 2);
        int sc, mn;
        pq_k4_scale_min((int)(b % 8), p + 4, &sc, &mn);
        q = _mm256_loadu_si256((const __m256i *)qs);
        if (b & 1) q = _mm256_srli_epi16(q, 4);
        q = _mm256_and_si256(q, _mm256_set1_epi8(15));
        *D = h2f(p) * (float)sc; *M = -h2f(p + 2) * (float)mn;
        break;
    }
    case K_Q6_K: { /* (6-bit code - 32) signed, two 16-element scale groups per lane half */
        const uint8_t *p = row + (b / 8) * 210;
        int j = (int)(b % 8), h = j / 4, t = j % 4;
        __m256i ql = _mm256_loadu_si256((const __m256i *)(p + h * 64 + (t & 1) * 32));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + h * 32));
        ql = _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (t >> 1)), _mm256_set1_epi8(15));
        qh = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), _mm256_set1_epi8(3));
        q = _mm256_sub_epi8(_mm256_or_si256(ql, _mm256_slli_epi16(qh, 4)), _mm256_set1_epi8(32));
        const int8_t *sc = (const int8_t *)(p + 192) + h * 8 + 2 * t;
        *lane = _mm256_set_m128(_mm_set1_ps((float)sc[1]), _mm_set1_ps((float)sc[0]));
        *D = h2f(p + 208); *sgn = 1;
        break;
    }
    default: return 0;
    }
    *qo = q;
    return 1;
}
#endif

#if PK_AVX512
/* codes of sub-blocks 2 q2 and 2 q2 + 1 side by side (bytes 0-31, 32-63) */
static inline __attribute__((always_inline)) __m512i kq_codes2(int kind, const uint8_t *p, int q2) {
    const int j = 2 * q2, e = 4 * (q2 & 1); /* Q2_K/Q3_K shifts of the pair: e, e + 2 */
    switch (kind) {
    case K_Q4_K: return k8_field2(p + 16 + 32 * q2, 0, 4, 15);
    case K_Q5_K:
        return _mm512_or_si512(k8_field2(p + 48 + 32 * q2, 0, 4, 15), _mm512_slli_epi16(k8_field2(p + 16, j, j + 1, 1), 4));
    case K_Q6_K: { /* ql: 64 bytes in a row; qh: shifts 2t, 2t + 2 */
        const int h = q2 >> 1;
        const __m512i ql = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512((const void *)(p + h * 64)), e),
                                            _mm512_set1_epi8(15));
        return _mm512_or_si512(ql, _mm512_slli_epi16(k8_field2(p + 128 + h * 32, e, e + 2, 3), 4));
    }
    case K_Q3_K:
        return _mm512_or_si512(k8_field2(p + 32 + 32 * (q2 >> 1), e, e + 2, 3), _mm512_slli_epi16(k8_field2(p, j, j + 1, 1), 2));
    default: return k8_field2(p + 16 + 32 * (q2 >> 1), e, e + 2, 3); /* K_Q2_K */
    }
}
#endif

/* Q4_K and Q6_K's float decode of block b of row r (scalar builds; Q6_K's 16-element scale
 * groups folded into q): 1 when kind is one of them */
static inline __attribute__((always_inline)) int kq_dec_scalar(int kind, const uint8_t *row, int64_t b, float *q, float *D, float *M) {
    switch (kind) {
    case K_Q4_K: {
        const uint8_t *p = row + (b / 8) * 144, *qs = p + 16 + 32 * ((b % 8) / 2);
        int sc, mn, sh = 4 * (b & 1);
        pq_k4_scale_min((int)(b % 8), p + 4, &sc, &mn);
        for (int l = 0; l < 32; l++) q[l] = (float)((qs[l] >> sh) & 15);
        *D = h2f(p) * (float)sc; *M = -h2f(p + 2) * (float)mn; return 1;
    }
    case K_Q6_K: { /* 16-element scale groups, folded into q */
        const uint8_t *p = row + (b / 8) * 210;
        int j = (int)(b % 8), h = j / 4, t = j % 4;
        const uint8_t *ql = p + h * 64 + (t & 1) * 32, *qh = p + 128 + h * 32;
        const int8_t *sc = (const int8_t *)(p + 192) + h * 8 + 2 * t;
        for (int l = 0; l < 32; l++) {
            int c = ((ql[l] >> (4 * (t >> 1))) & 15) | (((qh[l] >> (2 * t)) & 3) << 4);
            q[l] = (float)(c - 32) * (float)sc[l / 16];
        }
        *D = h2f(p + 208); *M = 0.0f; return 1;
    }
    default: return 0;
    }
}

#endif /* POLY_FORMATS_KQUANT_BLOCKS_H */

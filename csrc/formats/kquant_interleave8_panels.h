/* The prompt panels (formats/kquant_panels.h) of a Q4_K/Q6_K matrix repacked by 8 (csrc/formats/kquant_interleave8.h has the record
 * layouts), built from its records: kil8_panel for whole groups of 8, kil8_sb (a row's stored
 * super-block rebuilt byte for byte) where a range cuts a group. The stored rows are then read
 * once, at load (the repack), and their pages released: one copy resident, not two (1B Q4_K_M
 * 1436 -> 937 MB). The panels are bitwise those of the stored rows. */
#ifndef POLY_FORMATS_KQUANT_INTERLEAVE8_PANELS_H
#define POLY_FORMATS_KQUANT_INTERLEAVE8_PANELS_H
#include "core/common.h"
#include "core/prefetch.h"
#include "formats/kinds.h"
#include "formats/kquant_panels.h"

#define KIL8_REC 1184  /* Q4_K: 8 rows x 144 bytes + 32 */
#define KIL8Q6_REC 1680 /* Q6_K: 8 rows x 210 bytes */
static inline int64_t kil8_rec(int kind) { return KINDS[kind]->kil8 == KIL8_NIB ? KIL8_REC : KIL8Q6_REC; } /* a record's bytes */

/* the bytes of an [m, k] Q4_K matrix repacked by 8, or -1 when its kind or shape takes none (every
 * build takes the argument: a plan made on a SIMD build stays valid when use_isa picks base,
 * which reads the stored rows) */
static inline int64_t kil8_bytes(int kind, int64_t m, int64_t k) {
    if (kind < 0 || kind >= K_COUNT || !KINDS[kind]->kil8 || m % 8 || k % 256) return -1;
    return m / 8 * (k / 256) * kil8_rec(kind);
}

/* the 144 (Q4_K) or 210 (Q6_K) stored bytes of row `row`, super-block sb into p, from the records rk
 * of a matrix of nsb super-blocks a row */
static inline void kil8_sb(int kind, const uint8_t *rk, int64_t nsb, int64_t row, int64_t sb, uint8_t *p) {
    const int r = (int)(row % 8);
    if (KINDS[kind]->kil8 == KIL8_NIB) {
        const uint8_t *R = rk + (row / 8 * nsb + sb) * KIL8_REC;
        uint8_t sc[8], mn[8];
        memcpy(p, R + 2 * r, 2);      /* d */
        memcpy(p + 2, R + 16 + 2 * r, 2); /* dmin */
        for (int j = 0; j < 8; j++) sc[j] = R[32 + 8 * j + r];
        for (int i = 0; i < 4; i++) { mn[2 * i] = R[96 + 16 * i + 2 * r]; mn[2 * i + 1] = R[96 + 16 * i + 2 * r + 1]; }
        for (int j = 0; j < 4; j++) { /* the 12 bytes of 6-bit scales and mins (formats/kquant_rows.h k8_scales) */
            p[4 + j] = (uint8_t)((sc[j] & 63) | (sc[j + 4] >> 4) << 6);
            p[8 + j] = (uint8_t)((mn[j] & 63) | (mn[j + 4] >> 4) << 6);
            p[12 + j] = (uint8_t)((sc[j + 4] & 15) | (mn[j + 4] & 15) << 4);
        }
        for (int v = 0; v < 32; v++) memcpy(p + 16 + 4 * v, R + 160 + 32 * v + 4 * r, 4); /* byte 32 i + 4 t + b */
    } else { /* K_Q6_K: each code from its 16-group's vectors, put back as ggml stores it */
        const uint8_t *R = rk + (row / 8 * nsb + sb) * KIL8Q6_REC;
        memset(p, 0, 192);
        for (int e = 0; e < 256; e++) {
            const uint8_t *V = R + 144 + 96 * (e / 16) + 4 * r + e % 4; /* byte 4 r + b of vector 3 j */
            const int k = e % 16 / 4;
            const int u = k < 3 ? V[32 * k] & 63 : (V[0] >> 6) << 4 | (V[32] >> 6) << 2 | V[64] >> 6;
            const int h = e / 128, q = e % 128 / 32, l = e % 32; /* ggml: ql[64 h + 32 (q & 1) + l], nibble q >> 1 */
            p[64 * h + 32 * (q & 1) + l] |= (uint8_t)((u & 15) << 4 * (q >> 1));
            p[128 + 32 * h + l] |= (uint8_t)((u >> 4) << 2 * q);
        }
        for (int i = 0; i < 8; i++) memcpy(p + 192 + 2 * i, R + 16 + 16 * i + 2 * r, 2); /* int8 scales */
        memcpy(p + 208, R + 2 * r, 2);                                                       /* d */
    }
}

/* the records of rows [r0, r0 + rows)' groups of 8 at super-block sb, asked for */
static inline void kil8_prefetch(int kind, const uint8_t *rk, int64_t nsb, int64_t r0, int64_t rows, int64_t sb) {
    const int64_t rec = kil8_rec(kind);
    for (int64_t g = r0 / 8; g <= (r0 + rows - 1) / 8; g++)
        for (int64_t l = 0; l < rec; l += 64) prefetch_line((const char *)rk + (g * nsb + sb) * rec + l);
}

#if PK_SIMD
/* bytes e, 2 + e, .., 14 + e of the 16 at p: a field stored "byte 2 r + e" for the 8 rows r */
static inline __m128i kil8_pairs(const uint8_t *p, int e) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    return _mm_shuffle_epi8(v, e ? _mm_setr_epi8(1, 3, 5, 7, 9, 11, 13, 15, -1, -1, -1, -1, -1, -1, -1, -1)
                                 : _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1));
}

/* the four code vectors (8 rows x 4 elements, byte 4 r + b) of a Q6_K record's 16-group from its
 * three vectors at V (csrc/formats/kquant_interleave8.h: codes k < 3 in bits 0-5, code 3 from the bits 6-7) */
static inline __attribute__((always_inline)) void kil8q6_split(const uint8_t *V, __m256i cq[4]) {
    const __m256i m63 = _mm256_set1_epi8(63), m192 = _mm256_set1_epi8((char)0xC0);
    const __m256i va = _mm256_loadu_si256((const __m256i *)V), vb = _mm256_loadu_si256((const __m256i *)(V + 32)),
                  vc = _mm256_loadu_si256((const __m256i *)(V + 64));
    const __m256i hb = _mm256_or_si256(_mm256_srli_epi16(_mm256_and_si256(vb, m192), 2), _mm256_srli_epi16(_mm256_and_si256(vc, m192), 4));
    cq[0] = _mm256_and_si256(va, m63);
    cq[1] = _mm256_and_si256(vb, m63);
    cq[2] = _mm256_and_si256(vc, m63);
    cq[3] = _mm256_srli_epi16(_mm256_or_si256(_mm256_and_si256(va, m192), hb), 2);
}

/* the int8 panel (formats/kquant_panels.h: per super-block the 64 code words of 16 rows, word q of row r at 4
 * (16 q + r), then S[16 j + r] and o[16 j + r] as floats) of rows 8 g .. 8 g + 15 straight from
 * their two records: a record's code vector already holds 8 rows' words side by side, so each
 * is masked and stored (rebuilding the stored bytes first cost a 16-42-token 1B Q4_K_M prompt
 * 15 %). The same codes and the same float products as kqp_decode on the stored rows. */
static inline void kil8_panel(int kind, const uint8_t *rk, int64_t nsb, int64_t g, int64_t sb, uint8_t *d) {
    const int64_t rec = kil8_rec(kind);
    float *S = (float *)(d + 4096), *O = S + 256;
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int h = 0; h < 2; h++) { /* rows 0-7: group g, 8-15: g + 1 */
        const uint8_t *R = rk + ((g + h) * nsb + sb) * rec;
        const __m256 D = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)R));
        uint8_t *c = d + 32 * h;
        if (KINDS[kind]->kil8 == KIL8_NIB) { /* word 16 i + 8 e + t: nibble e of vector 8 i + t */
            for (int v = 0; v < 32; v++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(R + 160 + 32 * v));
                const int w = 16 * (v / 8) + v % 8;
                _mm256_storeu_si256((__m256i *)(c + 64 * w), _mm256_and_si256(q, m4));
                _mm256_storeu_si256((__m256i *)(c + 64 * (w + 8)), _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
            }
            const __m256 Dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(R + 16)));
            for (int j = 0; j < 8; j++) { /* sub-block j: the scale and min of both its 16-groups */
                const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(R + 32 + 8 * j))));
                const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(kil8_pairs(R + 96 + 16 * (j / 2), j & 1)));
                const __m256 s = _mm256_mul_ps(sc, D), o = _mm256_mul_ps(mn, Dm);
                for (int e = 0; e < 2; e++) {
                    _mm256_storeu_ps(S + 16 * (2 * j + e) + 8 * h, s);
                    _mm256_storeu_ps(O + 16 * (2 * j + e) + 8 * h, o);
                }
            }
        } else { /* K_Q6_K: words 4 j + k of 16-group j, k < 3 in vector 3 j + k's bits 0-5; k = 3 in their bits 6-7 */
            for (int j = 0; j < 16; j++) {
                __m256i cq[4];
                kil8q6_split(R + 144 + 96 * j, cq);
                for (int k = 0; k < 4; k++) _mm256_storeu_si256((__m256i *)(c + 64 * (4 * j + k)), cq[k]);
            }
            const __m256 Dom = _mm256_mul_ps(_mm256_set1_ps(32.0f), D); /* k8_scales' om = 32 D */
            for (int j = 0; j < 16; j++) { /* 16-group j's int8 scales */
                const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(kil8_pairs(R + 16 + 16 * (j / 2), j & 1)));
                _mm256_storeu_ps(S + 16 * j + 8 * h, _mm256_mul_ps(sc, D));
                _mm256_storeu_ps(O + 16 * j + 8 * h, _mm256_mul_ps(sc, Dom));
            }
        }
    }
}
#endif

/* the panel of rows r0 .. r0 + 16 (r0 a multiple of 8) straight from rk's records (kil8_panel);
 * 0 when rk is NULL or the rows cut a group of 8 (then the stored bytes are rebuilt, kqp_sbp) */
static inline int kqp_decode_rk(int kind, const uint8_t *rk, int64_t nsb, int64_t r0, int64_t rows, uint8_t *panel) {
#if PK_SIMD
    if (!rk || rows != 16 || r0 % 8) return 0;
    for (int64_t sb = 0; sb < nsb; sb++) {
        if (sb + KQP_PF < nsb) kil8_prefetch(kind, rk, nsb, r0, rows, sb + KQP_PF);
        kil8_panel(kind, rk, nsb, r0 / 8, sb, panel + sb * KQP_SB);
    }
    return 1;
#else /* no panels on the base build */
    (void)kind; (void)rk; (void)nsb; (void)r0; (void)rows; (void)panel;
    return 0;
#endif
}

/* row `row`'s super-block sb: in the stored rows w, or rebuilt into tmp (256 bytes) from rk's records */
static inline const uint8_t *kqp_sbp(int kind, const uint8_t *w, int64_t rb, const uint8_t *rk, int64_t nsb,
                                     int64_t row, int64_t sb, uint8_t *tmp) {
    if (!rk) return w + row * rb + sb * kqp_sbb(kind);
    kil8_sb(kind, rk, nsb, row, sb, tmp);
    return tmp;
}

#endif /* POLY_FORMATS_KQUANT_INTERLEAVE8_PANELS_H */

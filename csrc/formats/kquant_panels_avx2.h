/* formats/kquant_panels.h's K-quant prompt panels on AVX2 (no AVX-512): the same panel records, read as two
 * halves of 8 weight rows (bytes 0-31 and 32-63 of each code vector, floats 0-7 and 8-15 of S and
 * o); an input's 4 codes broadcast meet 4 codes of 8 rows in maddubs (|u| <= 63, |c| <= 127: a
 * pair sum can't saturate), madd with ones widens to int32. Without VNNI that is 3 instructions
 * per 32 multiply-adds where an FMA does 8. */
#ifndef POLY_FORMATS_KQUANT_PANELS_AVX2_H
#define POLY_FORMATS_KQUANT_PANELS_AVX2_H
#include "core/common.h"
#include "formats/kinds.h"
#include "formats/pq_decode.h"
#include "rows/avx512.h"
#include "formats/kquant_rows.h"
#include "core/activations.h"
#include "formats/kquant_panels.h"
#include "formats/kquant_interleave8_panels.h"
#include "formats/kquant_panels_prep.h"
#if !PK_AVX512 && PK_SIMD

/* rows [r0, r0 + rows) (rows <= 16; missing rows decode as zeros) into the panel: nsb records */
static void kqp_decode(int kind, const uint8_t *w, int64_t rb, const uint8_t *rk, int64_t nsb, int64_t r0, int64_t rows,
                       uint8_t *panel) {
    uint32_t codes[16 * 64]; /* row r's 256 codes as 64 words */
    float s[16 * 16], o[16 * 16];
    uint8_t tmp[256]; /* a super-block rebuilt from rk */
    if (kqp_decode_rk(kind, rk, nsb, r0, rows, panel)) return;
    for (int64_t sb = 0; sb < nsb; sb++) {
        uint8_t *d = panel + sb * KQP_SB;
        float *S = (float *)(d + 4096), *O = S + 256;
        kqp_prefetch(kind, w, rb, rk, nsb, r0, rows, sb);
        for (int r = 0; r < 16; r++) {
            k8_sb B = {0};
            if (r < rows && kqp_form(kind) == KQP_OFF128) { /* IQ4: the table's signed codes, d * scale per 32 */
                const uint8_t *p = w + (r0 + r) * rb + sb * kqp_sbb(kind);
                for (int j = 0; j < 8; j++) {
                    _mm256_storeu_si256((__m256i *)(codes + r * 64 + 8 * j), pq_codes_simd(kind, pq_sub(kind, p, j), j));
                    s[16 * r + 2 * j] = s[16 * r + 2 * j + 1] = pq_iq4_d(kind, p, j);
                    o[16 * r + 2 * j] = o[16 * r + 2 * j + 1] = 0.0f;
                }
                continue;
            }
            if (r < rows) {
                const uint8_t *p = kqp_sbp(kind, w, rb, rk, nsb, r0 + r, sb, tmp);
                for (int j = 0; j < 8; j++) _mm256_storeu_si256((__m256i *)(codes + r * 64 + 8 * j), k8_codes(kind, p, j));
                k8_scales(kind, p, &B);
            } else
                memset(codes + r * 64, 0, 256);
            for (int j = 0; j < 16; j++) { s[16 * r + j] = B.D * (float)B.s[j]; o[16 * r + j] = B.om * (float)B.o[j]; }
        }
        for (int h = 0; h < 16; h += 8) { /* lanes: word q of row r at q * 16 + r; S, o at j * 16 + r */
            for (int q = 0; q < 64; q += 8) transpose8(codes + h * 64 + q, 64, (float *)d + q * 16 + h, 16, K_F32);
            for (int j = 0; j < 16; j += 8) {
                transpose8(s + h * 16 + j, 16, S + j * 16 + h, 16, K_F32);
                transpose8(o + h * 16 + j, 16, O + j * 16 + h, 16, K_F32);
            }
        }
    }
}

/* the panel's rows (two halves of 8) x inputs t0.. (T of them): out[t][col .. col + rows) */
/* maddubs results a kind's int16 lanes can sum before madd widens them: a pair of products is at
 * most 2 * 127 * max code (Q4_K 15: 8 of them, Q5_K 31: 4, Q6_K 63: 2, Q3_K 7 and Q2_K 3: all 4;
 * IQ4's |code| 127: 1) */
static inline int kqp_pairs(int kind) { return KINDS[kind]->kqp_pairs; }

static inline __attribute__((always_inline)) void kqp_tile(const mm_args *A, const uint8_t *panel, int64_t nsb, int64_t t0,
                                                           float *out, int64_t ldo, int64_t col, int64_t rows,
                                                           const int F, const int G, const int T) {
    /* IQ4 (KQP_OFF128): signed codes v, no offset; maddubs(|v|, sign(c, v)), llama.cpp's sign trick */
    const int off = F == KQP_OFF32 || F == KQP_OFF4, sub = F == KQP_MIN32 || F == KQP_OFF128 ? 1 : 2;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int h8 = 0; h8 < 2 && 8 * h8 < rows; h8++) {
        __m256 f[KQP_T];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) f[t] = _mm256_setzero_ps();
        for (int64_t sb = 0; sb < nsb; sb++) {
            const uint8_t *d = panel + sb * KQP_SB + 32 * h8;
            const float *S = (const float *)(panel + sb * KQP_SB + 4096) + 8 * h8, *O = S + 256;
            for (int j = 0; j < 8; j++) {
                const kqp_at X = kqp_block_at(A, sb, j, F);
#pragma GCC unroll 2
                for (int h = 0; h < sub; h++) {
                    __m256i acc[KQP_T], p16[KQP_T];
#pragma GCC unroll 4
                    for (int t = 0; t < T; t++) acc[t] = off ? _mm256_set1_epi32(X.ob[(t0 + t) * X.orr + h]) : _mm256_setzero_si256();
#pragma GCC unroll 8
                    for (int q = 0; q < 8 / sub; q++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(d + (8 * j + 4 * h + q) * 64));
                        const __m256i u = F == KQP_OFF128 ? _mm256_sign_epi8(v, v) : v;
#pragma GCC unroll 4
                        for (int t = 0; t < T; t++) {
                            const __m256i c = _mm256_set1_epi32(kqp_c4(&X, t0 + t, h, q));
                            const __m256i p = _mm256_maddubs_epi16(u, F == KQP_OFF128 ? _mm256_sign_epi8(c, v) : c);
                            p16[t] = q % G ? _mm256_add_epi16(p16[t], p) : p; /* int16 sums of G (kqp_pairs) */
                            if (q % G == G - 1 || q == 8 / sub - 1) acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(p16[t], ones));
                            __asm__("" : "+x"(p16[t]), "+x"(acc[t])); /* one chain each (GCC's add trees spilled) */
                        }
                    }
                    const __m256 sv = _mm256_loadu_ps(S + 16 * (2 * j + h));
#pragma GCC unroll 4
                    for (int t = 0; t < T; t++)
                        f[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[t]), sv),
                                               _mm256_set1_ps(A->dx[(t0 + t) * A->nb + X.b0]), f[t]);
                }
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) {
                    const int64_t b = (t0 + t) * A->nb + X.b0;
                    if (F == KQP_MIN32) {
                        float s32;
                        memcpy(&s32, X.ob + (t0 + t) * X.orr, 4);
                        f[t] = _mm256_fnmadd_ps(_mm256_loadu_ps(O + 32 * j), _mm256_set1_ps(s32), f[t]);
                    }
                    if (F == KQP_MIN16) {
                        f[t] = _mm256_fnmadd_ps(_mm256_loadu_ps(O + 32 * j), _mm256_set1_ps(A->xs16[2 * b]), f[t]);
                        f[t] = _mm256_fnmadd_ps(_mm256_loadu_ps(O + 32 * j + 16), _mm256_set1_ps(A->xs16[2 * b + 1]), f[t]);
                    }
                }
            }
        }
        const int64_t rr = rows - 8 * h8 < 8 ? rows - 8 * h8 : 8;
        const __m256i mk = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)rr), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) _mm256_maskstore_ps(out + (t0 + t) * ldo + col + 8 * h8, mk, f[t]);
    }
}
#endif

#endif /* POLY_FORMATS_KQUANT_PANELS_AVX2_H */

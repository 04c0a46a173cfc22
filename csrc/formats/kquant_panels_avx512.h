/* The K-quant prompt panels' tiles on AVX-512 (formats/kquant_panels.h has the layout and the why). */
#ifndef POLY_FORMATS_KQUANT_PANELS_AVX512_H
#define POLY_FORMATS_KQUANT_PANELS_AVX512_H
#include "core/common.h"
#include "formats/pq_decode.h"
#include "rows/avx512.h"
#include "formats/kquant_rows.h"
#include "formats/kquant_panels.h"
#include "formats/kquant_interleave8_panels.h"
#include "formats/kquant_panels_prep.h"
#if PK_AVX512
#ifdef __AVX512VNNI__
#define KQP_DP(acc, u, x) _mm512_dpbusd_epi32(acc, u, x)
#else
#define KQP_DP(acc, u, x) _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), _mm512_set1_epi16(1)))
#endif

/* 16 x 16 32-bit transpose in place: v[r] lane l -> v[l] lane r */
static inline void kqp_transpose(__m512i v[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        v[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        v[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        v[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        v[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) { /* 128-bit lanes: rows 0-3 with 4-7, 8-11 with 12-15 */
        t[i] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        v[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        v[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* rows [r0, r0 + rows) (rows <= 16; missing rows decode as zeros) into the panel: nsb records */
/* IQ4 super-block p's scale per 16 (two of each: one per 32) */
static inline __m512 kqp_iq4_scales(int kind, const uint8_t *p) {
    float s[16];
    for (int j = 0; j < 8; j++) s[2 * j] = s[2 * j + 1] = pq_iq4_d(kind, p, j);
    return _mm512_loadu_ps(s);
}

static void kqp_decode(int kind, const uint8_t *w, int64_t rb, const uint8_t *rk, int64_t nsb, int64_t r0, int64_t rows,
                       uint8_t *panel) {
    uint8_t tmp[16][256];
    if (kqp_decode_rk(kind, rk, nsb, r0, rows, panel)) return;
    for (int64_t sb = 0; sb < nsb; sb++) {
        uint8_t *d = panel + sb * KQP_SB;
        __m512i v[16], o[16];
        const uint8_t *p[16];
        kqp_prefetch(kind, w, rb, rk, nsb, r0, rows, sb);
        for (int r = 0; r < 16; r++) p[r] = r < rows ? kqp_sbp(kind, w, rb, rk, nsb, r0 + r, sb, tmp[r]) : NULL;
        for (int c = 0; c < 4; c++) { /* 64 weights of each row: 16 lanes of 4 codes */
            for (int r = 0; r < 16; r++)
                v[r] = r < rows ? k8_codes2(kind, p[r], c) : _mm512_setzero_si512();
            kqp_transpose(v);
            for (int q = 0; q < 16; q++) _mm512_storeu_si512((void *)(d + (16 * c + q) * 64), v[q]);
        }
        for (int r = 0; r < 16; r++) { /* row r's 16 S and o, then lanes: S[j][r], o[j][r] */
            if (kqp_form(kind) == KQP_OFF128) { /* no o: the offset is in the integer sums */
                v[r] = r < rows ? _mm512_castps_si512(kqp_iq4_scales(kind, p[r])) : _mm512_setzero_si512();
                o[r] = _mm512_setzero_si512();
                continue;
            }
            k8_sb B = {0};
            if (r < rows) k8_scales(kind, p[r], &B);
            const __m512 s = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)B.s)));
            v[r] = _mm512_castps_si512(_mm512_mul_ps(s, _mm512_set1_ps(B.D)));
            const __m512 ov = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)B.o)));
            o[r] = _mm512_castps_si512(_mm512_mul_ps(ov, _mm512_set1_ps(B.om)));
        }
        kqp_transpose(v);
        kqp_transpose(o);
        for (int j = 0; j < 16; j++) {
            _mm512_storeu_si512((void *)(d + 4096 + 64 * j), v[j]);
            _mm512_storeu_si512((void *)(d + 5120 + 64 * j), o[j]);
        }
    }
}

/* the panel's 16 rows x inputs t0.. (T of them): out[t][col .. col + rows) */
static inline __attribute__((always_inline)) void kqp_tile(const mm_args *A, const uint8_t *panel, int64_t nsb, int64_t t0,
                                                           float *out, int64_t ldo, int64_t col, int64_t rows,
                                                           const int F, const int T) {
    const int off = F == KQP_OFF32 || F == KQP_OFF4 || F == KQP_OFF128;
    const int sub = F == KQP_MIN32 || F == KQP_OFF128 ? 1 : 2; /* int sums per 32 */
    __m512 f[KQP_T];
#pragma GCC unroll 8
    for (int t = 0; t < T; t++) f[t] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *d = panel + sb * KQP_SB;
        const float *S = (const float *)(d + 4096), *O = S + 256;
#pragma GCC unroll 2
        for (int j = 0; j < 8; j++) { /* 32 weights: one dx */
            const kqp_at X = kqp_block_at(A, sb, j, F);
            __m512 g[KQP_T];
#pragma GCC unroll 2
            for (int h = 0; h < sub; h++) { /* 32 / sub weights: one S (and o) */
                __m512i acc[KQP_T];
#pragma GCC unroll 8
                for (int t = 0; t < T; t++) acc[t] = off ? _mm512_set1_epi32(X.ob[(t0 + t) * X.orr + h]) : _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int q = 0; q < 8 / sub; q++) {
                    const __m512i u = _mm512_loadu_si512((const void *)(d + (8 * j + 4 * h + q) * 64));
#pragma GCC unroll 8
                    for (int t = 0; t < T; t++) acc[t] = KQP_DP(acc[t], u, _mm512_set1_epi32(kqp_c4(&X, t0 + t, h, q)));
                }
                const __m512 sv = _mm512_loadu_ps(S + 16 * (2 * j + h));
#pragma GCC unroll 8
                for (int t = 0; t < T; t++)
                    g[t] = h ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t]), sv, g[t]) : _mm512_mul_ps(_mm512_cvtepi32_ps(acc[t]), sv);
            }
#pragma GCC unroll 8
            for (int t = 0; t < T; t++) {
                const int64_t b = (t0 + t) * A->nb + X.b0;
                f[t] = _mm512_fmadd_ps(g[t], _mm512_set1_ps(A->dx[b]), f[t]);
                if (F == KQP_MIN32) { /* one min per 32: o[2j] times the codes' sum over 32 */
                    float s32;
                    memcpy(&s32, X.ob + (t0 + t) * X.orr, 4);
                    f[t] = _mm512_fnmadd_ps(_mm512_loadu_ps(O + 32 * j), _mm512_set1_ps(s32), f[t]);
                }
                if (F == KQP_MIN16) { /* o per 16 */
                    f[t] = _mm512_fnmadd_ps(_mm512_loadu_ps(O + 32 * j), _mm512_set1_ps(A->xs16[2 * b]), f[t]);
                    f[t] = _mm512_fnmadd_ps(_mm512_loadu_ps(O + 32 * j + 16), _mm512_set1_ps(A->xs16[2 * b + 1]), f[t]);
                }
            }
        }
    }
    const __mmask16 mk = rows >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << rows) - 1);
#pragma GCC unroll 8
    for (int t = 0; t < T; t++) _mm512_mask_storeu_ps(out + (t0 + t) * ldo + col, mk, f[t]);
}

#endif

#endif /* POLY_FORMATS_KQUANT_PANELS_AVX512_H */

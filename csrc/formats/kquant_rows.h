/* K-quant rows (Q2_K ... Q6_K) with int8 activations: each 256-element super-block is decoded
 * once per row into unsigned codes u (one 32-byte vector per sub-block), integer scales s per 16
 * elements and integer offsets o per 16 elements times a float om, so that
 *     value = D * s * u - om * o
 * (Q4_K/Q5_K/Q2_K: om = dmin, o = the min; Q3_K/Q6_K: the code offset, om = 4 D or 32 D, o = s).
 * The codes meet x's int8 codes in maddubs, the scales in madd. The "auto" mode (the default,
 * A->x1) takes x as one code per element with one scale a super-block (core/activations.h quantize_k, like
 * llama.cpp's Q8_K): a super-block's integer sums and the offsets' o * sum(x's codes) stay in
 * int32 and convert once. POLY_ACT_Q8=1 takes x's two codes per 32-block (xh, xl: core/activations.h
 * quantize_x), a float multiply by dx per sub-block, the offsets on x's float sums (xs16):
 * within ~1e-4 of the float path. */
#ifndef POLY_FORMATS_KQUANT_ROWS_H
#define POLY_FORMATS_KQUANT_ROWS_H
#include "core/common.h"
#include "formats/kinds.h"
#include "core/half.h"
#include "formats/pq_decode.h"
#include "rows/avx512.h"
#include "rows/dense_dot.h"

/* the Python entry's auto mode (matmul/entry.h) takes int8 activations for these kinds up to this
 * many input rows (the fused step: every row of independent sequences, csrc/decode/args.h) */
#define K8_ROWS 1

/* the kinds read a 256-element super-block at a time (their scales and codes:
 * formats/kquant_blocks.h k8_scales, k8_codes, formats/gguf_blocks.h k8_codes2) */
static inline int k8_kind(int kind) { return KINDS[kind]->k8; }

/* the 32-block kinds without repacked rows whose decode rows take x's first int8 code in the auto
 * mode (rows/int8_rows.h pq8_row), like the K-quants (record .pq8) */
static inline int pq8_kind(int kind) { return KINDS[kind]->pq8; }

#if PK_SIMD

/* the float offsets of groups 8 h .. 8 h + 7 (x's two codes: offsets meet x's float sums) */
static inline __m256 k8_off8(const k8_sb *S, int h) {
    const __m128i o = _mm_loadu_si128((const __m128i *)(S->o + 8 * h));
    return _mm256_mul_ps(_mm256_set1_ps(S->om), _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(o)));
}

/* 8 int32: sum over the 32 elements of sub-block j of s * u * xc, in 4-element groups */
static inline __m256i k8_dot(__m256i u, __m256i sv, const int8_t *xc) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i *)xc)), sv);
}

#if PK_AVX512
/* the scale vectors of sub-blocks 2 q2 and 2 q2 + 1 (int16 lanes 0-15, 16-31) from the 16 in s16 */
static inline __m512i k8_pair_scales(__m512i s16, int q2) {
    const __m512i grp = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2,
                                         1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_epi16(_mm512_add_epi16(grp, _mm512_set1_epi16((short)(4 * q2))), s16);
}

/* int8 codes of 32-blocks b and b + 1 of an input row, one 64-byte vector (xh or xl: off 0, 32) */
static inline __m512i k8_x2(const int8_t *xq, int64_t b, int off) {
    const int8_t *p = xq + b * 64 + off;
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                              _mm256_loadu_si256((const __m256i *)(p + 64)), 1);
}

/* k8_tile on 64-byte vectors: sub-blocks 2c' and 2c' + 1 side by side (lanes 0-7 and 8-15 of the
 * int32 sums), their scales picked from the 16 with one permute, dx of each half with another */
static inline __attribute__((always_inline)) void k8_tile512(int kind, const mm_args *A, int64_t r, int64_t c, const int nn) {
    const uint8_t *row = A->w + r * A->rb;
    const int64_t nsb = A->nb / 8;
    const __m512i half = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512 rl = _mm512_set1_ps(1.0f / XL_SCALE);
    __m512 acc[ROW_TILE];
#pragma GCC unroll 16
    for (int i = 0; i < nn; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        k8_sb S;
        const uint8_t *p = row + sb * BLOCK_BYTES[kind];
        k8_scales(kind, p, &S);
        const __m512i s16 = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)S.s));
        __m512 part[ROW_TILE]; /* one chain a row, whatever the tile: a row's sums do not depend on nn */
        for (int i = 0; i < nn; i++) part[i] = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int q2 = 0; q2 < 4; q2++) {
            const __m512i u = k8_codes2(kind, p, q2);
            const __m512i sv = k8_pair_scales(s16, q2);
#pragma GCC unroll 16
            for (int i = 0; i < nn; i++) {
                const int64_t b = (c + i) * A->nb + sb * 8 + 2 * q2;
                const __m512i qh = _mm512_madd_epi16(_mm512_maddubs_epi16(u, k8_x2(A->xq, b, 0)), sv);
                const __m512i ql = _mm512_madd_epi16(_mm512_maddubs_epi16(u, k8_x2(A->xq, b, 32)), sv);
                double d2; /* dx of blocks b, b + 1 */
                memcpy(&d2, A->dx + b, 8);
                const __m512 dx = _mm512_permutexvar_ps(half, _mm512_castpd_ps(_mm512_set1_pd(d2)));
                const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ql), rl, _mm512_cvtepi32_ps(qh));
                part[i] = _mm512_fmadd_ps(f, dx, part[i]);
            }
        }
        const __m512 dv = _mm512_set1_ps(S.D), ov = _mm512_insertf32x8(_mm512_castps256_ps512(k8_off8(&S, 0)), k8_off8(&S, 1), 1);
#pragma GCC unroll 16
        for (int i = 0; i < nn; i++) {
            acc[i] = _mm512_fmadd_ps(part[i], dv, acc[i]);
            acc[i] = _mm512_fnmadd_ps(ov, _mm512_loadu_ps(A->xs16 + ((c + i) * A->nb + sb * 8) * 2), acc[i]);
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < nn; i++) A->out[(c + i) * A->ldo + r] = _mm512_reduce_add_ps(acc[i]);
}
#endif

/* scales of sub-block j from the 16 (sl: s[0..7] in both lanes, then s[8..15]): s[2 j] in the
 * low 8 lanes, s[2 j + 1] in the high ones */
static inline __m256i k8_sub_scales(const __m256i sl[2], int j) {
    const char e = (char)(4 * (j & 3));
    const __m256i pick = _mm256_setr_epi8(e, e + 1, e, e + 1, e, e + 1, e, e + 1, e, e + 1, e, e + 1, e, e + 1, e, e + 1,
                                          e + 2, e + 3, e + 2, e + 3, e + 2, e + 3, e + 2, e + 3, e + 2, e + 3, e + 2,
                                          e + 3, e + 2, e + 3, e + 2, e + 3);
    return _mm256_shuffle_epi8(sl[j >> 2], pick);
}

/* super-block sb of a row: its scales into S, sl as k8_sub_scales takes them; returns its bytes */
static inline __attribute__((always_inline)) const uint8_t *k8_super(int kind, const uint8_t *row, int64_t sb, k8_sb *S,
                                                                     __m256i sl[2]) {
    const uint8_t *p = row + sb * BLOCK_BYTES[kind];
    k8_scales(kind, p, S);
    const __m256i s16 = _mm256_loadu_si256((const __m256i *)S->s);
    sl[0] = _mm256_permute2x128_si256(s16, s16, 0x00);
    sl[1] = _mm256_permute2x128_si256(s16, s16, 0x11);
    return p;
}

/* the auto mode (x1): output row r for the nn input rows from c on, x as one code per element
 * with one scale a super-block (xk, dk: core/activations.h quantize_k). The eight sub-blocks' sums s * u *
 * xc add up in int32 and the offsets' o * sum(xc) per 16 too: two converts and two FMAs a
 * super-block (llama.cpp's Q8_K dots; with x's scale per 32-block a convert and an FMA a
 * sub-block, Zen 4 Q4_K rows ran compute-bound at 12.8 GB/s a thread) */
static inline __attribute__((always_inline)) void k8_tile_k(int kind, const mm_args *A, int64_t r, int64_t c, const int nn) {
    const uint8_t *row = A->w + r * A->rb;
    const int64_t nsb = A->nb / 8;
    __m256 acc[ROW_TILE];
#pragma GCC unroll 16
    for (int i = 0; i < nn; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        k8_sb S;
        __m256i sl[2];
        const uint8_t *p = k8_super(kind, row, sb, &S, sl);
        const __m256i o16 = _mm256_loadu_si256((const __m256i *)S.o);
        __m256i isum[ROW_TILE];
#pragma GCC unroll 16
        for (int i = 0; i < nn; i++) isum[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const __m256i sv = k8_sub_scales(sl, j), u = k8_codes(kind, p, j);
#pragma GCC unroll 16
            for (int i = 0; i < nn; i++)
                isum[i] = _mm256_add_epi32(isum[i], k8_dot(u, sv, A->xk + ((c + i) * nsb + sb) * XK_BYTES + 32 * j));
        }
#pragma GCC unroll 16
        for (int i = 0; i < nn; i++) {
            const int64_t g = (c + i) * nsb + sb;
            const __m256i io = _mm256_madd_epi16(o16, _mm256_loadu_si256((const __m256i *)(A->xk + g * XK_BYTES + 256)));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_set1_ps(S.D * A->dk[g]), acc[i]);
            acc[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(io), _mm256_set1_ps(S.om * A->dk[g]), acc[i]);
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < nn; i++) A->out[(c + i) * A->ldo + r] = hsum(acc[i]);
}

/* x's two codes per 32-block (POLY_ACT_Q8=1): output row r for the nn input rows from c on (nn a
 * constant after inlining) */
static inline __attribute__((always_inline)) void k8_tile(int kind, const mm_args *A, int64_t r, int64_t c, const int nn) {
#if PK_AVX512
    k8_tile512(kind, A, r, c, nn);
#else
    /* 8 lanes: one sub-block a vector; x's two codes meet the scales s * 254 and s in int32
     * (254 sh + sl: |.| <= 1.04e9, no overflow), one convert and one FMA a sub-block */
    const uint8_t *row = A->w + r * A->rb;
    const int64_t nsb = A->nb / 8;
    __m256 acc[ROW_TILE];
#pragma GCC unroll 16
    for (int i = 0; i < nn; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        k8_sb S;
        __m256i sl[2];
        const uint8_t *p = k8_super(kind, row, sb, &S, sl);
        const __m256i f = _mm256_set1_epi16((short)XL_SCALE);
        const __m256i sh[2] = {_mm256_mullo_epi16(sl[0], f), _mm256_mullo_epi16(sl[1], f)};
        __m256 part[ROW_TILE];
        for (int i = 0; i < nn; i++) part[i] = _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const __m256i sv = k8_sub_scales(sl, j), svh = k8_sub_scales(sh, j), u = k8_codes(kind, p, j);
#pragma GCC unroll 16
            for (int i = 0; i < nn; i++) {
                const int64_t b = (c + i) * A->nb + sb * 8 + j;
                const __m256i t = _mm256_add_epi32(k8_dot(u, svh, A->xq + b * 64), k8_dot(u, sv, A->xq + b * 64 + 32));
                part[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(A->dx[b]), part[i]);
            }
        }
        const __m256 dv = _mm256_set1_ps(S.D * (1.0f / XL_SCALE)), o0 = k8_off8(&S, 0), o1 = k8_off8(&S, 1);
#pragma GCC unroll 16
        for (int i = 0; i < nn; i++) {
            const float *x16 = A->xs16 + ((c + i) * A->nb + sb * 8) * 2;
            acc[i] = _mm256_fmadd_ps(part[i], dv, acc[i]);
            acc[i] = _mm256_fnmadd_ps(o0, _mm256_loadu_ps(x16), acc[i]);
            acc[i] = _mm256_fnmadd_ps(o1, _mm256_loadu_ps(x16 + 8), acc[i]);
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < nn; i++) A->out[(c + i) * A->ldo + r] = hsum(acc[i]);
#endif
}

static inline __attribute__((always_inline)) void k8_row(int kind, const mm_args *A, int64_t r, int64_t n) {
#define K8TILE(c, nn) k8_tile(kind, A, r, c, nn)
#define K8TILEK(c, nn) k8_tile_k(kind, A, r, c, nn)
    if (A->x1) FOR_TILES(n, K8TILEK);
    else FOR_TILES(n, K8TILE);
#undef K8TILE
#undef K8TILEK
}
#endif

#endif /* POLY_FORMATS_KQUANT_ROWS_H */

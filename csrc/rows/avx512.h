/* 16-lane float kernels for the avx512 build (csrc/isa/unit_avx512.c): the same block decoders,
 * codes widened to 16 floats per instruction, so a 32-element block costs half the conversions
 * and FMAs of the 8-lane path. */
#ifndef POLY_ROWS_AVX512_H
#define POLY_ROWS_AVX512_H
#include "core/common.h"
#include "formats/kinds.h"
#include "formats/bf16.h"
#include "core/half.h"
#include "formats/block32.h"
#include "formats/pq_decode.h"
#if PK_AVX512

static inline __m512 pk_widen16(__m128i c) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)); }

/* block b of row r as 2 x 16 floats v (codes, or values when D = 1, M = 0): value = D * v + M */
static inline __attribute__((always_inline)) void dec512(int kind, const mm_args *A, int64_t r, int64_t b, __m512 v[2],
                                                         float *D, float *M, pq_cache *pc) {
    const uint8_t *row = A->w + r * A->rb;
    __m256i c;
    if (!b32_codes(kind, A, r, b, &c, D, M)) { /* the GGUF kinds: int8 codes, half scales (formats/pq_decode.h) */
        pq_sc s;
        const uint8_t *p = pq_scales(kind, row, b, &s, pc);
        c = pq_codes_simd(kind, p, b);
        v[0] = pk_widen16(_mm256_castsi256_si128(c));
        v[1] = pk_widen16(_mm256_extracti128_si256(c, 1));
        if (pq_uniform(kind)) { *D = s.d[0]; *M = s.m[0]; return; }
        v[0] = _mm512_fmadd_ps(v[0], _mm512_set1_ps(s.d[0]), _mm512_set1_ps(s.m[0]));
        v[1] = _mm512_fmadd_ps(v[1], _mm512_set1_ps(s.d[1]), _mm512_set1_ps(s.m[1]));
        *D = 1.0f; *M = 0.0f;
        return;
    }
    v[0] = pk_widen16(_mm256_castsi256_si128(c)); /* codes fit int8 for every kind */
    v[1] = pk_widen16(_mm256_extracti128_si256(c, 1));
}

/* The lane sums of 16 vectors in one vector, lane j = the sum of v[j]: each summed in exactly
 * _mm512_reduce_add_ps's order (halves of 256, 128, 64, 32 bits), so a tile's results do not
 * change, in 45 instructions instead of 16 x 8 (an 8-row tile at k 576 spent 15 % in them).
 * The shuffles leave sum(w[q]) in lane 4 * (q % 4) + q / 4, so w is v in that order. */
static inline __m512 reduce16(const __m512 v[16]) {
    __m512 w[16], s[8], t[4], u[2];
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) w[4 * (j % 4) + j / 4] = v[j];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) /* [a lo 8 + a hi 8 | b lo 8 + b hi 8] */
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xEE));
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) /* 128-bit lanes 0, 2 + 1, 3 */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++) /* within 128-bit lanes: elements 0, 1 + 2, 3 */
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
}

/* the lane sums of a[0..nn) into s[0..nn), and with b of b[0..nn) into s[8..8 + nn): from 4
 * vectors on through reduce16 (zero vectors add nothing), each in _mm512_reduce_add_ps's order */
static inline __attribute__((always_inline)) void lane_sums(const __m512 *a, const __m512 *b, const int nn,
                                                            float s[16]) {
    if (nn * (b ? 2 : 1) < 4) {
        for (int i = 0; i < nn; i++) {
            s[i] = _mm512_reduce_add_ps(a[i]);
            if (b) s[8 + i] = _mm512_reduce_add_ps(b[i]);
        }
        return;
    }
    __m512 v[16];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        v[i] = i < nn ? a[i] : _mm512_setzero_ps();
        v[8 + i] = b && i < nn ? b[i] : _mm512_setzero_ps();
    }
    _mm512_storeu_ps(s, reduce16(v));
}

/* block b of row r dequantized: D * codes + M as 2 x 16 floats */
static inline __attribute__((always_inline)) void deq512(int kind, const mm_args *A, int64_t r, int64_t b, __m512 w[2],
                                                         pq_cache *pc) {
    if (KINDS[kind]->nib4) { /* 16 values D * c + M, looked up */
        const uint8_t *q;
        float D, M;
        const int x = b32_nib4(kind, A, r, b, &q, &D, &M); /* formats/block32.h */
        __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q)); /* permutes read 4 bits */
        if (x) lo = _mm512_xor_si512(lo, _mm512_set1_epi32(x)); /* Loom: nibble ^ 8 = code + 8 */
        const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512 tab = _mm512_fmadd_ps(iota, _mm512_set1_ps(D), _mm512_set1_ps(M));
        w[0] = _mm512_permutexvar_ps(lo, tab);
        w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(lo, 4), tab);
        return;
    }
    __m512 v[2];
    float D, M;
    dec512(kind, A, r, b, v, &D, &M, pc);
    const __m512 vd = _mm512_set1_ps(D), vm = _mm512_set1_ps(M);
    w[0] = _mm512_fmadd_ps(v[0], vd, vm);
    w[1] = _mm512_fmadd_ps(v[1], vd, vm);
}

/* `rows` weight rows from r (1 or 2: a pair shares each x load, four FMAs instead of two) times
 * the nn input rows from c on: each block dequantized once (D * codes + M) for all inputs,
 * one accumulator per (row, input) with two FMAs a block, so a row's sums are the same alone
 * and in a pair */
static inline __attribute__((always_inline)) void quant_rows512(int kind, const mm_args *A, int64_t r, int64_t c,
                                                                const int nn, const int rows) {
    __m512 a[2][ROW_TILE];
    pq_cache pc[2] = {{NULL}, {NULL}};
    float s[16];
#pragma GCC unroll 2
    for (int q = 0; q < rows; q++)
#pragma GCC unroll 16
        for (int i = 0; i < nn; i++) a[q][i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < A->nb; b++) {
        __m512 w[2][2];
#pragma GCC unroll 2
        for (int q = 0; q < rows; q++) deq512(kind, A, r + q, b, w[q], &pc[q]);
#pragma GCC unroll 16
        for (int i = 0; i < nn; i++) {
            const float *xb = A->x + (c + i) * A->k + b * 32;
            const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
#pragma GCC unroll 2
            for (int q = 0; q < rows; q++) a[q][i] = _mm512_fmadd_ps(w[q][1], x1, _mm512_fmadd_ps(w[q][0], x0, a[q][i]));
        }
    }
    lane_sums(a[0], rows == 2 ? a[1] : NULL, nn, s);
#pragma GCC unroll 8
    for (int i = 0; i < nn; i++) {
        A->out[(c + i) * A->ldo + r] = s[i];
        if (rows == 2) A->out[(c + i) * A->ldo + r + 1] = s[8 + i];
    }
}

/* quant_row on 16 lanes for the nn input rows from c on: one input too takes quant_rows512's
 * sums (one accumulator per row and input, two FMAs a block), so a sequence's numbers are the
 * same decoded alone and batched (the codes-then-scale form differed in the last bits: 1e-5 of
 * SmolLM2's logits). Except the 4-bit kinds not repacked (Loom Q4; GGUF Q4_0/Q4_1 in other
 * shapes, csrc/formats/interleave16.h): one input multiplies the looked-up block values by x on four FMA
 * chains, two blocks a step (a 1B Loom Q4 decode 46 tok/s, 34 on the tile's one chain). */
static inline __attribute__((always_inline)) void quant_tile512(int kind, const mm_args *A, int64_t r, int64_t c,
                                                                const int nn) {
    if (nn == 1 && KINDS[kind]->nib4) {
        pq_cache pc = {NULL};
        const float *xb = A->x + c * A->k;
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, w[2], u[2];
        int64_t b = 0;
        for (; b + 2 <= A->nb; b += 2) {
            deq512(kind, A, r, b, w, &pc);
            deq512(kind, A, r, b + 1, u, &pc);
            s0 = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xb + b * 32), s0);
            s1 = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xb + b * 32 + 16), s1);
            s2 = _mm512_fmadd_ps(u[0], _mm512_loadu_ps(xb + b * 32 + 32), s2);
            s3 = _mm512_fmadd_ps(u[1], _mm512_loadu_ps(xb + b * 32 + 48), s3);
        }
        if (b < A->nb) {
            deq512(kind, A, r, b, w, &pc);
            s0 = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xb + b * 32), s0);
            s1 = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xb + b * 32 + 16), s1);
        }
        A->out[c * A->ldo + r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s2), _mm512_add_ps(s1, s3)));
        return;
    }
    quant_rows512(kind, A, r, c, nn, 1);
}

/* 16 weights of a dense row as floats */
static inline __m512 load16(int kind, const uint8_t *row, int64_t j) {
    switch (kind) {
    case K_F32: return _mm512_loadu_ps((const float *)row + j);
    case K_F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * j)));
    default:
        if (KINDS[kind]->bf16) return bf16_16(row, j); /* formats/bf16.h */
        return pk_widen16(_mm_loadu_si128((const __m128i *)(row + j)));
    }
}

/* dense_dot's 16-lane main loop: j advances over the whole 64-element chunks */
static inline __attribute__((always_inline)) float dense_dot512(int kind, const uint8_t *row, const float *x, int64_t k,
                                                                int64_t *j) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; *j + 64 <= k; *j += 64) {
        a0 = _mm512_fmadd_ps(load16(kind, row, *j), _mm512_loadu_ps(x + *j), a0);
        a1 = _mm512_fmadd_ps(load16(kind, row, *j + 16), _mm512_loadu_ps(x + *j + 16), a1);
        a2 = _mm512_fmadd_ps(load16(kind, row, *j + 32), _mm512_loadu_ps(x + *j + 32), a2);
        a3 = _mm512_fmadd_ps(load16(kind, row, *j + 48), _mm512_loadu_ps(x + *j + 48), a3);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
#endif

#endif /* POLY_ROWS_AVX512_H */

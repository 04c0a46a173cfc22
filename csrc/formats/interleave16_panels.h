/* A prompt's gemm panels read the copy of Q4_0/Q4_1/Q8_0/int8/Loom Q4 rows repacked by 16
 * (csrc/formats/interleave16.h) back as stored rows. */
#ifndef POLY_FORMATS_INTERLEAVE16_PANELS_H
#define POLY_FORMATS_INTERLEAVE16_PANELS_H
#include "core/common.h"
#include "formats/kinds.h"
#include "formats/interleave16.h"
#include "gemm/dequant.h"

/* row r of a Q4_0/Q4_1/Q8_0/int8 matrix repacked by 16 (csrc/formats/interleave16.h) as its stored rows again,
 * then dq_row: a prompt's GEMM reads the copy, so the stored rows, released after the repack,
 * stay out of memory (a 1B Q4_0 model resident 1.33 GB with both, 0.74 with one) */
static void dq_row_il16_loom(int kind, const dq_args *D, int64_t r, float *dst);
static void dq_row_il16(int kind, const dq_args *D, int64_t r, float *dst) {
    if (KINDS[kind]->flat) { dq_row_il16_loom(kind, D, r, dst); return; }
    const int i8 = kind == K_I8; /* int8 rows: the codes alone, the scale per row (aux) */
    const int64_t nb = D->k / 32, bb = i8 ? 32 : BLOCK_BYTES[kind], l = r % 16;
    const int64_t rec = il16_rec(kind), nq = il16_q8(kind) ? 8 : 4, co = il16_codes_at(kind); /* code quads a row holds */
    const uint8_t *g = D->rp + (r / 16) * nb * rec;
    uint8_t row[nb * bb];
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = g + b * rec;
        uint8_t *o = row + b * bb;
        if (!i8) memcpy(o, p + 2 * l, 2);
        if (KINDS[kind]->il16 == IL16_MIN) memcpy(o + 2, p + 32 + 2 * l, 2);
        for (int q = 0; q < nq; q++) memcpy(o + bb - 4 * nq + 4 * q, p + co + 64 * q + 4 * l, 4);
    }
    dq_args T = *D;
    T.w = row; T.rb = nb * bb; T.rp = NULL;
    if (i8) T.aux = D->aux + r;
    dq_row(kind, &T, 0, dst);
}

/* Loom Q4's row r from its repacked copy's codes (Q4_0's nibbles of code + 8) and the stored
 * float32 scales (aux; the record's D is their float16 rounding, the decode rows'): (u - 8) * D,
 * the stored rows' dq_row values bit for bit (code * D, one rounding either way) */
static void dq_row_il16_loom(int kind, const dq_args *D, int64_t r, float *dst) {
    const int64_t nb = D->k / 32, l = r % 16;
    const int64_t rec = il16_rec(kind), co = il16_codes_at(kind);
    const uint8_t *g = D->rp + (r / 16) * nb * rec;
    for (int64_t b = 0; b < nb; b++, dst += 32) {
        const uint8_t *p = g + b * rec;
        uint8_t q[16]; /* as Q4_0 stores them: element j low, j + 16 high */
        const float d = D->aux[r * nb + b];
        for (int v = 0; v < 4; v++) memcpy(q + 4 * v, p + co + 64 * v + 4 * l, 4);
#if PK_SIMD
        const __m128i c = _mm_loadu_si128((const __m128i *)q), m15 = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(c, m15), hi = _mm_and_si128(_mm_srli_epi16(c, 4), m15);
        const __m256i e8 = _mm256_set1_epi32(8);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int t = 0; t < 4; t++) {
            const __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(parts[t]), e8));
            _mm256_storeu_ps(dst + 8 * t, _mm256_mul_ps(v, _mm256_set1_ps(d)));
        }
#else
        for (int j = 0; j < 16; j++) {
            dst[j] = (float)((q[j] & 15) - 8) * d;
            dst[16 + j] = (float)((q[j] >> 4) - 8) * d;
        }
#endif
    }
}

#endif /* POLY_FORMATS_INTERLEAVE16_PANELS_H */

/* The row-range functions, one per kind and scheme (RF: float activations, RF8: int8), so each
 * inlines its decoder with a constant kind: the fused step's threads and the matmul entry
 * (matmul/entry.h run_rows) call the same ones. */
#ifndef POLY_ROWS_RANGES_H
#define POLY_ROWS_RANGES_H
#include "core/common.h"
#include "rows/avx512.h"
#include "rows/dense_tiles.h"
#include "rows/quant_tiles.h"
#include "formats/kquant_rows.h"
#include "rows/int8_rows.h"
#include "core/matrix_check.h"
#include "formats/bf16_rows.h"

typedef void (*range_fn)(const mm_args *A, int64_t r0, int64_t r1);
/* with several inputs, rows in pairs (TWO for rows r, r + 1; ONE for row r); one input: one
 * row at a time (a single stream through memory: pairs or quads of one-input rows, the same
 * sums, made a SmolLM2 Q8_0 decode 3.3 -> 5.5-6.5 ms) */
#define RANGE2(NAME, ONE, TWO)                                                               \
    static void NAME(const mm_args *A, int64_t r0, int64_t r1) {                             \
        int64_t r = r0;                                                                      \
        if (A->n > 1)                                                                        \
            for (; r + 1 < r1; r += 2) {                                                     \
                prefetch_row(A, r);                                                          \
                prefetch_row(A, r + 1);                                                      \
                TWO;                                                                         \
            }                                                                                \
        for (; r < r1; r++) {                                                                \
            prefetch_row(A, r);                                                              \
            ONE;                                                                             \
        }                                                                                    \
    }
#define RANGEQ(NAME, KIND)                                                                   \
    RANGE2(NAME, if (A->n == 1) quant_row(KIND, A, r, 1); else quant_row(KIND, A, r, A->n),   \
           quant_row2(KIND, A, r, A->n))
/* dense rows: one input, rows/dense_tiles.h dense_rows1; several, quads, then a pair, then one
 * (dense_row4: x loads shared by four rows), the tiles asking for their rows (tile_prefetch) */
#define RANGED(NAME, KIND)                                                                   \
    static void NAME(const mm_args *A, int64_t r0, int64_t r1) {                             \
        int64_t r = r0;                                                                      \
        if (KIND == K_BF16 && A->xb) { bf16_range(A, r0, r1); return; } /* formats/bf16_rows.h */       \
        if (A->n == 1) { dense_rows1(KIND, A, r0, r1); return; }                             \
        for (; r + 3 < r1; r += 4) dense_row4(KIND, A, r);                                   \
        if (r + 1 < r1) { dense_row2(KIND, A, r); r += 2; }                                  \
        for (; r < r1; r++) dense_row(KIND, A, r);                                           \
    }
RANGED(r_f32, K_F32)
RANGED(r_f16, K_F16)
RANGED(r_bf16, K_BF16)
RANGED(r_i8, K_I8)
RANGEQ(r_loom, K_LOOM_Q4)
RANGEQ(r_q4_0, K_Q4_0)
RANGEQ(r_q4_1, K_Q4_1)
RANGEQ(r_q8_0, K_Q8_0)
RANGEQ(r_q4_k, K_Q4_K)
RANGEQ(r_q6_k, K_Q6_K)
RANGEQ(r_q5_0, K_Q5_0)
RANGEQ(r_q5_1, K_Q5_1)
RANGEQ(r_q2_k, K_Q2_K)
RANGEQ(r_q3_k, K_Q3_K)
RANGEQ(r_q5_k, K_Q5_K)
RANGEQ(r_iq4_nl, K_IQ4_NL)
RANGEQ(r_iq4_xs, K_IQ4_XS)
RANGEQ(r_mxfp4, K_MXFP4)
/* int8 activations: one row at a time; the auto mode's K-quant rows on AVX-512 builds without
 * prefetch_row's bursts (a stream the hardware prefetcher follows: Zen 4 Q4_K rows +5 %, Q6_K +8 %) */
/* AVX2 builds prefetch them again (Zen 3 1B Q5_K_M decode, alternating: 16.2-17.9 -> 17.4-17.9
 * tok/s) */
#ifndef K8_PF
#define K8_PF (!PK_AVX512)
#endif
#define RANGE8(NAME, KIND)                                                                   \
    static void NAME(const mm_args *A, int64_t r0, int64_t r1) {                             \
        const int pf = K8_PF || !(k8_kind(KIND) && A->x1);                                   \
        for (int64_t r = r0; r < r1; r++) {                                                  \
            if (pf) prefetch_row(A, r);                                                      \
            if (A->n == 1) Q8ROW(KIND, 1); else Q8ROW(KIND, A->n);                           \
        }                                                                                    \
    }
RANGE8(r8_i8, K_I8)
RANGE8(r8_loom, K_LOOM_Q4)
RANGE8(r8_q4_0, K_Q4_0)
RANGE8(r8_q4_1, K_Q4_1)
RANGE8(r8_q8_0, K_Q8_0)
RANGE8(r8_q4_k, K_Q4_K)
RANGE8(r8_q6_k, K_Q6_K)
RANGE8(r8_q5_0, K_Q5_0)
RANGE8(r8_q5_1, K_Q5_1)
RANGE8(r8_q2_k, K_Q2_K)
RANGE8(r8_q3_k, K_Q3_K)
RANGE8(r8_q5_k, K_Q5_K)
RANGE8(r8_iq4_nl, K_IQ4_NL)
RANGE8(r8_iq4_xs, K_IQ4_XS)
RANGE8(r8_mxfp4, K_MXFP4)
static const range_fn RF[K_COUNT] = {r_f32, r_f16, r_bf16, r_i8, r_loom, r_q4_0, r_q4_1, r_q8_0, r_q4_k,
                                     r_q6_k, r_q5_0, r_q5_1, r_q2_k, r_q3_k, r_q5_k, r_iq4_nl, r_iq4_xs, r_mxfp4};
static const range_fn RF8[K_COUNT] = {NULL,    NULL,    NULL,    r8_i8,   r8_loom,  r8_q4_0,
                                      r8_q4_1, r8_q8_0, r8_q4_k, r8_q6_k, r8_q5_0,  r8_q5_1,
                                      r8_q2_k, r8_q3_k, r8_q5_k, r8_iq4_nl, r8_iq4_xs, r8_mxfp4};

#endif /* POLY_ROWS_RANGES_H */

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
#include "formats/vdpbf16_rows.h"
#include "formats/kinds.h"

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
        if (KINDS[KIND]->vdpbf && A->xb) { bf16_range(A, r0, r1); return; } /* formats/vdpbf16_rows.h */ \
        if (A->n == 1) { dense_rows1(KIND, A, r0, r1); return; }                             \
        for (; r + 3 < r1; r += 4) dense_row4(KIND, A, r);                                   \
        if (r + 1 < r1) { dense_row2(KIND, A, r); r += 2; }                                  \
        for (; r < r1; r++) dense_row(KIND, A, r);                                           \
    }
#define RANGED_(name, KIND) RANGED(r_##name, KIND)
#define RANGEQ_(name, KIND) RANGEQ(r_##name, KIND)
DENSE_KINDS(RANGED_)
QUANT_KINDS(RANGEQ_)
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
#define RANGE8_(name, KIND) RANGE8(r8_##name, KIND)
RANGE8(r8_i8, K_I8)
QUANT_KINDS(RANGE8_)
/* the dispatch: kind -> its range function (formats/kinds.h lists the kinds) */
#define RF_SLOT(name, KIND) [KIND] = r_##name,
#define RF8_SLOT(name, KIND) [KIND] = r8_##name,
static const range_fn RF[K_COUNT] = {DENSE_KINDS(RF_SLOT) QUANT_KINDS(RF_SLOT)};
static const range_fn RF8[K_COUNT] = {[K_I8] = r8_i8, QUANT_KINDS(RF8_SLOT)};

#endif /* POLY_ROWS_RANGES_H */

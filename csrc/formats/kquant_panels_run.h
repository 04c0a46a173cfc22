/* The K-quant prompt panels' range function: tiles over the input rows per ISA. */
#ifndef POLY_FORMATS_KQUANT_PANELS_RUN_H
#define POLY_FORMATS_KQUANT_PANELS_RUN_H
#include "core/common.h"
#include "core/prefetch.h"
#include "rows/avx512.h"
#include "formats/kquant_panels.h"
#include "formats/kquant_interleave8_panels.h"
#include "formats/kquant_panels_avx512.h"
#include "formats/kquant_panels_avx2.h"

#if PK_SIMD
#if PK_AVX512
#define KQP_TILE(F, T) kqp_tile(A, panel, nsb, t, out, ldo, r0, rows, F, T)
#else /* AVX2: the int16 sums per kind (kqp_pairs), a constant in each instance */
#define KQP_TILE(F, T)                                                                       \
    do {                                                                                     \
        switch (kqp_pairs(kind)) {                                                           \
        case 8: kqp_tile(A, panel, nsb, t, out, ldo, r0, rows, F, 8, T); break;              \
        case 1: kqp_tile(A, panel, nsb, t, out, ldo, r0, rows, F, 1, T); break;              \
        case 2: kqp_tile(A, panel, nsb, t, out, ldo, r0, rows, F, 2, T); break;              \
        default: kqp_tile(A, panel, nsb, t, out, ldo, r0, rows, F, 4, T); break;             \
        }                                                                                    \
    } while (0)
#endif
#define KQP_TAIL(F)                                                                          \
    switch (n - t) {                                                                         \
    case 7: KQP_TILE(F, KQP_T > 7 ? 7 : 1); break;     \
    case 6: KQP_TILE(F, KQP_T > 6 ? 6 : 1); break;     \
    case 5: KQP_TILE(F, KQP_T > 5 ? 5 : 1); break;     \
    case 4: KQP_TILE(F, KQP_T > 4 ? 4 : 1); break;     \
    case 3: KQP_TILE(F, 3); break;                     \
    case 2: KQP_TILE(F, 2); break;                     \
    case 1: KQP_TILE(F, 1); break;                     \
    default: break;                                                                          \
    }
#define KQP_TILES(F)                                                                                  \
    {                                                                                                 \
        for (; t + KQP_T <= n; t += KQP_T) {                                                          \
            KQP_TILE(F, KQP_T);                                                                       \
            kqp_pf_next(kind, A, next, t, n);                                                         \
        }                                                                                             \
        KQP_TAIL(F)                                                                                   \
    }

/* the stored rows of the panel this thread takes next ([next, next + 16), next < 0: none) asked
 * into L2 a slice after each register tile, while this panel's tiles compute: its decode found
 * them in DRAM, its first loads stalled (11.6 % of a 1B Q5_K_M 128-token prompt in kqp_decode) */
static inline void kqp_pf_next(int kind, const mm_args *A, int64_t next, int64_t t, int64_t n) {
    if (next < 0 || next >= A->m) return;
    const int64_t rows = A->m - next < KQP_ROWS ? A->m - next : KQP_ROWS, tiles = n / KQP_T;
    const int64_t rec = kil8_rec(kind), g0 = next / 8; /* rows by 8: the records of its groups, one run */
    const int64_t bytes = A->rk ? ((next + rows - 1) / 8 - g0 + 1) * (A->nb / 8) * rec : rows * A->rb;
    const int64_t lo = bytes * (t / KQP_T) / tiles, hi = bytes * (t / KQP_T + 1) / tiles;
    const char *w = A->rk ? (const char *)A->rk + g0 * (A->nb / 8) * rec : (const char *)A->w + next * A->rb; /* one run */
    for (int64_t o = lo & ~(int64_t)63; o < hi; o += 64) prefetch_l2(w + o);
}

/* out[t][r0 + r] for the n inputs prepared in A (quantize_xi) and rows [r0, r0 + rows) of A's
 * matrix (rows <= 16); panel: nsb * KQP_SB bytes; next: the first row of the panel this thread
 * likely takes next (kqp_pf_next), or -1 */
static void kqp_rows(int kind, const mm_args *A, int64_t n, float *out, int64_t ldo, int64_t r0, int64_t rows,
                     uint8_t *panel, int64_t next) {
    const int64_t nsb = A->nb / 8;
    kqp_decode(kind, A->w, A->rb, A->rk, nsb, r0, rows, panel);
    int64_t t = 0;
    switch (kqp_form(kind)) {
    case KQP_MIN32: KQP_TILES(KQP_MIN32) break;
    case KQP_OFF32: KQP_TILES(KQP_OFF32) break;
    case KQP_OFF4: KQP_TILES(KQP_OFF4) break;
#if KQP_IQ4
    case KQP_OFF128: KQP_TILES(KQP_OFF128) break;
#endif
    default: KQP_TILES(KQP_MIN16) break;
    }
}

/* rows [r0, r1) in panels of 16 (one thread); after the last, the guess for this thread's next
 * piece of rows is the one the other threads' pieces leave (pieces handed out in turn, decode/matrix.h) */
static void kqp_range(int kind, const mm_args *A, int64_t n, float *out, int64_t ldo, int64_t r0, int64_t r1,
                      uint8_t *panel) {
    const int64_t after = r1 + (pk_nth() - 1) * (r1 - r0);
    for (int64_t rp = r0; rp < r1; rp += KQP_ROWS)
        kqp_rows(kind, A, n, out, ldo, rp, r1 - rp < KQP_ROWS ? r1 - rp : KQP_ROWS, panel, rp + KQP_ROWS < r1 ? rp + KQP_ROWS : after);
}
#endif

#endif /* POLY_FORMATS_KQUANT_PANELS_RUN_H */

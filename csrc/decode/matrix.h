/* One matrix's rows for the fused decode step (decode/step.h): mat_rows routes a product to its
 * kernel (int8 panels, repacked rows, gemm panels, dense tiles, the row kernels); a prompt's rows
 * may be handed out from a shared counter instead of split evenly. */
#ifndef POLY_DECODE_MATRIX_H
#define POLY_DECODE_MATRIX_H
#include "core/common.h"
#include "formats/kinds.h"
#include "rows/avx512.h"
#include "rows/quant_tiles.h"
#include "formats/kquant_rows.h"
#include "formats/kquant_panels.h"
#include "formats/kquant_panels_run.h"
#include "formats/vdpbf16_rows.h"
#include "rows/ranges.h"
#include "formats/interleave16.h"
#include "formats/interleave16_avx2.h"
#include "formats/interleave16_range.h"
#include "formats/kquant_interleave8.h"
#include "gemm/dequant.h"
#include "formats/float_kmajor16.h"
#include "gemm/gemm.h"
#include "decode/step.h"
#include "decode/prep.h"

/* a prompt's F16 (and exact BF16) rows: the row kernels' register tiles read the stored rows
 * (rows/dense_tiles.h dense_row4: 4 rows x 4 inputs, a weight vector converted once for four inputs),
 * DENSE_PIECE inputs a pass (their x, 8 KB a row at k 2,048, stays in L2). The gemm panels'
 * packing lost to them on Zen 4 (1B f16 42-token prompt 67 -> 86-90 tok/s); float32 rows gained
 * nothing and stay on the panels. AVX2 (tiles of 4 rows x 3 inputs): F32/F16/BF16 rows up to
 * MAX_N inputs, as poly.runtime.ckernels.kernel, the panels past it (1B 16-token prompt f32
 * 0.77x -> 1.1x llama.cpp's). */
#ifndef DENSE_PIECE
#define DENSE_PIECE 64
#endif
static inline int dense_tiles(int kind, int bf, int64_t n) {
    if (!PK_AVX512) return PK_SIMD && n <= MAX_N && (kind == K_F32 || kind == K_F16 || (KINDS[kind]->bf16 && !bf));
    return kind == K_F16 || (KINDS[kind]->bf16 && !bf);
}

/* A prompt's rows [m0, m1) handed out as threads free up: each thread asks the shared counter
 * (zeroed before the step's region) for the next piece. An even split left the faster core
 * waiting at the barrier (libgomp's spin 6 % of an AVX2 1B f16 42-token prompt under perf). */
typedef struct { int64_t *ctr, m0, m1; } hand_t;

#define HAND_ROWS 32 /* rows a piece (gemm: a panel, GR rows) */
#define HAND_SLOTS 8 /* counters a block: q, k, v, o, down, gate, up */

/* a piece of a prompt's rows on the repacked rows: il16_range packs each 8 inputs' codes once per
 * piece, so HAND_ROWS-row pieces packed them again every 2 groups of 16 rows (SmolLM2 Q4_0, a
 * 128-token prompt on one thread: the fused step 0.81x the reference path; 2-8 tokens, as a
 * draft's check, +21-27 % with these pieces). About 4 pieces a thread, in whole groups; the same
 * on every thread (one shared counter). No more rows than il16_range's L2 block holds: past it
 * the codes are packed again anyway, and 8B-shaped rows only lost balance. */
static inline int64_t il16_piece(int kind, int64_t rows, int64_t nb) {
    const int64_t share = (rows / (4 * pk_nth()) + 15) & ~(int64_t)15;
    const int64_t block = IL16_L2 / (nb * il16_rec(kind)) * 16, p = share < block ? share : block;
    return p > HAND_ROWS ? p : HAND_ROWS;
}

/* rows [r0, r1) of M for the n prepared inputs; out row i at out + i * ldo. h (not NULL): every
 * thread takes pieces of [h->m0, h->m1) from h's counter instead (gemm panels, il16_piece rows on
 * the repacked rows, HAND_ROWS rows on any other route but the BF16 tiles) and 1 is returned (the same on every thread: the route
 * does not depend on the thread's rows), so the caller waits on a barrier before it reads its own
 * rows */
static int mat_rows(const mat_t *M, const px_t *P, float *out, int64_t ldo, int64_t r0, int64_t r1, int q8,
                    int64_t n, const hand_t *h) {
    mm_args A = M->A;
    A.n = n; A.out = out; A.ldo = ldo;
    A.x = P->x; A.xs = P->xs;
    A.xq = P->xq; A.dx = P->dx; A.xs16 = P->xs16; A.xk = P->xk; A.dk = P->dk;
    A.xo = KQP_PX_XO(P->xq); A.cb = KQP_PX_CB; A.ocb = KQP_PX_OCB; /* quantize_xi's interleaved blocks */
    /* auto mode (3: only repacked rows read codes): K-quant rows on xk (csrc/formats/kquant_rows.h), Q5_0/Q5_1/IQ4
     * and the repacked Q4 rows (formats/interleave16.h il16_x1) on x's first code */
    A.x1 = q8 >= 2;
    const int k8 = q8 == 2 && PK_SIMD && k8_kind(M->kind) && grp_k256(P->grp); /* auto mode: K-quants (csrc/pk_k8*.h) */
    /* auto mode, Q5_0/Q5_1/IQ4 rows of independent sequences (not a prompt: gemm_from above
     * MAX_N): x's first code (formats/kquant_rows.h pq8_kind); a prompt's rows the float paths, as in Python */
    const int pq8 = q8 == 2 && PK_SIMD && pq8_kind(M->kind) && grp_pairs(P->grp) && P->gemm_from > MAX_N;
    const int use8 = q8 == 1 ? PK_SIMD && RF8[M->kind] && (M->kind != K_I8 || A.k % 32 == 0)
                             : k8 || (PK_LOOM8 && q8 == 2 && KINDS[M->kind]->loom8 && grp_pairs(P->grp)) || pq8;
    const int bf = P->bf && bf16_rows(M->kind, 2, A.k); /* a prompt's BF16 products on vdpbf16ps */
    const int hk = PK_KM16 && M->hk; /* rows by 16, k-major: the stored rows are not read */
    const int dense = n > 1 && !use8 && !hk && dense_tiles(M->kind, bf, n);
    const int kqp = PK_SIMD && q8 == 2 && kqp_fits(M->kind, A.k) && P->grp == 8 && P->gbuf;
    /* repacked rows on x's int8 codes (csrc/formats/interleave16.h; x in Q4_0's order, Loom's too) */
    const int il16c = !kqp && PK_IL16 && M->rp && q8 && grp_pairs(P->grp) && (n <= MAX_N || il16p_kind(M->kind));
    const int panels = (hk ? n > 1 : n >= P->gemm_from) && !use8 && P->gbuf && !dense; /* dequantized panels (gemm/gemm.h) */
    const int gemm = panels && !kqp && !il16c; /* surely the panels: they take their rows from h */
    if (bf && !gemm) h = NULL; /* the BF16 tiles convert x per call */
    if (h && !gemm) { /* a piece of rows at a time, each on the route below */
        const int64_t piece = il16c ? il16_piece(M->kind, h->m1 - h->m0, A.k / 32) : HAND_ROWS;
        for (int64_t a; (a = h->m0 + next_piece(h->ctr, -1) * piece) < h->m1;)
            mat_rows(M, P, out, ldo, a, a + piece < h->m1 ? a + piece : h->m1, q8, n, NULL);
        return 1;
    }
    if (r0 >= r1 && !h) return 0;
    const int il16 = il16c && !il16_range(M->kind, &A, M->rp, r0, r1);
    if (KINDS[M->kind]->flat) { A.x = P->xp; A.xq = P->xqp; } /* Loom's own rows: x in Loom order */
#if PK_SIMD
    if (kqp) { /* int8 panels: the codes prep wrote (q8_group 8); Q4_K/Q6_K from their rows by 8 */
        A.rk = M->rk;
        kqp_range(M->kind, &A, n, out, ldo, r0, r1, (uint8_t *)(P->gbuf + pk_tid() * P->gstride));
    } else
#endif
    if (il16) {
        /* done */
    } else if (panels) { /* the bias added panel by panel */
        const dq_args D = {A.w, A.aux, NULL, A.k, A.rb, 0, 0, M->rp, bf, M->hk}; /* rp, hk: read the copy */
        gemm_rows(M->kind, &D, P->x, n, out, ldo, h ? h->m0 : r0, h ? h->m1 : r1, P->gbuf + pk_tid() * P->gstride,
                  P->gpad, M->bias, h ? h->ctr : NULL);
        return h != NULL;
    } else if (bf && bf16_tiles(n) && P->gbuf) { /* a prompt's BF16 rows: x as bf16 once (csrc/formats/vdpbf16_rows.h) */
        uint16_t *xb = (uint16_t *)(P->gbuf + pk_tid() * P->gstride);
        for (int64_t i = 0; i < n; i++) bf16_x(P->x + i * A.k, A.k, xb + i * A.k);
        A.xb = xb;
        bf16_range(&A, r0, r1);
    } else if (hk) {
        km16_range(M->kind, M->hk, A.k, A.x, A.k, n, out, ldo, r0, r1);
    } else if (n > (use8 ? MAX_N : dense ? DENSE_PIECE : row_piece(&A))) { /* pieces of rows, see row_piece */
        const int64_t piece = use8 ? MAX_N : dense ? DENSE_PIECE : row_piece(&A);
        for (int64_t c = 0; c < n; c += piece) {
            const px_t V = px_view(P, P->x + c * A.k, c * A.k);
            mat_rows(M, &V, out + c * ldo, ldo, r0, r1, q8, n - c < piece ? n - c : piece, NULL);
        }
        return 0; /* each piece added its bias */
    } else if (!(k8 && M->rk && !kil8_range(M->kind, &A, M->rk, r0, r1))) /* Q4_K/Q6_K rows by 8 (csrc/formats/kquant_interleave8.h) */
        (use8 ? RF8 : RF)[M->kind](&A, r0, r1);
    add_bias(M->bias, out, ldo, n, r0, r1);
    return 0;
}

static inline void part(int64_t m, int tid, int nt, int64_t *r0, int64_t *r1) {
    *r0 = m * tid / nt; *r1 = m * (tid + 1) / nt;
}

#endif /* POLY_DECODE_MATRIX_H */

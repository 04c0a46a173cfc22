/* The fused step's prepared inputs (px_t): block sums, Loom order and the int8/int16 codes the
 * integer kernels read, written once per input for every matrix that reads it. */
#ifndef POLY_DECODE_PREP_H
#define POLY_DECODE_PREP_H
#include "core/common.h"
#include "formats/kinds.h"
#include "formats/kquant_rows.h"
#include "core/activations.h"
#include "formats/kquant_panels.h"
#include "formats/kquant_panels_prep.h"
#include "formats/interleave16.h"
#include "formats/interleave16_range.h"
#include "decode/step.h"

/* whether grp's codes include quantize_x's pairs; quantize_k's codes per 256 */
static inline int grp_pairs(int grp) { return grp == 1 || grp == 3; }
static inline int grp_k256(int grp) { return grp == 3 || grp == 4; }

/* prep's work for the 32-blocks [b0, b1) of x: block sums (the offset term of the quantized
 * kinds), Loom's reordered copy, int8 codes. Blocks are independent, so threads split them; with
 * the codes per 256 (q8 3) at multiples of 8 blocks (a group's codes are written by the thread
 * whose range holds all of it). */
static void prep_blocks(px_t *P, const float *x, int64_t b0, int64_t b1, int loom, int q8) { /* q8: group */
    for (int64_t b = b0; b < b1; b++) {
        float t = 0.0f;
        for (int l = 0; l < 32; l++) t += x[b * 32 + l];
        P->xs[b] = t;
    }
    if (b1 <= b0) return;
    if (loom) loom_order(x + b0 * 32, P->xp + b0 * 32, (b1 - b0) * 32);
    if (q8 == 8) quantize_xi(x, P->xq, KQP_PX_CB, KQP_PX_XO(P->xq), KQP_PX_OCB, P->dx, P->xs16, b0, b1, -1); /* one code each */
    else if (q8) {
        if (grp_k256(q8)) quantize_k(x, P->xk, P->dk, (b0 + 7) / 8, b1 / 8);
        if (!grp_pairs(q8)) return; /* 4: every reader a K-quant row on the codes per 256 */
        quantize_x(x + b0 * 32, P->xq + b0 * 64, P->dx + b0, b1 - b0);
        if (!P->x1) sums16(x + b0 * 32, P->xs16 + b0 * 2, b1 - b0); /* the two-code K-quant rows' offsets */
        if (loom) quantize_x(P->xp + b0 * 32, P->xqp + b0 * 64, P->dx + b0, b1 - b0);
    }
}

static void prep(px_t *P, const float *x, int64_t k, int loom, int q8) {
    P->x = x; P->k = k;
    if (k % 32 == 0) prep_blocks(P, x, 0, k / 32, loom, q8);
}

/* the codes prep writes for an input of n rows of step S that `want`s them (wants_codes): 0
 * none, 1 quantize_x's int8 pairs per 32-block, 3 those and quantize_k's codes per 256 (the auto
 * mode's K-quant rows), 4 the codes per 256 alone (every reader a K-quant row), 8 quantize_xi's
 * one code per element of the K-quant prompt panels (auto mode, a prompt's rows only:
 * csrc/formats/kquant_panels.h) */
static inline int q8_group_n(const step_t *S, int64_t n, int want) {
    if (!(S->q8 && want)) return 0;
    if (want >= 2 && S->q8 == 2 && S->seq1 && n >= KQP_MIN && n <= KQP_MAX) return 8;
    if (grp_k256(want)) /* the base build's K-quant rows are float */
        return S->q8 == 2 && PK_SIMD ? want : want == 3;
    return 1;
}

static inline int q8_group(const step_t *S, int want) { return q8_group_n(S, S->n, want); }

/* PK_LOOM8 (core/common.h): Loom Q4 rows on x's two int8 codes where rows are independent */
static inline int loom8(const step_t *S, int kind) { return PK_LOOM8 && !S->seq1 && KINDS[kind]->loom8; }
/* the kinds whose rows take int8 codes in step S's auto mode */
static inline int auto8(const step_t *S, int kind) {
    return kqp_kind(kind) || loom8(S, kind) || (PK_SIMD && !S->seq1 && pq8_kind(kind));
}

/* which codes the cnt matrices at M read from an input: 3 or 4 a K-quant in the auto mode (a
 * prompt's rows: the int8 panels, else the codes per 256; 4 when no reader takes the pairs), 2
 * an IQ4 kind in the auto mode (the panels), 1 int8 pairs (every quantized kind with q8 = 1,
 * repacked rows, the auto mode's Q5_0/Q5_1/IQ4 rows outside a prompt), 0 none (an input that
 * only float kernels read is not quantized) */
static inline int wants_codes(const step_t *S, const mat_t *M, int cnt) {
    int kq = 0, iq = 0, pairs = 0;
    for (int i = 0; i < cnt; i++) {
        if (S->q8 == 2 && k8_kind(M[i].kind)) kq = 1;
        else if (S->q8 == 2 && kqp_kind(M[i].kind)) iq = 1;
        else if (S->q8 == 1 || (S->q8 && PK_IL16 && M[i].rp) ||
                 (S->q8 == 2 && (loom8(S, M[i].kind) || (PK_SIMD && !S->seq1 && pq8_kind(M[i].kind)))))
            pairs = 1;
    }
    if (kq) return pairs || iq ? 3 : 4;
    return iq ? 2 : pairs;
}

/* P's buffers seen from element `off` on, with input x (rows of k, k % 32 == 0 for the block
 * kinds, so `off` is a whole number of blocks) */
static px_t px_view(const px_t *P, const float *x, int64_t off) {
    px_t V = *P;
    V.x = x; V.xs = P->xs + off / 32; V.dx = P->dx + off / 32; V.xp = P->xp + off;
    V.xq = P->xq + 2 * off; V.xqp = P->xqp + 2 * off; V.xs16 = P->xs16 + off / 16;
    V.xk = P->xk + off / 256 * XK_BYTES; V.dk = P->dk + off / 256; /* read only where k % 256 == 0 */
    return V;
}

#endif /* POLY_DECODE_PREP_H */

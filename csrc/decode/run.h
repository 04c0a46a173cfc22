/* The fused step's scratch (carved per thread) and its one OpenMP region over the blocks. */
#ifndef POLY_DECODE_RUN_H
#define POLY_DECODE_RUN_H
#include "core/common.h"
#include "formats/kquant_panels.h"
#include "gemm/gemm.h"
#include "decode/step.h"
#include "decode/rmsnorm.h"
#include "decode/recipe.h"
#include "decode/prep.h"
#include "decode/matrix.h"
#include "decode/block.h"
#include "decode/moe.h"

/* floats of one thread's gemm buffers: GR dequantized rows of the widest input, a packed chunk */
static int64_t gemm_stride(const step_t *S) {
    int64_t k = S->d > S->maxq ? S->d : S->maxq;
    if (S->inter > k) k = S->inter;
    return gemm_buf_floats(k, S->n);
}

/* whether a step of R rows (prepared inputs) needs the per-thread panel buffers */
static inline int gemm_bufs(const step_t *S, int64_t R) {
    return R >= GEMM_ROWS || ((S->q8 == 2 || (S->bf && S->seq1)) && R >= KQP_MIN); /* formats/kquant_panels.h, formats/vdpbf16_rows.h */
}

/* scratch floats for step S with nt threads (see carve); the prepared-input pools cover the
 * MoE's gathered rows too */
static size_t pk_scratch_floats(const step_t *S, int nt) {
    const int64_t n = S->n, kmax = S->maxw > S->inter ? S->maxw : S->inter;
    const int64_t R = S->mrows > n ? S->mrows : n, kp = kmax > S->d ? kmax : S->d;
    const int64_t moe = S->mrows ? n * S->mE + 2 * S->mE + 2 * R + R * (2 * S->d + 3 * S->inter)
                                       + (S->mE + 1) * (int64_t)(sizeof(slot_t) / 4 + 1) + 16 : 0;
    return (size_t)(n * (3 * S->d + S->maxw + S->maxq + 3 * S->inter) + 3 * R * kp + sc_stride(S) * S->maxh * nt + moe + 64 + 26 * 16 /* take()'s padding */
                    + 2 * S->nl * HAND_SLOTS /* int64 counters */
                    + (gemm_bufs(S, R) ? nt * gemm_stride(S) : 0));
}

/* the next buffer of `floats` from *f, 64-byte aligned (the scratch is; see pk_scratch_floats) */
static float *take(float **f, int64_t floats) {
    float *p = *f;
    *f = p + ((floats + 15) & ~(int64_t)15);
    return p;
}

/* a sequence's rows share its caches (and page table): seq1 = all rows one sequence's, indep = no
 * two rows the same sequence's */
static void pk_row_sharing(step_t *S) {
    S->seq1 = S->n > 1;
    S->indep = 1;
    for (int i = 0; i < S->n && S->nl; i++)
        for (int j = 0; j < i; j++) {
            const int same = S->L[0].kc[i] == S->L[0].kc[j] && S->tab[i] == S->tab[j];
            S->indep &= !same;
            if (j == 0) S->seq1 &= same;
        }
}

static void carve(const step_t *S, float *f, int nt, bufs_t *B) {
    const int64_t n = S->n, kmax = S->maxw > S->inter ? S->maxw : S->inter;
    const int64_t R = S->mrows > n ? S->mrows : n, kp = kmax > S->d ? kmax : S->d;
    B->slots = (slot_t *)f; /* the floats after stay 64-byte aligned */
    f += S->mrows ? ((S->mE + 1) * (int64_t)(sizeof(slot_t) / 4 + 1) + 15) & ~(int64_t)15 : 0;
    B->h = take(&f, n * S->d); B->qkv = take(&f, n * S->maxw); B->att = take(&f, n * S->maxq);
    B->tmp = take(&f, n * S->d); B->par = take(&f, n * S->d); B->gu = take(&f, 2 * n * S->inter); B->hid = take(&f, n * S->inter);
    B->sc = take(&f, sc_stride(S) * S->maxh * nt);
    B->P.xs = take(&f, R * kp / 32 + 1);
    B->P.dx = take(&f, R * kp / 32 + 1);
    B->P.xs16 = take(&f, R * kp / 16 + 1);
    B->P.xp = take(&f, R * kp);
    B->P.xq = (int8_t *)take(&f, R * kp / 2);
    B->P.xqp = (int8_t *)take(&f, R * kp / 2);
    B->P.xk = (int8_t *)take(&f, R * kp / 256 * XK_BYTES / 4 + 1);
    B->P.dk = take(&f, R * kp / 256 + 1);
    B->ctr = S->seq1 ? (int64_t *)take(&f, 2 * S->nl * HAND_SLOTS) : NULL; /* a prompt's only */
    if (B->ctr) memset(B->ctr, 0, (size_t)(S->nl * HAND_SLOTS) * 8);
    float *m = f; /* without MoE its buffers' room is the gemm panels' */
    B->rl = take(&f, n * S->mE); B->prob = take(&f, 2 * S->mE); B->aw = take(&f, R);
    B->arow = (int32_t *)take(&f, R); B->mx = take(&f, R * S->d);
    B->my = take(&f, R * S->d); B->mgu = take(&f, 2 * R * S->inter); B->mhid = take(&f, R * S->inter);
    B->P.gbuf = NULL;
    B->P.grp = q8_group(S, 2) == 8 ? 8 : 0; /* set again by each prep (the codes its readers take) */
    B->P.gemm_from = S->seq1 ? GEMM_ROWS : MAX_N + 1;
    B->P.x1 = S->q8 == 2;
    B->P.bf = S->bf && S->seq1;
    if (gemm_bufs(S, R)) {
        B->P.gbuf = S->mrows ? f : m; /* the MoE region only with MoE */
        B->P.gstride = gemm_stride(S);
        B->P.gpad = S->n;
    }
}

/* the step of the last block's FFN when only some rows' logits are wanted (a prompt's last row):
 * those rows moved to the front of x (pk_run_step), as an n = nsel step. Why: no later block reads
 * the other rows, so their FFN was wasted (1B F16 16-token prompt: 15 of 16 rows of the last
 * block's FFN, 4.4 % of the prompt's products; llama.cpp skips them too) */
static void pk_sel_step(const step_t *S, step_t *T) {
    *T = *S;
    T->n = S->nsel;
    T->seq1 = S->seq1 && S->nsel > 1; /* one row: split evenly, as a decode step (hand) */
    for (int j = 0; j < S->nsel; j++) T->sel[j] = j;
}

static void pk_run_step(const step_t *S, float *scratch, int nt) {
    bufs_t B;
    carve(S, scratch, nt, &B);
    step_t T;
    const int cut = S->nsel < S->n && S->nl && !S->L[S->nl - 1].moe;
    if (cut && S->nsel) pk_sel_step(S, &T);
#pragma omp parallel num_threads(nt)
    {
        const int tid = pk_tid(), nth = pk_nth();
        int64_t r0, r1;
        const step_t *F = S; /* the rows the FFN and the head run on */
        for (int l = 0; l < S->nl; l++) {
            const int kv_only = !S->nsel && l == S->nl - 1;
            block_attn(S, &S->L[l], &B, tid, nth, kv_only);
            if (kv_only) break;
            if (cut && l == S->nl - 1) { /* every row's k and v are cached: keep the selected rows */
#pragma omp single
                for (int j = 0; j < S->nsel; j++)
                    if (S->sel[j] != j) {
                        memcpy(S->x + j * S->d, S->x + S->sel[j] * S->d, (size_t)S->d * 4);
                        memcpy(B.par + j * S->d, B.par + S->sel[j] * S->d, (size_t)S->d * 4); /* a parallel block's */
                    }
                F = &T;
            }
            if (S->L[l].moe) block_moe(F, &S->L[l], &B, tid, nth);
            else block_ffn(F, &S->L[l], &B, tid, nth);
        }
        if (S->nsel) { /* else no logits (None): no final norm, no head */
#pragma omp single
            { /* the selected rows (every row, or each prompt's last one), packed */
                for (int j = 0; j < F->nsel; j++)
                    pk_norm(F->b_final != NULL, F->x + F->sel[j] * F->d, F->g_final, F->b_final, F->eps_final,
                            B.h + j * F->d, F->d);
                const int g = q8_group_n(F, F->nsel, wants_codes(F, &F->lm, 1)); /* by the rows it has */
                B.P.grp = g;
                prep(&B.P, B.h, F->nsel * F->d, F->loom, g);
            }
            part(S->lm.A.m, tid, nth, &r0, &r1);
            mat_rows(&S->lm, &B.P, S->logits, S->lm.A.m, r0, r1, S->q8, S->nsel, NULL);
        }
    }
}

#endif /* POLY_DECODE_RUN_H */

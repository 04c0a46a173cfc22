/* One pre-norm block of the fused step: norm and prepared input, projections, attention, FFN. */
#ifndef POLY_DECODE_BLOCK_H
#define POLY_DECODE_BLOCK_H
#include "core/activations.h"
#include "decode/step.h"
#include "decode/rmsnorm.h"
#include "decode/recipe.h"
#include "decode/prep.h"
#include "decode/matrix.h"
#include "decode/kv.h"
#include "attention/decode_row.h"

static void norm_prep(const step_t *S, const float *x, const float *g, float eps, bufs_t *B, int want) {
    B->P.grp = q8_group(S, want);
    for (int i = 0; i < S->n; i++) pk_rmsnorm(x + i * S->d, g, eps, B->h + i * S->d, S->d);
    prep(&B->P, B->h, S->n * S->d, S->loom, B->P.grp);
}

/* one row of the norm (g, b, ln: pk_norm), or a copy of x when g is NULL (a block without pre-norms) */
static inline void norm_row(const float *x, const float *g, const float *b, int ln, float eps, float *out, int64_t d) {
    if (g) pk_norm(ln, x, g, b, eps, out, d);
    else memcpy(out, x, (size_t)d * 4);
}

/* norm_prep on every thread, each its own rows (a row's blocks depend on that row only), then a
 * barrier: for several rows the serial version kept the other threads waiting. b, ln: LayerNorm */
static void norm_prep_ln(const step_t *S, const float *x, const float *g, const float *b, int ln, float eps, bufs_t *B,
                         int tid, int nt, int want) {
    const int64_t d = S->d;
    if (d % 32) {
#pragma omp single
        {
            B->P.grp = q8_group(S, want);
            for (int i = 0; i < S->n; i++) norm_row(x + i * d, g, b, ln, eps, B->h + i * d, d);
            prep(&B->P, B->h, S->n * d, S->loom, B->P.grp);
        }
        return;
    }
#pragma omp single nowait
    { B->P.x = B->h; B->P.k = S->n * d; B->P.grp = q8_group(S, want); }
    int64_t i0, i1;
    part(S->n, tid, nt, &i0, &i1);
    for (int64_t i = i0; i < i1; i++) {
        norm_row(x + i * d, g, b, ln, eps, B->h + i * d, d);
        prep_blocks(&B->P, B->h, i * d / 32, (i + 1) * d / 32, S->loom, q8_group(S, want));
    }
#pragma omp barrier
}


/* residual streams x [n, d] += in [n, k] @ M.T: `in` prepared on one thread, then each thread
 * its own rows of M (each output element written by one thread, so no second barrier) */
/* red_fn() with the GIL (the master thread is the caller, whose thread state is saved) */
static void reduce_call(step_t *S) {
    if (S->red_err) return;
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *r = PyObject_CallNoArgs(S->red_fn);
    if (r == NULL) {
        S->red_err = 1;
        PyErr_Fetch(&S->et, &S->ev, &S->etb);
    }
    Py_XDECREF(r);
    PyGILState_Release(g);
}

/* the counter of product `slot` (< HAND_SLOTS) of block L over m rows, in h; NULL when the rows
 * are split evenly (not a prompt: a decode step's pieces and the barriers they add cost SmolLM2
 * Q4_1 11 %) */
static inline const hand_t *hand(const step_t *S, const bufs_t *B, const layer_t *L, int slot, int64_t m, hand_t *h) {
    if (!B->ctr || !S->seq1) return NULL;
    h->ctr = B->ctr + (L - S->L) * HAND_SLOTS + slot; h->m0 = 0; h->m1 = m;
    return h;
}

/* branch `ffn` (0: the attention's) of block L ends: its post-norm, residual multiplier, and a
 * parallel block's attention output held in B->par until the FFN's is added with it */
static void add_branch(const step_t *S, const layer_t *L, int ffn, bufs_t *B, float *out, int64_t r0, int64_t r1,
                       int tid, int nt) {
    const int64_t d = S->d, n = S->n;
    const float *pg = ffn ? L->g_mpost : L->g_apost, *pb = ffn ? L->b_mpost : L->b_apost;
    if (pg) { /* whole rows: every row's sums written (add_projection's barrier) */
        int64_t i0, i1;
        part(n, tid, nt, &i0, &i1);
        for (int64_t i = i0; i < i1; i++) pk_norm(L->ln, out + i * d, pg, pb, L->eps, out + i * d, d);
#pragma omp barrier
    }
    const float m = L->rmult;
    for (int64_t i = 0; i < n; i++) {
        float *x = S->x + i * d, *o = out + i * d, *p = B->par + i * d;
        if (L->par && !ffn) for (int64_t r = r0; r < r1; r++) p[r] = o[r];
        else if (L->par) for (int64_t r = r0; r < r1; r++) x[r] += (o[r] + p[r]) * m;
        else if (m != 1.0f) for (int64_t r = r0; r < r1; r++) x[r] += o[r] * m;
        else for (int64_t r = r0; r < r1; r++) x[r] += o[r];
    }
}

/* `prepped`: the threads already ran prep_blocks over `in` (before their last barrier) */
static void add_projection(const step_t *S, const layer_t *L, int ffn, const mat_t *M, bufs_t *B, const float *in,
                           int64_t k, int tid, int nt, int prepped, const hand_t *h) {
    const int64_t d = S->d, n = S->n;
    float *out = S->red ? S->red : B->tmp;
    const int grp = q8_group(S, wants_codes(S, M, 1));
    int64_t r0, r1;
    px_t V = B->P; /* this thread's own view of `in` (B->P.x is left alone) */
    V.x = in; V.k = n * k; V.grp = grp;
    if (!prepped && k % 32 == 0) { /* the 32-blocks split over the threads (groups of 8 with the codes per 256) */
        const int64_t g = grp_k256(grp) ? 8 : 1;
        int64_t b0, b1;
        part(n * k / 32 / g, tid, nt, &b0, &b1);
        b0 *= g; b1 *= g;
        prep_blocks(&B->P, in, b0, b1, S->loom, grp);
#pragma omp barrier
    } else if (!prepped) {
#pragma omp single
        prep(&B->P, in, n * k, S->loom, grp);
    }
    part(d, tid, nt, &r0, &r1);
    const int whole = (ffn ? L->g_mpost : L->g_apost) != NULL;
    if (mat_rows(M, &V, out, d, r0, r1, S->q8, n, h) && !S->red && !whole) {
#pragma omp barrier /* rows handed out: every row written before this thread adds its own */
    }
    if (whole && !S->red) {
#pragma omp barrier /* the post-norm reads whole rows */
    }
    if (S->red) { /* all partial rows written, summed over the ranks on the calling thread */
#pragma omp barrier
#pragma omp master
        reduce_call((step_t *)S);
#pragma omp barrier
    }
    add_branch(S, L, ffn, B, out, r0, r1, tid, nt);
#pragma omp barrier
}

/* floats of one head's attention scores (positions 0 .. maxpos, 64-byte multiples) */
static inline int64_t sc_stride(const step_t *S) {
    return (S->maxpos + 1 + 15) & ~(int64_t)15;
}

static void block_attn(const step_t *S, const layer_t *L, bufs_t *B, int tid, int nt, int kv_only) {
    const int64_t n = S->n, q = (int64_t)L->heads * L->hd, w = q + 2 * (int64_t)L->kvh * L->hd;
    int64_t r0, r1;
    hand_t h;
    norm_prep_ln(S, S->x, L->g_attn, L->b_attn, L->ln, L->eps, B, tid, nt, wants_codes(S, L->qkv, L->nqkv));
    for (int i = 0, off = 0; i < L->nqkv; off += (int)L->qkv[i].A.m, i++) {
        part(L->qkv[i].A.m, tid, nt, &r0, &r1);
        mat_rows(&L->qkv[i], &B->P, B->qkv + off, w, r0, r1, S->q8, n, hand(S, B, L, i, L->qkv[i].A.m, &h));
    }
#pragma omp barrier
    /* independent rows in equal shares: each thread RoPEs, appends and attends its own (no serial
     * section); rows of one sequence (a prompt, or prompts batched) attend each other's keys */
    const int own = S->indep && n >= nt && n % nt == 0;
    if (own) {
        part(n, tid, nt, &r0, &r1);
        for (int64_t i = r0; i < r1; i++) rope_append(S, L, B->qkv + i * w, S->pos[i], (int)i);
        r0 *= L->heads; r1 *= L->heads;
    } else {
#pragma omp single
        for (int i = 0; i < n; i++) rope_append(S, L, B->qkv + i * w, S->pos[i], i);
        part(n * L->heads, tid, nt, &r0, &r1);
    }
    if (kv_only) return; /* no later block, no logits: the rows' k and v were all this block owed */
    /* a head's output is whole blocks: prep them here (not when codes take groups of 256) */
    const int want_o = wants_codes(S, &L->o, 1), inline_prep = L->hd % 32 == 0 && q8_group(S, want_o) < 3;
    const int64_t sst = sc_stride(S);
    for (int64_t e = r0; e < r1;) { /* this thread's heads of row i: h0 .. h1 */
        const int i = (int)(e / L->heads), h0 = (int)(e % L->heads);
        const int h1 = r1 - e < L->heads - h0 ? h0 + (int)(r1 - e) : L->heads;
        attend_heads(S, L, B->qkv + i * w, B->att + i * q, B->sc + tid * sst * S->maxh, sst, S->pos[i], i, h0, h1);
        if (inline_prep) prep_blocks(&B->P, B->att, (i * q + h0 * L->hd) / 32, (i * q + h1 * L->hd) / 32, S->loom,
                                     q8_group(S, want_o));
        e += h1 - h0;
    }
#pragma omp barrier
    add_projection(S, L, 0, &L->o, B, B->att, q, tid, nt, inline_prep, hand(S, B, L, 3, S->d, &h));
}

static void block_ffn(const step_t *S, const layer_t *L, bufs_t *B, int tid, int nt) {
    const int64_t n = S->n, I = L->down.A.k;
    float *gu = B->gu;
    int64_t r0, r1;
    const int shared = L->par == 2; /* the FFN reads the attention norm's output (recomputed: x is unchanged) */
    norm_prep_ln(S, S->x, shared ? L->g_attn : L->g_mlp, shared ? L->b_attn : L->b_mlp, L->ln, L->eps, B, tid, nt,
                 wants_codes(S, L->gu, L->ngu));
    part(I, tid, nt, &r0, &r1);
    hand_t h, h2;
    int handed; /* gate|up rows handed out: all of them written before the activation's own rows */
    if (L->act >= 2) { /* a plain MLP: up's I rows */
        handed = mat_rows(&L->gu[0], &B->P, gu, 2 * I, r0, r1, S->q8, n, hand(S, B, L, 5, I, &h));
    } else if (L->ngu == 1) {
        handed = mat_rows(&L->gu[0], &B->P, gu, 2 * I, r0, r1, S->q8, n, hand(S, B, L, 5, 2 * I, &h));
        if (!handed) mat_rows(&L->gu[0], &B->P, gu, 2 * I, I + r0, I + r1, S->q8, n, NULL);
    } else {
        handed = mat_rows(&L->gu[0], &B->P, gu, 2 * I, r0, r1, S->q8, n, hand(S, B, L, 5, I, &h));
        handed |= mat_rows(&L->gu[1], &B->P, gu + I, 2 * I, r0, r1, S->q8, n, hand(S, B, L, 6, I, &h2));
    }
    if (handed) {
#pragma omp barrier
    }
    for (int64_t i = 0; i < n; i++) {
        const float *g = gu + i * 2 * I + r0;
        if (L->act == 0) silu_mul(g, g + I, B->hid + i * I + r0, r1 - r0);
        else act_rows(L->act, g, g + I, B->hid + i * I + r0, r1 - r0);
    }
#pragma omp barrier /* no thread still reads the prepared h (its block sums are overwritten next) */
    add_projection(S, L, 1, &L->down, B, B->hid, I, tid, nt, 0, hand(S, B, L, 4, S->d, &h));
}

#endif /* POLY_DECODE_BLOCK_H */

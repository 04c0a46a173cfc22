/* The MoE FFN of the fused decode step (poly/nn/moe.py is the reference): float32 router (and
 * its bias), softmax or sigmoid gating or softmax over the chosen k logits (GPT-OSS), top-k by a
 * stable descending order (of tied experts the lower id wins), optional renormalisation over the
 * k, then each used expert once over the rows that chose it (biases in its mats; SiLU or
 * GPT-OSS's clamped SwiGLU), plus an optional shared expert with its sigmoid gate.
 *
 * Phases (threads split each matrix's rows; barriers between): router rows; routing and the
 * gathered rows (one thread); every used expert's gate/up rows and SiLU; the hidden rows prepared
 * (one thread); every used expert's down rows, summed into the residual streams by the thread
 * that owns those columns. Only the chosen experts' weights are read. */
#ifndef POLY_DECODE_MOE_H
#define POLY_DECODE_MOE_H
#include "core/activations.h"
#include "decode/step.h"
#include "decode/prep.h"
#include "decode/matrix.h"
#include "decode/block.h"

/* scores of one row's E router logits (softmax like numpy's: max subtracted, then normalised) */
static void gate_scores(const moe_t *M, const float *lg, float *p) {
    if (M->gating == MOE_SOFTMAX_TOPK) { /* the logits: their softmax comes after the choice */
        memcpy(p, lg, (size_t)M->E * 4);
        return;
    }
    if (M->sig) {
        for (int e = 0; e < M->E; e++) p[e] = 1.0f / (1.0f + expf(-lg[e]));
        return;
    }
    float mx = -INFINITY, s = 0.0f;
    for (int e = 0; e < M->E; e++) mx = fmaxf(mx, lg[e]);
    for (int e = 0; e < M->E; e++) { p[e] = expf(lg[e] - mx); s += p[e]; }
    for (int e = 0; e < M->E; e++) p[e] /= s;
}

/* row i's top-k -> ids[k], w[k]: repeated max scans, strict > so the lower id wins a tie */
static void top_k(const moe_t *M, float *p, int32_t *ids, float *w) {
    float s = 0.0f;
    for (int j = 0; j < M->k; j++) {
        int best = -1;
        for (int e = 0; e < M->E; e++)
            if (p[e] == p[e] && (best < 0 || p[e] > p[best])) best = e; /* NaN never wins */
        if (best < 0) best = j; /* all NaN: any expert; the output is NaN anyway */
        ids[j] = best; w[j] = p[best]; s += w[j];
        p[best] = NAN; /* taken */
    }
    if (M->gating == MOE_SOFTMAX_TOPK) { /* numpy's softmax over the k: max subtracted */
        float mx = -INFINITY, t = 0.0f;
        for (int j = 0; j < M->k; j++) mx = fmaxf(mx, w[j]);
        for (int j = 0; j < M->k; j++) { w[j] = expf(w[j] - mx); t += w[j]; }
        for (int j = 0; j < M->k; j++) w[j] /= t;
    } else if (M->norm)
        for (int j = 0; j < M->k; j++) w[j] /= s;
}

/* GPT-OSS's expert activation, on 8 lanes (core/activations.h clamped_swiglu_rows) */
static inline void clamped_swiglu(const moe_t *M, const float *g, const float *u, float *out, int64_t n) {
    clamped_swiglu_rows(g, u, out, n, M->alpha, M->limit);
}

static float dot_f32(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* one thread: route every row, gather the rows of each used expert (ascending id, rows in
 * order), add the shared expert's slot, prepare the gathered rows in B->P */
static void moe_route(const step_t *S, const moe_t *M, bufs_t *B) {
    const int n = S->n, k = M->k;
    const int64_t d = S->d;
    int32_t ids[STEP_MAX * 64], *cnt = (int32_t *)B->prob + M->E; /* k <= 64 checked at parse */
    float w[STEP_MAX * 64];
    for (int e = 0; e < M->E; e++) cnt[e] = 0;
    for (int i = 0; i < n; i++) {
        gate_scores(M, B->rl + (int64_t)i * M->E, B->prob);
        top_k(M, B->prob, ids + i * k, w + i * k);
        for (int j = 0; j < k; j++) cnt[ids[i * k + j]]++;
        if (M->chosen) memcpy(M->chosen + i * k, ids + i * k, (size_t)k * 4);
    }
    int64_t row = 0, goff = 0, hoff = 0;
    B->nslots = 0;
    for (int e = 0; e < M->nex; e++) {
        const int shared = e == M->E;
        if (!shared && !cnt[e]) continue;
        slot_t *s = &B->slots[B->nslots++];
        s->e = e; s->row0 = row; s->goff = goff; s->hoff = hoff;
        for (int i = 0; i < n; i++)
            for (int j = 0; j < (shared ? 1 : k); j++) {
                if (!shared && ids[i * k + j] != e) continue;
                B->arow[row] = i;
                B->aw[row] = shared ? 1.0f / (1.0f + expf(-dot_f32(M->sgate, B->h + i * d, d))) : w[i * k + j];
                memcpy(B->mx + row * d, B->h + i * d, (size_t)d * 4);
                row++;
            }
        s->cnt = row - s->row0;
        goff += s->cnt * 2 * M->ex[e].I; hoff += s->cnt * M->ex[e].I;
    }
    /* the gathered rows' codes: pairs and per-256 (any expert's kind); never a prompt's panel
     * codes (n 1: the experts' rows are gathered, not the step's n) */
    B->P.grp = q8_group_n(S, 1, S->q8 != 0 ? 3 : 0);
    prep(&B->P, B->mx, row * d, S->loom, B->P.grp);
}

/* gate|up rows [r0, r1) of expert X for the slot's rows, then SiLU(gate) * up into hid */
static void expert_gate_up(const step_t *S, const moe_t *M, const expert_t *X, const px_t *V, float *gu,
                           float *hid, int64_t cnt, int64_t r0, int64_t r1) {
    const int64_t I = X->I;
    mat_rows(&X->gu[0], V, gu, 2 * I, r0, r1, S->q8, cnt, NULL);
    if (X->ngu == 1) mat_rows(&X->gu[0], V, gu, 2 * I, I + r0, I + r1, S->q8, cnt, NULL);
    else mat_rows(&X->gu[1], V, gu + I, 2 * I, r0, r1, S->q8, cnt, NULL);
    for (int64_t i = 0; i < cnt; i++) {
        const float *g = gu + i * 2 * I + r0, *u = gu + i * 2 * I + I + r0;
        if (M->clamp && X != &M->ex[M->E]) clamped_swiglu(M, g, u, hid + i * I + r0, r1 - r0);
        else silu_mul(g, u, hid + i * I + r0, r1 - r0);
    }
}

static void block_moe(const step_t *S, const layer_t *L, bufs_t *B, int tid, int nt) {
    const moe_t *M = L->moe;
    const int64_t n = S->n, d = S->d;
    int64_t r0, r1;
#pragma omp single
    norm_prep(S, S->x, L->g_mlp, L->eps, B, wants_codes(S, &M->router, 1));
    part(M->E, tid, nt, &r0, &r1);
    mat_rows(&M->router, &B->P, B->rl, M->E, r0, r1, S->q8, n, NULL);
#pragma omp barrier
#pragma omp single
    moe_route(S, M, B);
    for (int u = 0; u < B->nslots; u++) {
        const slot_t *s = &B->slots[u];
        const expert_t *X = &M->ex[s->e];
        const px_t V = px_view(&B->P, B->mx + s->row0 * d, s->row0 * d);
        part(X->I, tid, nt, &r0, &r1);
        expert_gate_up(S, M, X, &V, B->mgu + s->goff, B->mhid + s->hoff, s->cnt, r0, r1);
    }
#pragma omp barrier
#pragma omp single
    for (int u = 0; u < B->nslots; u++) {
        const slot_t *s = &B->slots[u];
        px_t V = px_view(&B->P, B->mhid + s->hoff, s->hoff);
        prep(&V, B->mhid + s->hoff, s->cnt * M->ex[s->e].I, S->loom, B->P.grp);
    }
    part(d, tid, nt, &r0, &r1);
    for (int u = 0; u < B->nslots; u++) {
        const slot_t *s = &B->slots[u];
        const px_t V = px_view(&B->P, B->mhid + s->hoff, s->hoff);
        mat_rows(&M->ex[s->e].down, &V, B->my + s->row0 * d, d, r0, r1, S->q8, s->cnt, NULL);
    }
    /* like the reference: out = sum over experts (ascending id) of w * y, then x += out */
    for (int64_t i = 0; i < n; i++)
        for (int64_t r = r0; r < r1; r++) B->tmp[i * d + r] = 0.0f;
    for (int u = 0; u < B->nslots; u++) {
        const slot_t *s = &B->slots[u];
        for (int64_t j = s->row0; j < s->row0 + s->cnt; j++) {
            float *acc = B->tmp + (int64_t)B->arow[j] * d;
            const float *y = B->my + j * d, wj = B->aw[j];
            for (int64_t r = r0; r < r1; r++) acc[r] += wj * y[r];
        }
    }
    for (int64_t i = 0; i < n; i++) /* times the residual multiplier (GraniteMoE; 1 otherwise) */
        for (int64_t r = r0; r < r1; r++) S->x[i * d + r] += B->tmp[i * d + r] * L->rmult;
#pragma omp barrier
}

#endif /* POLY_DECODE_MOE_H */

/* poly.runtime.native.ckernels.decode: one whole decode step (every pre-norm block, final norm, LM head) for
 * one new token, in one OpenMP parallel region.
 *
 * Why: per token the Python path makes ~15 kernel calls per block (each a parallel region and a
 * round trip through numpy), which costs more than the 4-bit matrix reads themselves. Here the
 * threads stay inside one region; row-parallel matrix-vector phases are separated by barriers
 * and the small serial work (norms, RoPE, the KV append) runs on one thread.
 *
 * decode(layers, caches, head, x, logits, pos, q8[, threads[, paged]]) for n <= 16 rows (independent sequences, each
 * one new token: batched decode reads every weight row once for all of them)
 *   layers: tuple of per-block tuples
 *     (heads, kv_heads, head_dim, eps, attn_gamma, q_gamma|None, k_gamma|None, qkv_mats,
 *      cos, sin, o_mat, mlp_gamma, gate_up_mats, down_mat)
 *     a mat is (kind, w, aux|None, m, k, bias|None); qkv_mats is (wqkv,) or (wq, wk, wv);
 *     gate_up_mats is (w_gate_up,) with 2I rows or (w_gate, w_up).
 *   caches: float32 [T, kv_heads, head_dim] arrays, (k, v) per block per row, block-major:
 *     index 2 * (block * n + row) (+ 1 for v)
 *   head: (final_gamma, eps, lm_mat)
 *   x: float32 [n, d] embeddings of the tokens (overwritten: the residual streams)
 *   logits: float32 [n, V] output, or [1, V]: the last row's only (a prompt's rows sharing one
 *     cache, pos start..start+n-1: each row writes its k/v before any row attends), or
 *     (logits [k, V], rows): the logits of those k ascending rows only (prompts' last rows), or
 *     None: no logits, the last block only caches its k and v (a long prompt's calls but its last);
 *   pos: tuple of n positions written (each < its T);
 *   q8: int8 activations; threads (optional): OpenMP threads for this call, 0 = set_threads().
 *   reduce (optional, 10th, tensor parallel): (red, fn), red float32 [n, d]: the O and down
 *     projections write their partial sums to red, fn() is called (it must sum red over the
 *     ranks in place), then red is added to the residual streams. A row-parallel bias belongs
 *     to one rank only.
 *   paged (optional, None = off): (page_size, tables), tables a tuple of n int32 arrays. Then each
 *     row's caches are the block's page pools [pages * page_size, kv_heads, head_dim] and position
 *     t of row i lives at slot tables[i][t / page_size] * page_size + t % page_size.
 * Every buffer's size is checked against the dims before anything runs (ValueError).
 */
#include "pk_decode.h"

/* ---- compute ------------------------------------------------------------------------------ */

#include "pk_ranges.h"
#include "pk_r16.h"
#include "pk_r8k.h"

static void pk_rmsnorm(const float *x, const float *g, float eps, float *out, int64_t n) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float inv = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * g[i];
}

#include "pk_prep.h"


#include "pk_mat.h"

/* the cache slot of position t of row i (its page table, or t itself when contiguous) */
static inline int64_t slot(const step_t *S, int i, int64_t t) {
    return S->tab[i] ? (int64_t)S->tab[i][t / S->ps] * S->ps + t % S->ps : t;
}

/* n floats of src to elements at.. of a cache: copied, or rounded to float16 (kv16) */
static void kv_store(void *cache, int64_t at, const float *src, int64_t n, int kv16) {
    if (!kv16) {
        memcpy((float *)cache + at, src, (size_t)n * 4);
        return;
    }
    uint16_t *dst = (uint16_t *)cache + at;
    int64_t j = 0;
#if PK_SIMD
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(dst + j), _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; j < n; j++) dst[j] = f2h(src[j]);
}

/* row i: q/k norm, RoPE (pairs j, j + hd/2) at pos, then k/v appended to its caches */
static void rope_append(const step_t *S, const layer_t *L, float *qkv, int64_t pos, int i) {
    const int64_t hd = L->hd, half = hd / 2, q = (int64_t)L->heads * hd, kvd = (int64_t)L->kvh * hd;
    const float *c = L->cos + pos * half, *s = L->sin + pos * half;
    for (int64_t h = 0; h < L->heads + L->kvh; h++) {
        float *v = qkv + h * hd;
        const float *g = h < L->heads ? L->g_q : L->g_k;
        if (g) pk_rmsnorm(v, g, L->eps, v, hd);
        for (int64_t j = 0; j < half; j++) {
            const float x1 = v[j], x2 = v[j + half];
            v[j] = x1 * c[j] - x2 * s[j];
            v[j + half] = x2 * c[j] + x1 * s[j];
        }
    }
    const int64_t at = slot(S, i, pos);
    kv_store(L->kc[i], at * kvd, qkv + q, kvd, L->kv16);
    kv_store(L->vc[i], at * kvd, qkv + q + kvd, kvd, L->kv16);
}

#include "pk_attn.h"


static void norm_prep(const step_t *S, const float *x, const float *g, float eps, bufs_t *B, int want) {
    B->P.grp = q8_group(S, want);
    for (int i = 0; i < S->n; i++) pk_rmsnorm(x + i * S->d, g, eps, B->h + i * S->d, S->d);
    prep(&B->P, B->h, S->n * S->d, S->loom, B->P.grp);
}

/* norm_prep on every thread, each its own rows (a row's blocks depend on that row only), then a
 * barrier: for several rows the serial version kept the other threads waiting */
static void norm_prep_par(const step_t *S, const float *x, const float *g, float eps, bufs_t *B, int tid, int nt,
                          int want) {
    const int64_t d = S->d;
    if (d % 32) {
#pragma omp single
        norm_prep(S, x, g, eps, B, want);
        return;
    }
#pragma omp single nowait
    { B->P.x = B->h; B->P.k = S->n * d; B->P.grp = q8_group(S, want); }
    int64_t i0, i1;
    part(S->n, tid, nt, &i0, &i1);
    for (int64_t i = i0; i < i1; i++) {
        pk_rmsnorm(x + i * d, g, eps, B->h + i * d, d);
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

/* `prepped`: the threads already ran prep_blocks over `in` (before their last barrier) */
static void add_projection(const step_t *S, const mat_t *M, bufs_t *B, const float *in, int64_t k,
                           int tid, int nt, int prepped, const hand_t *h) {
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
    if (mat_rows(M, &V, out, d, r0, r1, S->q8, n, h) && !S->red) {
#pragma omp barrier /* rows handed out: every row written before this thread adds its own */
    }
    if (S->red) { /* all partial rows written, summed over the ranks on the calling thread */
#pragma omp barrier
#pragma omp master
        reduce_call((step_t *)S);
#pragma omp barrier
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t r = r0; r < r1; r++) S->x[i * d + r] += out[i * d + r];
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
    norm_prep_par(S, S->x, L->g_attn, L->eps, B, tid, nt, wants_codes(S, L->qkv, L->nqkv));
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
    add_projection(S, &L->o, B, B->att, q, tid, nt, inline_prep, hand(S, B, L, 3, S->d, &h));
}

static void block_ffn(const step_t *S, const layer_t *L, bufs_t *B, int tid, int nt) {
    const int64_t n = S->n, I = L->down.A.k;
    float *gu = B->gu;
    int64_t r0, r1;
    norm_prep_par(S, S->x, L->g_mlp, L->eps, B, tid, nt, wants_codes(S, L->gu, L->ngu));
    part(I, tid, nt, &r0, &r1);
    hand_t h, h2;
    int handed; /* gate|up rows handed out: all of them written before silu_mul's own rows */
    if (L->ngu == 1) {
        handed = mat_rows(&L->gu[0], &B->P, gu, 2 * I, r0, r1, S->q8, n, hand(S, B, L, 5, 2 * I, &h));
        if (!handed) mat_rows(&L->gu[0], &B->P, gu, 2 * I, I + r0, I + r1, S->q8, n, NULL);
    } else {
        handed = mat_rows(&L->gu[0], &B->P, gu, 2 * I, r0, r1, S->q8, n, hand(S, B, L, 5, I, &h));
        handed |= mat_rows(&L->gu[1], &B->P, gu + I, 2 * I, r0, r1, S->q8, n, hand(S, B, L, 6, I, &h2));
    }
    if (handed) {
#pragma omp barrier
    }
    for (int64_t i = 0; i < n; i++)
        silu_mul(gu + i * 2 * I + r0, gu + i * 2 * I + I + r0, B->hid + i * I + r0, r1 - r0);
#pragma omp barrier /* no thread still reads the prepared h (its block sums are overwritten next) */
    add_projection(S, &L->down, B, B->hid, I, tid, nt, 0, hand(S, B, L, 4, S->d, &h));
}

#include "pk_moe.h"

/* floats of one thread's gemm buffers: GR dequantized rows of the widest input, a packed chunk */
static int64_t gemm_stride(const step_t *S) {
    int64_t k = S->d > S->maxq ? S->d : S->maxq;
    if (S->inter > k) k = S->inter;
    return gemm_buf_floats(k, S->n);
}

/* whether a step of R rows (prepared inputs) needs the per-thread panel buffers */
static inline int gemm_bufs(const step_t *S, int64_t R) {
    return R >= GEMM_ROWS || ((S->q8 == 2 || (S->bf && S->seq1)) && R >= K8I_MIN); /* pk_k8i.h, pk_bf16.h */
}

/* scratch floats for step S with nt threads (see carve); the prepared-input pools cover the
 * MoE's gathered rows too */
static size_t pk_scratch_floats(const step_t *S, int nt) {
    const int64_t n = S->n, kmax = S->maxw > S->inter ? S->maxw : S->inter;
    const int64_t R = S->mrows > n ? S->mrows : n, kp = kmax > S->d ? kmax : S->d;
    const int64_t moe = S->mrows ? n * S->mE + 2 * S->mE + 2 * R + R * (2 * S->d + 3 * S->inter)
                                       + (S->mE + 1) * (int64_t)(sizeof(slot_t) / 4 + 1) + 16 : 0;
    return (size_t)(n * (2 * S->d + S->maxw + S->maxq + 3 * S->inter) + 3 * R * kp + sc_stride(S) * S->maxh * nt + moe + 64 + 25 * 16 /* take()'s padding */
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
    B->tmp = take(&f, n * S->d); B->gu = take(&f, 2 * n * S->inter); B->hid = take(&f, n * S->inter);
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
                    if (S->sel[j] != j) memcpy(S->x + j * S->d, S->x + S->sel[j] * S->d, (size_t)S->d * 4);
                F = &T;
            }
            if (S->L[l].moe) block_moe(F, &S->L[l], &B, tid, nth);
            else block_ffn(F, &S->L[l], &B, tid, nth);
        }
        if (S->nsel) { /* else no logits (None): no final norm, no head */
#pragma omp single
            { /* the selected rows (every row, or each prompt's last one), packed */
                for (int j = 0; j < F->nsel; j++)
                    pk_rmsnorm(F->x + F->sel[j] * F->d, F->g_final, F->eps_final, B.h + j * F->d, F->d);
                const int g = q8_group_n(F, F->nsel, wants_codes(F, &F->lm, 1)); /* by the rows it has */
                B.P.grp = g;
                prep(&B.P, B.h, F->nsel * F->d, F->loom, g);
            }
            part(S->lm.A.m, tid, nth, &r0, &r1);
            mat_rows(&S->lm, &B.P, S->logits, S->lm.A.m, r0, r1, S->q8, S->nsel, NULL);
        }
    }
}

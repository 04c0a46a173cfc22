/* The fused step's layers, selection and the Python entry decode() (decode/step.h has the call). */
#ifndef POLY_DECODE_ARGS_H
#define POLY_DECODE_ARGS_H
#include "core/common.h"
#include "core/step_buffer.h"
#include "formats/kinds.h"
#include "core/matrix_check.h"
#include "formats/kquant_panels.h"
#include "formats/vdpbf16_rows.h"
#include "formats/interleave16.h"
#include "formats/interleave16_range.h"
#include "decode/step.h"
#include "decode/kv_q8.h"
#include "decode/prep.h"
#include "decode/run.h"
#include "decode/args_buffers.h"
#include "decode/moe_args.h"
#include "decode/recipe_args.h"

static int parse_layer(holds_t *H, PyObject *t, PyObject *caches, int l, step_t *S, layer_t *L,
                       int64_t d, int64_t maxpos, int64_t *inter) {
    const int n = S->n;
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 14 || PyTuple_GET_SIZE(t) > 16) {
        PyErr_SetString(PyExc_ValueError, "a layer must be a tuple of 14 to 16 items");
        return -1;
    }
    L->heads = (int)PyLong_AsLong(PyTuple_GET_ITEM(t, 0));
    L->kvh = (int)PyLong_AsLong(PyTuple_GET_ITEM(t, 1));
    L->hd = (int)PyLong_AsLong(PyTuple_GET_ITEM(t, 2));
    L->eps = (float)PyFloat_AsDouble(PyTuple_GET_ITEM(t, 3));
    if (PyErr_Occurred()) return -1;
    const int64_t H_ = L->heads, kv = L->kvh, hd = L->hd;
    if (H_ < 1 || kv < 1 || hd < 2 || hd % 2 || H_ % kv) {
        PyErr_SetString(PyExc_ValueError, "bad attention dims");
        return -1;
    }
    const int64_t q = H_ * hd, kvd = kv * hd;
    recipe_defaults(L);
    if (PyTuple_GET_SIZE(t) == 16 && parse_recipe(H, PyTuple_GET_ITEM(t, 15), L, d)) return -1;
    const int64_t half = L->rot / 2;
    if (recipe_vec(H, PyTuple_GET_ITEM(t, 4), d, "attn gamma", &L->g_attn)) return -1;
    if (!L->g_attn && !L->no_pre) { PyErr_SetString(PyExc_ValueError, "attn gamma: None without no_pre"); return -1; }
    PyObject *oq = PyTuple_GET_ITEM(t, 5), *ok = PyTuple_GET_ITEM(t, 6);
    const int whole = L->qk_all || L->qk_heads; /* one value per q (k) dim, not one head's */
    if (oq != Py_None && !(L->g_q = hold(H, oq, 0, (whole ? q : hd) * 4, "q gamma"))) return -1;
    if (ok != Py_None && !(L->g_k = hold(H, ok, 0, (whole ? kvd : hd) * 4, "k gamma"))) return -1;
    PyObject *mq = PyTuple_GET_ITEM(t, 7);
    if (!PyTuple_Check(mq) || (PyTuple_GET_SIZE(mq) != 1 && PyTuple_GET_SIZE(mq) != 3)) {
        PyErr_SetString(PyExc_ValueError, "qkv must be 1 or 3 matrices");
        return -1;
    }
    L->nqkv = (int)PyTuple_GET_SIZE(mq);
    const int64_t rows3[3] = {q, kvd, kvd};
    for (int i = 0; i < L->nqkv; i++)
        if (parse_mat(H, PyTuple_GET_ITEM(mq, i), &L->qkv[i], L->nqkv == 1 ? q + 2 * kvd : rows3[i], d)) return -1;
    const PyObject *oc = PyTuple_GET_ITEM(t, 8);
    Py_buffer *tb;
    if (half) { /* no tables for a layer without RoPE (rot 0) */
        if (!(L->cos = hold(H, (PyObject *)oc, 0, -1, "cos"))) return -1;
        tb = &H->bufs[H->n - 1];
        const int64_t cap = tb->len / (half * 4);
        if (tb->len % (half * 4) || maxpos >= cap) { PyErr_SetString(PyExc_ValueError, "rope table too short"); return -1; }
        if (!(L->sin = hold(H, PyTuple_GET_ITEM(t, 9), 0, cap * half * 4, "sin"))) return -1;
    }
    for (int i = 0; i < n; i++) {
        PyObject *kc = cache_item(PyTuple_GET_ITEM(caches, 2 * ((Py_ssize_t)l * n + i)), &L->kbase[i]);
        if (!kc) return -1;
        PyObject *vc = PyTuple_GET_ITEM(caches, 2 * ((Py_ssize_t)l * n + i) + 1);
        int es = 0;
        if (!(L->kc[i] = hold_kv(H, kc, &es, "k cache"))) return -1;
        if (i && es != (L->kv8 ? 1 : L->kv16 ? 2 : 4)) { PyErr_SetString(PyExc_ValueError, "a layer's caches differ in dtype"); return -1; }
        if (es == 1 && hd % KV8_BLOCK) { PyErr_SetString(PyExc_ValueError, "q8_0 caches need head_dim % 32 == 0"); return -1; }
        L->kv16 = es == 2;
        L->kv8 = es == 1;
        tb = &H->bufs[H->n - 1];
        const int64_t rbytes = kv_row_bytes(kvd, es), T = tb->len / rbytes; /* decode/kv_q8.h */
        const int64_t b = L->kbase[i], lo = L->window && S->pos[i] - L->window + 1 > 0 ? S->pos[i] - L->window + 1 : 0;
        if (tb->len % rbytes || (!S->tab[i] && (S->pos[i] - b >= T || lo < b)) || (S->tab[i] && (T % S->ps || b))) {
            PyErr_SetString(PyExc_ValueError, "KV cache full or mis-sized");
            return -1;
        }
        if (S->tab[i] && check_table(S, i, T / S->ps)) return -1;
        int ev = 0;
        if (!(L->vc[i] = hold_kv(H, vc, &ev, "v cache"))) return -1;
        if (ev != es || want_len(&H->bufs[H->n - 1], T * rbytes, "v cache")) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "k and v caches differ in dtype");
            return -1;
        }
    }
    if (parse_mat(H, PyTuple_GET_ITEM(t, 10), &L->o, d, q)) return -1;
    if (recipe_vec(H, PyTuple_GET_ITEM(t, 11), d, "mlp gamma", &L->g_mlp)) return -1;
    if (!L->g_mlp && !L->no_pre && L->par != 2) { PyErr_SetString(PyExc_ValueError, "mlp gamma: None"); return -1; }
    PyObject *om = PyTuple_GET_SIZE(t) >= 15 ? PyTuple_GET_ITEM(t, 14) : Py_None;
    if (om != Py_None) return parse_moe(H, om, S, L, d, inter);
    if (L->act >= 2) { /* a plain MLP: (w_up,) of I rows, down */
        PyObject *mg = PyTuple_GET_ITEM(t, 12), *md = PyTuple_GET_ITEM(t, 13);
        const int64_t I = PyTuple_Check(md) && PyTuple_GET_SIZE(md) >= 6 ? PyLong_AsLongLong(PyTuple_GET_ITEM(md, 4)) : 0;
        if (I < 1 || as_tuple(mg, 1, "up")) { if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad MLP"); return -1; }
        L->ngu = 1;
        if (parse_mat(H, PyTuple_GET_ITEM(mg, 0), &L->gu[0], I, d) || parse_mat(H, md, &L->down, d, I)) return -1;
        if (I > *inter) *inter = I;
        return 0;
    }
    return parse_ffn(H, PyTuple_GET_ITEM(t, 12), PyTuple_GET_ITEM(t, 13), &L->ngu, L->gu, &L->down, d, inter);
}

/* rows: a tuple of 1..n ascending row indices -> S->nsel, S->sel */
static int parse_sel(PyObject *o, step_t *S) {
    const Py_ssize_t k = PyTuple_Check(o) ? PyTuple_GET_SIZE(o) : 0;
    if (k < 1 || k > S->n) {
        PyErr_Format(PyExc_ValueError, "logits rows must be a tuple of 1..%d row indices", S->n);
        return -1;
    }
    for (Py_ssize_t j = 0; j < k; j++) {
        const long r = PyLong_AsLong(PyTuple_GET_ITEM(o, j));
        if (r == -1 && PyErr_Occurred()) return -1;
        if (r < 0 || r >= S->n || (j && r <= S->sel[j - 1])) {
            PyErr_SetString(PyExc_ValueError, "logits rows must ascend within 0..n-1");
            return -1;
        }
        S->sel[j] = (int32_t)r;
    }
    S->nsel = (int)k;
    return 0;
}

/* ---- Python entry ------------------------------------------------------------------------- */

static int parse_all(holds_t *H, PyObject *const *args, step_t *S) {
    PyObject *layers = args[0], *caches = args[1], *head = args[2];
    if (!PyTuple_Check(layers) || !PyTuple_Check(caches) || !PyTuple_Check(head) ||
        (PyTuple_GET_SIZE(head) != 4 && as_tuple(head, 3, "head"))) {
        PyErr_SetString(PyExc_ValueError, "decode(layers, caches, head, x, logits, pos, q8)");
        return -1;
    }
    S->nl = (int)PyTuple_GET_SIZE(layers);
    if (S->nl > MAX_LAYERS || PyTuple_GET_SIZE(caches) != 2 * (Py_ssize_t)S->nl * S->n) {
        PyErr_SetString(PyExc_ValueError, "need two caches per layer per row");
        return -1;
    }
    if (!(S->x = (float *)hold(H, args[3], 1, -1, "x"))) return -1;
    Py_buffer *bx = &H->bufs[H->n - 1];
    S->d = bx->len / (4 * S->n);
    if (S->d < 1 || bx->len != S->d * 4 * S->n) { PyErr_SetString(PyExc_ValueError, "x must be float32 [n, d]"); return -1; }
    for (int l = 0; l < S->nl; l++) {
        layer_t *L = &S->L[l];
        if (parse_layer(H, PyTuple_GET_ITEM(layers, l), caches, l, S, L, S->d, S->maxpos, &S->inter)) return -1;
        const int64_t q = (int64_t)L->heads * L->hd, w = q + 2 * (int64_t)L->kvh * L->hd;
        if (q > S->maxq) S->maxq = q;
        if (L->heads > S->maxh) S->maxh = L->heads;
        if (w > S->maxw) S->maxw = w;
        for (int i = 0; i < L->nqkv; i++) S->loom |= KINDS[L->qkv[i].kind]->flat; /* x in Loom order too */
        S->loom |= KINDS[L->o.kind]->flat || KINDS[L->down.kind]->flat;
        for (int i = 0; i < L->ngu; i++) S->loom |= KINDS[L->gu[i].kind]->flat;
        if (L->moe) S->loom |= moe_loom(L->moe);
    }
    if (!(S->g_final = hold(H, PyTuple_GET_ITEM(head, 0), 0, S->d * 4, "final gamma"))) return -1;
    if (PyTuple_GET_SIZE(head) == 4 && recipe_vec(H, PyTuple_GET_ITEM(head, 3), S->d, "final beta", &S->b_final)) return -1;
    S->eps_final = (float)PyFloat_AsDouble(PyTuple_GET_ITEM(head, 1));
    if (PyErr_Occurred()) return -1;
    PyObject *lm = PyTuple_GET_ITEM(head, 2);
    if (!PyTuple_Check(lm) || PyTuple_GET_SIZE(lm) < 6) { PyErr_SetString(PyExc_ValueError, "lm head: a matrix"); return -1; }
    const int64_t V = PyLong_AsLongLong(PyTuple_GET_ITEM(lm, 3));
    if (PyErr_Occurred() || parse_mat(H, lm, &S->lm, V, S->d)) return -1;
    S->loom |= KINDS[S->lm.kind]->flat;
    PyObject *lo = args[4];
    S->nsel = S->n;
    for (int i = 0; i < S->n; i++) S->sel[i] = i;
    if (lo == Py_None) { S->nsel = 0; S->logits = NULL; return 0; } /* k and v only (pk_run_step) */
    if (PyTuple_Check(lo)) { /* (logits [k, V], rows): the logits of those k ascending rows */
        if (as_tuple(lo, 2, "logits") || parse_sel(PyTuple_GET_ITEM(lo, 1), S)) return -1;
        lo = PyTuple_GET_ITEM(lo, 0);
    }
    if (!(S->logits = (float *)hold(H, lo, 1, -1, "logits"))) return -1;
    const Py_ssize_t got = H->bufs[H->n - 1].len;
    if (S->nsel == S->n && S->n > 1 && got == V * 4) { S->nsel = 1; S->sel[0] = S->n - 1; } /* last row only */
    return want_len(&H->bufs[H->n - 1], V * 4 * S->nsel, "logits");
}

/* pos: a tuple of 1..STEP_MAX positions >= 0 -> S->n, S->pos, S->maxpos */
static int parse_pos(PyObject *o, step_t *S) {
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) < 1 || PyTuple_GET_SIZE(o) > STEP_MAX) {
        PyErr_Format(PyExc_ValueError, "pos must be a tuple of 1..%d positions", STEP_MAX);
        return -1;
    }
    S->n = (int)PyTuple_GET_SIZE(o);
    for (int i = 0; i < S->n; i++) {
        S->pos[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(o, i));
        if (PyErr_Occurred()) return -1;
        if (S->pos[i] < 0) { PyErr_SetString(PyExc_ValueError, "positions must be >= 0"); return -1; }
        if (S->pos[i] > S->maxpos) S->maxpos = S->pos[i];
    }
    return 0;
}

/* reduce = (red float32 [n, d] writable, fn callable) */
static int parse_reduce(holds_t *H, PyObject *o, step_t *S) {
    if (as_tuple(o, 2, "reduce")) return -1;
    PyObject *fn = PyTuple_GET_ITEM(o, 1);
    if (!PyCallable_Check(fn)) { PyErr_SetString(PyExc_TypeError, "reduce fn must be callable"); return -1; }
    if (!(S->red = (float *)hold(H, PyTuple_GET_ITEM(o, 0), 1, S->n * S->d * 4, "reduce buffer"))) return -1;
    S->red_fn = fn; /* borrowed: the caller's tuple holds it for the call */
    return 0;
}

/* the auto mode's q8: 2 for K-quants (Q5_0/Q5_1/IQ4 outside prompts), int8 rows (formats/kquant_rows.h) for
 * independent rows (batched decode: a row's numbers alone = in company), int8 panels (formats/kquant_panels.h)
 * for prompts of 4 tokens or more; else 3 when only repacked 4-bit rows read codes; else 0 */
static int auto_q8(const step_t *S) {
    int any = auto8(S, S->lm.kind), rp = S->lm.rp != NULL;
    for (int l = 0; l < S->nl; l++) {
        const layer_t *L = &S->L[l];
        for (int i = 0; i < L->nqkv; i++) any |= auto8(S, L->qkv[i].kind), rp |= L->qkv[i].rp != NULL;
        for (int i = 0; i < L->ngu; i++) any |= auto8(S, L->gu[i].kind), rp |= L->gu[i].rp != NULL;
        any |= auto8(S, L->o.kind) | (!L->moe && auto8(S, L->down.kind));
        rp |= L->o.rp != NULL || (!L->moe && L->down.rp != NULL);
    }
    if (any && (!S->seq1 || (S->n >= KQP_MIN && S->n <= KQP_MAX))) return 2;
    return PK_IL16 && rp ? 3 : 0;
}

static PyObject *pk_py_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 7 || nargs > 10) {
        PyErr_SetString(PyExc_TypeError, "decode(layers, caches, head, x, logits, pos, q8[, threads[, paged[, reduce]]])");
        return NULL;
    }
    const long want_nt = nargs >= 8 ? PyLong_AsLong(args[7]) : 0; /* 0: set_threads() */
    if (want_nt == -1 && PyErr_Occurred()) return NULL;
    if (want_nt < 0 || want_nt > 4096) { PyErr_SetString(PyExc_ValueError, "threads must be 0..4096"); return NULL; }
    step_t S = {0};
    if (parse_pos(args[5], &S)) return NULL;
    const long q8 = PyLong_AsLong(args[6]); /* 0 float, 1 int8 activations, 2 auto (k8_auto) */
    if (q8 == -1 && PyErr_Occurred()) return NULL;
    if (q8 < 0 || q8 > 6 || (q8 & 3) > 2) { PyErr_SetString(PyExc_ValueError, "q8 must be 0, 1 or 2 (| 4)"); return NULL; }
    S.q8 = PK_SIMD ? (int)(q8 & 3) : 0;
    holds_t H = {0};
    Py_ssize_t nl = PyTuple_Check(args[0]) ? PyTuple_GET_SIZE(args[0]) : 0;
    if (nl > MAX_LAYERS) nl = MAX_LAYERS;
    H.cap = (int)(nl * (64 + 2 * S.n) + 16 + S.n + moe_holds(args[0], nl));
    H.bufs = calloc((size_t)H.cap, sizeof(Py_buffer));
    S.L = calloc((size_t)(nl ? nl : 1), sizeof(layer_t));
    PyObject *ret = NULL;
    float *scratch = NULL;
    if (!H.bufs || !S.L) { PyErr_NoMemory(); goto done; }
    if (nargs >= 9 && parse_paged(&H, args[8], &S)) goto done;
    if (parse_all(&H, args, &S)) goto done;
    pk_row_sharing(&S); /* seq1 and indep */
    if (S.q8 == 2) S.bf = bf16_auto((int)q8), S.q8 = auto_q8(&S); /* q8 0: no int8 codes, no prep */
    if (nargs == 10 && args[9] != Py_None && parse_reduce(&H, args[9], &S)) goto done;
    if (S.red && S.mrows) { PyErr_SetString(PyExc_ValueError, "MoE layers take no reduce"); goto done; }
    const int nt = want_nt ? (int)want_nt : pk_threads;
    /* page-aligned (64 bytes matter: a row kernel's loads of x that split cache lines ran at 0.64x) */
    if (!(scratch = step_buffer(pk_scratch_floats(&S, nt) * 4))) { PyErr_NoMemory(); goto done; }
    Py_BEGIN_ALLOW_THREADS
    pk_run_step(&S, scratch, nt);
    Py_END_ALLOW_THREADS
    if (S.red_err) PyErr_Restore(S.et, S.ev, S.etb); /* the first error of reduce's fn */
    else ret = Py_NewRef(Py_None);
done:
    for (int i = 0; i < H.n; i++) PyBuffer_Release(&H.bufs[i]);
    free(H.bufs);
    for (Py_ssize_t l = 0; S.L && l < nl; l++)
        if (S.L[l].moe) { free(S.L[l].moe->ex); free(S.L[l].moe); }
    free(S.L);
    return ret;
}

#endif /* POLY_DECODE_ARGS_H */

/* poly._ckernels.decode: one whole decode step (every pre-norm block, final norm, LM head) for
 * one new token, in one OpenMP parallel region.
 *
 * Why: per token the Python path makes ~15 kernel calls per block (each a parallel region and a
 * round trip through numpy), which costs more than the 4-bit matrix reads themselves. Here the
 * threads stay inside one region; row-parallel matrix-vector phases are separated by barriers
 * and the small serial work (norms, RoPE, the KV append) runs on one thread.
 *
 * decode(layers, caches, head, x, logits, pos, q8)
 *   layers: tuple of per-block tuples
 *     (heads, kv_heads, head_dim, eps, attn_gamma, q_gamma|None, k_gamma|None, qkv_mats,
 *      cos, sin, o_mat, mlp_gamma, gate_up_mats, down_mat)
 *     a mat is (kind, w, aux|None, m, k, bias|None); qkv_mats is (wqkv,) or (wq, wk, wv);
 *     gate_up_mats is (w_gate_up,) with 2I rows or (w_gate, w_up).
 *   caches: (k0, v0, k1, v1, ...) float32 [T, kv_heads, head_dim] per block
 *   head: (final_gamma, eps, lm_mat)
 *   x: float32 [d] embedding of the token (overwritten: the residual stream)
 *   logits: float32 [V] output; pos: the position written (< T); q8: int8 activations.
 * Every buffer's size is checked against the dims before anything runs (ValueError).
 */
#include "pk_kernels.h"

#define MAX_LAYERS 4096

typedef struct {
    mm_args A; /* w, aux, m, k, rb, nb set; x/out filled per use */
    int kind;
    const float *bias;
} mat_t;

typedef struct {
    int heads, kvh, hd, nqkv, ngu;
    float eps;
    const float *g_attn, *g_q, *g_k, *g_mlp, *cos, *sin;
    float *kc, *vc;
    mat_t qkv[3], o, gu[2], down;
} layer_t;

typedef struct { /* one input vector prepared for every kernel kind */
    const float *x; float *xs, *xp, *dx; int8_t *xq, *xqp; int64_t k;
} px_t;

/* ---- argument parsing: every buffer is held until the call ends -------------------------- */

typedef struct {
    Py_buffer *bufs;
    int n, cap;
} holds_t;

static const void *hold(holds_t *H, PyObject *o, int writable, int64_t want, const char *what) {
    if (o == Py_None) return NULL;
    if (H->n == H->cap) { PyErr_SetString(PyExc_ValueError, "too many buffers"); return NULL; }
    Py_buffer *b = &H->bufs[H->n];
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(o, b, flags) < 0) return NULL;
    H->n++;
    if (want >= 0 && want_len(b, want, what)) return NULL;
    return b->buf;
}

static int as_tuple(PyObject *o, Py_ssize_t n, const char *what) {
    if (!PyTuple_Check(o) || (n >= 0 && PyTuple_GET_SIZE(o) != n)) {
        PyErr_Format(PyExc_ValueError, "%s must be a tuple of %zd items", what, n);
        return -1;
    }
    return 0;
}

/* (kind, w, aux|None, m, k, bias|None) with m rows of k inputs */
static int parse_mat(holds_t *H, PyObject *t, mat_t *M, int64_t m, int64_t k) {
    if (as_tuple(t, 6, "a matrix")) return -1;
    long kind = PyLong_AsLong(PyTuple_GET_ITEM(t, 0));
    int64_t tm = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 3)), tk = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 4));
    if (PyErr_Occurred()) return -1;
    if (kind < 0 || kind >= K_COUNT || tm != m || tk != k || m < 1 || k < 1) {
        PyErr_Format(PyExc_ValueError, "matrix kind %ld [%lld, %lld], expected [%lld, %lld]", kind,
                     (long long)tm, (long long)tk, (long long)m, (long long)k);
        return -1;
    }
    memset(M, 0, sizeof *M);
    M->kind = (int)kind;
    M->A.m = m; M->A.k = k; M->A.n = 1;
    PyObject *ow = PyTuple_GET_ITEM(t, 1), *oa = PyTuple_GET_ITEM(t, 2);
    if (!(M->A.w = hold(H, ow, 0, -1, "w"))) return -1;
    Py_buffer *bw = &H->bufs[H->n - 1], *ba = NULL;
    if ((kind == K_I8 || kind == K_LOOM_Q4) && oa == Py_None) {
        PyErr_SetString(PyExc_ValueError, "this kind needs its scales");
        return -1;
    }
    if (oa != Py_None) {
        if (!(M->A.aux = hold(H, oa, 0, -1, "aux"))) return -1;
        ba = &H->bufs[H->n - 1];
    }
    if (check_matrix((int)kind, bw, ba, &M->A)) return -1;
    if (kind == K_LOOM_Q4 && k % 32) { PyErr_SetString(PyExc_ValueError, "Loom Q4 rows must hold whole blocks"); return -1; }
    PyObject *ob = PyTuple_GET_ITEM(t, 5);
    if (ob != Py_None && !(M->bias = hold(H, ob, 0, m * 4, "bias"))) return -1;
    return 0;
}

static int parse_layer(holds_t *H, PyObject *t, PyObject *kc, PyObject *vc, layer_t *L, int64_t d,
                       int64_t pos, int64_t *inter) {
    if (as_tuple(t, 14, "a layer")) return -1;
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
    const int64_t q = H_ * hd, kvd = kv * hd, half = hd / 2;
    if (!(L->g_attn = hold(H, PyTuple_GET_ITEM(t, 4), 0, d * 4, "attn gamma"))) return -1;
    PyObject *oq = PyTuple_GET_ITEM(t, 5), *ok = PyTuple_GET_ITEM(t, 6);
    if (oq != Py_None && !(L->g_q = hold(H, oq, 0, hd * 4, "q gamma"))) return -1;
    if (ok != Py_None && !(L->g_k = hold(H, ok, 0, hd * 4, "k gamma"))) return -1;
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
    if (!(L->cos = hold(H, (PyObject *)oc, 0, -1, "cos"))) return -1;
    tb = &H->bufs[H->n - 1];
    const int64_t cap = tb->len / (half * 4);
    if (tb->len % (half * 4) || pos >= cap) { PyErr_SetString(PyExc_ValueError, "rope table too short"); return -1; }
    if (!(L->sin = hold(H, PyTuple_GET_ITEM(t, 9), 0, cap * half * 4, "sin"))) return -1;
    if (!(L->kc = (float *)hold(H, kc, 1, -1, "k cache"))) return -1;
    tb = &H->bufs[H->n - 1];
    const int64_t T = tb->len / (kvd * 4);
    if (tb->len % (kvd * 4) || pos >= T) { PyErr_SetString(PyExc_ValueError, "KV cache full or mis-sized"); return -1; }
    if (!(L->vc = (float *)hold(H, vc, 1, T * kvd * 4, "v cache"))) return -1;
    if (parse_mat(H, PyTuple_GET_ITEM(t, 10), &L->o, d, q)) return -1;
    if (!(L->g_mlp = hold(H, PyTuple_GET_ITEM(t, 11), 0, d * 4, "mlp gamma"))) return -1;
    PyObject *mg = PyTuple_GET_ITEM(t, 12), *md = PyTuple_GET_ITEM(t, 13);
    if (!PyTuple_Check(mg) || (PyTuple_GET_SIZE(mg) != 1 && PyTuple_GET_SIZE(mg) != 2) || as_tuple(md, 6, "down")) {
        PyErr_SetString(PyExc_ValueError, "gate/up must be 1 or 2 matrices");
        return -1;
    }
    L->ngu = (int)PyTuple_GET_SIZE(mg);
    const int64_t I = PyLong_AsLongLong(PyTuple_GET_ITEM(md, 4));
    if (PyErr_Occurred() || I < 1) { PyErr_SetString(PyExc_ValueError, "bad intermediate size"); return -1; }
    for (int i = 0; i < L->ngu; i++)
        if (parse_mat(H, PyTuple_GET_ITEM(mg, i), &L->gu[i], L->ngu == 1 ? 2 * I : I, d)) return -1;
    if (parse_mat(H, md, &L->down, d, I)) return -1;
    if (I > *inter) *inter = I;
    return 0;
}

/* ---- compute ------------------------------------------------------------------------------ */

typedef void (*range_fn)(const mm_args *A, int64_t r0, int64_t r1);
#define RANGE(NAME, BODY)                                                                    \
    static void NAME(const mm_args *A, int64_t r0, int64_t r1) {                             \
        for (int64_t r = r0; r < r1; r++) {                                                  \
            prefetch_row(A, r);                                                              \
            BODY;                                                                            \
        }                                                                                    \
    }
RANGE(r_f32, dense_row(K_F32, A, r))
RANGE(r_f16, dense_row(K_F16, A, r))
RANGE(r_bf16, dense_row(K_BF16, A, r))
RANGE(r_i8, dense_row(K_I8, A, r))
RANGE(r_loom, quant_row(K_LOOM_Q4, A, r, 1))
RANGE(r_q4_0, quant_row(K_Q4_0, A, r, 1))
RANGE(r_q4_1, quant_row(K_Q4_1, A, r, 1))
RANGE(r_q8_0, quant_row(K_Q8_0, A, r, 1))
RANGE(r_q4_k, quant_row(K_Q4_K, A, r, 1))
RANGE(r_q6_k, quant_row(K_Q6_K, A, r, 1))
RANGE(r8_i8, Q8ROW(K_I8, 1))
RANGE(r8_loom, Q8ROW(K_LOOM_Q4, 1))
RANGE(r8_q4_0, Q8ROW(K_Q4_0, 1))
RANGE(r8_q4_1, Q8ROW(K_Q4_1, 1))
RANGE(r8_q8_0, Q8ROW(K_Q8_0, 1))
RANGE(r8_q4_k, Q8ROW(K_Q4_K, 1))
RANGE(r8_q6_k, Q8ROW(K_Q6_K, 1))
static const range_fn RF[K_COUNT] = {r_f32, r_f16, r_bf16, r_i8, r_loom, r_q4_0, r_q4_1, r_q8_0, r_q4_k, r_q6_k};
static const range_fn RF8[K_COUNT] = {NULL, NULL, NULL, r8_i8, r8_loom, r8_q4_0, r8_q4_1, r8_q8_0, r8_q4_k, r8_q6_k};

static void rmsnorm(const float *x, const float *g, float eps, float *out, int64_t n) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float inv = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * g[i];
}

/* block sums (the offset term of the quantized kinds), Loom's reordered copy, int8 codes */
static void prep(px_t *P, const float *x, int64_t k, int loom, int q8) {
    P->x = x; P->k = k;
    if (k % 32) return;
    const int64_t nb = k / 32;
    for (int64_t b = 0; b < nb; b++) {
        float t = 0.0f;
        for (int l = 0; l < 32; l++) t += x[b * 32 + l];
        P->xs[b] = t;
    }
    if (loom) loom_order(x, P->xp, k);
    if (q8) {
        quantize_x(x, P->xq, P->dx, nb);
        if (loom) quantize_x(P->xp, P->xqp, P->dx, nb);
    }
}

static void mat_rows(const mat_t *M, const px_t *P, float *out, int64_t r0, int64_t r1, int q8) {
    if (r0 >= r1) return;
    mm_args A = M->A;
    const int loom = M->kind == K_LOOM_Q4;
    A.out = out; A.x = loom ? P->xp : P->x; A.xs = P->xs;
    A.xq = loom ? P->xqp : P->xq; A.dx = P->dx;
    const int use8 = q8 && PK_SIMD && (M->kind > K_I8 || (M->kind == K_I8 && A.k % 32 == 0));
    (use8 ? RF8 : RF)[M->kind](&A, r0, r1);
    if (M->bias)
        for (int64_t r = r0; r < r1; r++) out[r] += M->bias[r];
}

static inline void part(int64_t m, int tid, int nt, int64_t *r0, int64_t *r1) {
    *r0 = m * tid / nt; *r1 = m * (tid + 1) / nt;
}

/* q/k norm, RoPE (pairs i, i + hd/2) at `pos`, then k/v appended to the caches */
static void rope_append(const layer_t *L, float *qkv, int64_t pos) {
    const int64_t hd = L->hd, half = hd / 2, q = (int64_t)L->heads * hd, kvd = (int64_t)L->kvh * hd;
    const float *c = L->cos + pos * half, *s = L->sin + pos * half;
    for (int64_t h = 0; h < L->heads + L->kvh; h++) {
        float *v = qkv + h * hd;
        const float *g = h < L->heads ? L->g_q : L->g_k;
        if (g) rmsnorm(v, g, L->eps, v, hd);
        for (int64_t i = 0; i < half; i++) {
            const float x1 = v[i], x2 = v[i + half];
            v[i] = x1 * c[i] - x2 * s[i];
            v[i + half] = x2 * c[i] + x1 * s[i];
        }
    }
    memcpy(L->kc + pos * kvd, qkv + q, (size_t)kvd * 4);
    memcpy(L->vc + pos * kvd, qkv + q + kvd, (size_t)kvd * 4);
}

/* softmax(q . K[0..pos] / sqrt(hd)) . V[0..pos] for heads [h0, h1) */
static void attend(const layer_t *L, const float *qkv, float *att, float *sc, int64_t pos, int h0, int h1) {
    const int64_t hd = L->hd, kvd = (int64_t)L->kvh * hd, groups = L->heads / L->kvh;
    const float scale = (float)(1.0 / sqrt((double)hd));
    for (int h = h0; h < h1; h++) {
        const float *q = qkv + h * hd;
        const int64_t g = h / groups;
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t <= pos; t++) {
            const float *k = L->kc + t * kvd + g * hd;
            float s = 0.0f;
            for (int64_t i = 0; i < hd; i++) s += q[i] * k[i];
            sc[t] = s * scale;
            mx = fmaxf(mx, sc[t]);
        }
        for (int64_t t = 0; t <= pos; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
        float *o = att + h * hd;
        for (int64_t i = 0; i < hd; i++) o[i] = 0.0f;
        for (int64_t t = 0; t <= pos; t++) {
            const float p = sc[t] / sum, *v = L->vc + t * kvd + g * hd;
            for (int64_t i = 0; i < hd; i++) o[i] += p * v[i];
        }
    }
}

typedef struct {
    layer_t *L; int nl; int64_t d, inter, pos, maxq, maxw; int q8, loom;
    const float *g_final; float eps_final; mat_t lm; float *x, *logits;
} step_t;

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

static void block_ffn(const layer_t *L, float *x, float *h, float *gu, float *hid, float *tmp,
                      px_t *P, const step_t *S, int tid, int nt) {
    const int64_t d = S->d, I = L->down.A.k;
    int64_t r0, r1;
#pragma omp single
    { rmsnorm(x, L->g_mlp, L->eps, h, d); prep(P, h, d, S->loom, S->q8); }
    part(I, tid, nt, &r0, &r1);
    if (L->ngu == 1) {
        mat_rows(&L->gu[0], P, gu, r0, r1, S->q8);
        mat_rows(&L->gu[0], P, gu, I + r0, I + r1, S->q8);
    } else {
        mat_rows(&L->gu[0], P, gu, r0, r1, S->q8);
        mat_rows(&L->gu[1], P, gu + I, r0, r1, S->q8);
    }
    for (int64_t r = r0; r < r1; r++) hid[r] = silu(gu[r]) * gu[I + r];
#pragma omp barrier
#pragma omp single
    prep(P, hid, I, S->loom, S->q8);
    part(d, tid, nt, &r0, &r1);
    mat_rows(&L->down, P, tmp, r0, r1, S->q8);
    for (int64_t r = r0; r < r1; r++) x[r] += tmp[r];
#pragma omp barrier
}

static void run_step(const step_t *S, float *scratch, int nt) {
    const int64_t d = S->d, kmax = S->maxw > S->inter ? S->maxw : S->inter;
    float *h = scratch, *qkv = h + d, *att = qkv + S->maxw, *tmp = att + S->maxq;
    float *gu = tmp + d, *hid = gu + 2 * S->inter, *sc = hid + S->inter;
    float *xs = sc + (S->pos + 1) * nt, *xp = xs + kmax / 32 + 1, *dx = xp + kmax;
    int8_t *xq = (int8_t *)(dx + kmax / 32 + 1), *xqp = xq + 2 * kmax;
    px_t P = {NULL, xs, xp, dx, xq, xqp, 0};
    float *x = S->x;
#pragma omp parallel num_threads(nt)
    {
#ifdef _OPENMP
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
#else
        const int tid = 0, nth = 1;
#endif
        int64_t r0, r1;
        for (int l = 0; l < S->nl; l++) {
            const layer_t *L = &S->L[l];
#pragma omp single
            { rmsnorm(x, L->g_attn, L->eps, h, d); prep(&P, h, d, S->loom, S->q8); }
            for (int i = 0, off = 0; i < L->nqkv; off += (int)L->qkv[i].A.m, i++) {
                part(L->qkv[i].A.m, tid, nth, &r0, &r1);
                mat_rows(&L->qkv[i], &P, qkv + off, r0, r1, S->q8);
            }
#pragma omp barrier
#pragma omp single
            rope_append(L, qkv, S->pos);
            part(L->heads, tid, nth, &r0, &r1);
            attend(L, qkv, att, sc + tid * (S->pos + 1), S->pos, (int)r0, (int)r1);
#pragma omp barrier
#pragma omp single
            prep(&P, att, (int64_t)L->heads * L->hd, S->loom, S->q8);
            part(d, tid, nth, &r0, &r1);
            mat_rows(&L->o, &P, tmp, r0, r1, S->q8);
            for (int64_t r = r0; r < r1; r++) x[r] += tmp[r];
#pragma omp barrier
            block_ffn(L, x, h, gu, hid, tmp, &P, S, tid, nth);
        }
#pragma omp single
        { rmsnorm(x, S->g_final, S->eps_final, h, d); prep(&P, h, d, S->loom, S->q8); }
        part(S->lm.A.m, tid, nth, &r0, &r1);
        mat_rows(&S->lm, &P, S->logits, r0, r1, S->q8);
    }
}

/* ---- Python entry ------------------------------------------------------------------------- */

static int parse_all(holds_t *H, PyObject *const *args, step_t *S) {
    PyObject *layers = args[0], *caches = args[1], *head = args[2];
    if (!PyTuple_Check(layers) || !PyTuple_Check(caches) || as_tuple(head, 3, "head")) {
        PyErr_SetString(PyExc_ValueError, "decode(layers, caches, head, x, logits, pos, q8)");
        return -1;
    }
    S->nl = (int)PyTuple_GET_SIZE(layers);
    if (S->nl > MAX_LAYERS || PyTuple_GET_SIZE(caches) != 2 * S->nl) {
        PyErr_SetString(PyExc_ValueError, "need two caches per layer");
        return -1;
    }
    Py_buffer *bx;
    if (!(S->x = (float *)hold(H, args[3], 1, -1, "x"))) return -1;
    bx = &H->bufs[H->n - 1];
    S->d = bx->len / 4;
    if (S->d < 1 || bx->len % 4) { PyErr_SetString(PyExc_ValueError, "x must be float32 [d]"); return -1; }
    for (int l = 0; l < S->nl; l++) {
        layer_t *L = &S->L[l];
        if (parse_layer(H, PyTuple_GET_ITEM(layers, l), PyTuple_GET_ITEM(caches, 2 * l),
                        PyTuple_GET_ITEM(caches, 2 * l + 1), L, S->d, S->pos, &S->inter)) return -1;
        const int64_t q = (int64_t)L->heads * L->hd, w = q + 2 * (int64_t)L->kvh * L->hd;
        if (q > S->maxq) S->maxq = q;
        if (w > S->maxw) S->maxw = w;
        for (int i = 0; i < 3; i++) S->loom |= L->qkv[i].kind == K_LOOM_Q4 && i < L->nqkv;
        S->loom |= L->o.kind == K_LOOM_Q4 || L->down.kind == K_LOOM_Q4;
        for (int i = 0; i < L->ngu; i++) S->loom |= L->gu[i].kind == K_LOOM_Q4;
    }
    if (!(S->g_final = hold(H, PyTuple_GET_ITEM(head, 0), 0, S->d * 4, "final gamma"))) return -1;
    S->eps_final = (float)PyFloat_AsDouble(PyTuple_GET_ITEM(head, 1));
    if (PyErr_Occurred()) return -1;
    PyObject *lm = PyTuple_GET_ITEM(head, 2);
    if (as_tuple(lm, 6, "lm head")) return -1;
    const int64_t V = PyLong_AsLongLong(PyTuple_GET_ITEM(lm, 3));
    if (PyErr_Occurred() || parse_mat(H, lm, &S->lm, V, S->d)) return -1;
    S->loom |= S->lm.kind == K_LOOM_Q4;
    if (!(S->logits = (float *)hold(H, args[4], 1, V * 4, "logits"))) return -1;
    return 0;
}

PyObject *pk_py_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7) { PyErr_SetString(PyExc_TypeError, "decode(layers, caches, head, x, logits, pos, q8)"); return NULL; }
    step_t S = {0};
    S.pos = PyLong_AsLongLong(args[5]);
    S.q8 = PyObject_IsTrue(args[6]) == 1 && PK_SIMD;
    if (PyErr_Occurred()) return NULL;
    if (S.pos < 0) { PyErr_SetString(PyExc_ValueError, "pos must be >= 0"); return NULL; }
    holds_t H = {0};
    Py_ssize_t nl = PyTuple_Check(args[0]) ? PyTuple_GET_SIZE(args[0]) : 0;
    if (nl > MAX_LAYERS) nl = MAX_LAYERS;
    H.cap = (int)(nl * 32 + 16);
    H.bufs = calloc((size_t)H.cap, sizeof(Py_buffer));
    S.L = calloc((size_t)(nl ? nl : 1), sizeof(layer_t));
    PyObject *ret = NULL;
    float *scratch = NULL;
    if (!H.bufs || !S.L) { PyErr_NoMemory(); goto done; }
    if (parse_all(&H, args, &S)) goto done;
    const int nt = pk_threads;
    const int64_t kmax = S.maxw > S.inter ? S.maxw : S.inter;
    const size_t floats = (size_t)(S.d * 3 + S.maxw + S.maxq + 3 * S.inter + (S.pos + 1) * nt + 3 * kmax + 64);
    scratch = malloc(floats * 4 + (size_t)(4 * kmax) + 64);
    if (!scratch) { PyErr_NoMemory(); goto done; }
    Py_BEGIN_ALLOW_THREADS
    run_step(&S, scratch, nt);
    Py_END_ALLOW_THREADS
    ret = Py_NewRef(Py_None);
done:
    free(scratch);
    for (int i = 0; i < H.n; i++) PyBuffer_Release(&H.bufs[i]);
    free(H.bufs);
    free(S.L);
    return ret;
}

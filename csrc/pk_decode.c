/* poly._ckernels.decode: one whole decode step (every pre-norm block, final norm, LM head) for
 * one new token, in one OpenMP parallel region.
 *
 * Why: per token the Python path makes ~15 kernel calls per block (each a parallel region and a
 * round trip through numpy), which costs more than the 4-bit matrix reads themselves. Here the
 * threads stay inside one region; row-parallel matrix-vector phases are separated by barriers
 * and the small serial work (norms, RoPE, the KV append) runs on one thread.
 *
 * decode(layers, caches, head, x, logits, pos, q8) for n <= 16 rows (independent sequences, each
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
 *   logits: float32 [n, V] output; pos: tuple of n positions written (each < its T);
 *   q8: int8 activations.
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
    float *kc[MAX_N], *vc[MAX_N];
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

static int parse_layer(holds_t *H, PyObject *t, PyObject *caches, int l, int n, const int64_t *pos,
                       layer_t *L, int64_t d, int64_t maxpos, int64_t *inter) {
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
    if (tb->len % (half * 4) || maxpos >= cap) { PyErr_SetString(PyExc_ValueError, "rope table too short"); return -1; }
    if (!(L->sin = hold(H, PyTuple_GET_ITEM(t, 9), 0, cap * half * 4, "sin"))) return -1;
    for (int i = 0; i < n; i++) {
        PyObject *kc = PyTuple_GET_ITEM(caches, 2 * ((Py_ssize_t)l * n + i));
        PyObject *vc = PyTuple_GET_ITEM(caches, 2 * ((Py_ssize_t)l * n + i) + 1);
        if (!(L->kc[i] = (float *)hold(H, kc, 1, -1, "k cache"))) return -1;
        tb = &H->bufs[H->n - 1];
        const int64_t T = tb->len / (kvd * 4);
        if (tb->len % (kvd * 4) || pos[i] >= T) { PyErr_SetString(PyExc_ValueError, "KV cache full or mis-sized"); return -1; }
        if (!(L->vc[i] = (float *)hold(H, vc, 1, T * kvd * 4, "v cache"))) return -1;
    }
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
RANGE(r_loom, if (A->n == 1) quant_row(K_LOOM_Q4, A, r, 1); else quant_row(K_LOOM_Q4, A, r, A->n))
RANGE(r_q4_0, if (A->n == 1) quant_row(K_Q4_0, A, r, 1); else quant_row(K_Q4_0, A, r, A->n))
RANGE(r_q4_1, if (A->n == 1) quant_row(K_Q4_1, A, r, 1); else quant_row(K_Q4_1, A, r, A->n))
RANGE(r_q8_0, if (A->n == 1) quant_row(K_Q8_0, A, r, 1); else quant_row(K_Q8_0, A, r, A->n))
RANGE(r_q4_k, if (A->n == 1) quant_row(K_Q4_K, A, r, 1); else quant_row(K_Q4_K, A, r, A->n))
RANGE(r_q6_k, if (A->n == 1) quant_row(K_Q6_K, A, r, 1); else quant_row(K_Q6_K, A, r, A->n))
RANGE(r8_i8, if (A->n == 1) Q8ROW(K_I8, 1); else Q8ROW(K_I8, A->n))
RANGE(r8_loom, if (A->n == 1) Q8ROW(K_LOOM_Q4, 1); else Q8ROW(K_LOOM_Q4, A->n))
RANGE(r8_q4_0, if (A->n == 1) Q8ROW(K_Q4_0, 1); else Q8ROW(K_Q4_0, A->n))
RANGE(r8_q4_1, if (A->n == 1) Q8ROW(K_Q4_1, 1); else Q8ROW(K_Q4_1, A->n))
RANGE(r8_q8_0, if (A->n == 1) Q8ROW(K_Q8_0, 1); else Q8ROW(K_Q8_0, A->n))
RANGE(r8_q4_k, if (A->n == 1) Q8ROW(K_Q4_K, 1); else Q8ROW(K_Q4_K, A->n))
RANGE(r8_q6_k, if (A->n == 1) Q8ROW(K_Q6_K, 1); else Q8ROW(K_Q6_K, A->n))
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

/* rows [r0, r1) of M for the n prepared inputs; out row i at out + i * ldo */
static void mat_rows(const mat_t *M, const px_t *P, float *out, int64_t ldo, int64_t r0, int64_t r1,
                     int q8, int64_t n) {
    if (r0 >= r1) return;
    mm_args A = M->A;
    const int loom = M->kind == K_LOOM_Q4;
    A.n = n; A.out = out; A.ldo = ldo;
    A.x = loom ? P->xp : P->x; A.xs = P->xs;
    A.xq = loom ? P->xqp : P->xq; A.dx = P->dx;
    const int use8 = q8 && PK_SIMD && (M->kind > K_I8 || (M->kind == K_I8 && A.k % 32 == 0));
    (use8 ? RF8 : RF)[M->kind](&A, r0, r1);
    if (M->bias)
        for (int64_t i = 0; i < n; i++)
            for (int64_t r = r0; r < r1; r++) out[i * ldo + r] += M->bias[r];
}

static inline void part(int64_t m, int tid, int nt, int64_t *r0, int64_t *r1) {
    *r0 = m * tid / nt; *r1 = m * (tid + 1) / nt;
}

/* row i: q/k norm, RoPE (pairs j, j + hd/2) at pos, then k/v appended to its caches */
static void rope_append(const layer_t *L, float *qkv, int64_t pos, int i) {
    const int64_t hd = L->hd, half = hd / 2, q = (int64_t)L->heads * hd, kvd = (int64_t)L->kvh * hd;
    const float *c = L->cos + pos * half, *s = L->sin + pos * half;
    for (int64_t h = 0; h < L->heads + L->kvh; h++) {
        float *v = qkv + h * hd;
        const float *g = h < L->heads ? L->g_q : L->g_k;
        if (g) rmsnorm(v, g, L->eps, v, hd);
        for (int64_t j = 0; j < half; j++) {
            const float x1 = v[j], x2 = v[j + half];
            v[j] = x1 * c[j] - x2 * s[j];
            v[j + half] = x2 * c[j] + x1 * s[j];
        }
    }
    memcpy(L->kc[i] + pos * kvd, qkv + q, (size_t)kvd * 4);
    memcpy(L->vc[i] + pos * kvd, qkv + q + kvd, (size_t)kvd * 4);
}

/* row i, head h: softmax(q . K[0..pos] / sqrt(hd)) . V[0..pos] */
static void attend(const layer_t *L, const float *q, float *o, float *sc, int64_t pos, int i, int h) {
    const int64_t hd = L->hd, kvd = (int64_t)L->kvh * hd, g = h / (L->heads / L->kvh);
    const float scale = (float)(1.0 / sqrt((double)hd));
    const float *K = L->kc[i] + g * hd, *V = L->vc[i] + g * hd;
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t t = 0; t <= pos; t++) {
        const float *k = K + t * kvd;
        float s = 0.0f;
        for (int64_t j = 0; j < hd; j++) s += q[j] * k[j];
        sc[t] = s * scale;
        mx = fmaxf(mx, sc[t]);
    }
    for (int64_t t = 0; t <= pos; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
    for (int64_t j = 0; j < hd; j++) o[j] = 0.0f;
    for (int64_t t = 0; t <= pos; t++) {
        const float p = sc[t] / sum, *v = V + t * kvd;
        for (int64_t j = 0; j < hd; j++) o[j] += p * v[j];
    }
}

typedef struct {
    layer_t *L; int nl, n; int64_t d, inter, maxpos, maxq, maxw; int q8, loom;
    int64_t pos[MAX_N];
    const float *g_final; float eps_final; mat_t lm; float *x, *logits;
} step_t;

typedef struct { float *h, *qkv, *att, *tmp, *gu, *hid, *sc; px_t P; } bufs_t;

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

static void norm_prep(const step_t *S, const float *x, const float *g, float eps, bufs_t *B) {
    for (int i = 0; i < S->n; i++) rmsnorm(x + i * S->d, g, eps, B->h + i * S->d, S->d);
    prep(&B->P, B->h, S->n * S->d, S->loom, S->q8);
}

static void block_attn(const step_t *S, const layer_t *L, bufs_t *B, int tid, int nt) {
    const int64_t d = S->d, n = S->n, q = (int64_t)L->heads * L->hd, w = q + 2 * (int64_t)L->kvh * L->hd;
    float *x = S->x;
    int64_t r0, r1;
#pragma omp single
    norm_prep(S, x, L->g_attn, L->eps, B);
    for (int i = 0, off = 0; i < L->nqkv; off += (int)L->qkv[i].A.m, i++) {
        part(L->qkv[i].A.m, tid, nt, &r0, &r1);
        mat_rows(&L->qkv[i], &B->P, B->qkv + off, w, r0, r1, S->q8, n);
    }
#pragma omp barrier
#pragma omp single
    for (int i = 0; i < n; i++) rope_append(L, B->qkv + i * w, S->pos[i], i);
    part(n * L->heads, tid, nt, &r0, &r1);
    for (int64_t e = r0; e < r1; e++) {
        const int i = (int)(e / L->heads), h = (int)(e % L->heads);
        attend(L, B->qkv + i * w + h * L->hd, B->att + i * q + h * L->hd, B->sc + tid * (S->maxpos + 1),
               S->pos[i], i, h);
    }
#pragma omp barrier
#pragma omp single
    prep(&B->P, B->att, n * q, S->loom, S->q8);
    part(d, tid, nt, &r0, &r1);
    mat_rows(&L->o, &B->P, B->tmp, d, r0, r1, S->q8, n);
    for (int64_t i = 0; i < n; i++)
        for (int64_t r = r0; r < r1; r++) x[i * d + r] += B->tmp[i * d + r];
#pragma omp barrier
}

static void block_ffn(const step_t *S, const layer_t *L, bufs_t *B, int tid, int nt) {
    const int64_t d = S->d, n = S->n, I = L->down.A.k;
    float *x = S->x, *gu = B->gu;
    int64_t r0, r1;
#pragma omp single
    norm_prep(S, x, L->g_mlp, L->eps, B);
    part(I, tid, nt, &r0, &r1);
    if (L->ngu == 1) {
        mat_rows(&L->gu[0], &B->P, gu, 2 * I, r0, r1, S->q8, n);
        mat_rows(&L->gu[0], &B->P, gu, 2 * I, I + r0, I + r1, S->q8, n);
    } else {
        mat_rows(&L->gu[0], &B->P, gu, 2 * I, r0, r1, S->q8, n);
        mat_rows(&L->gu[1], &B->P, gu + I, 2 * I, r0, r1, S->q8, n);
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t r = r0; r < r1; r++) B->hid[i * I + r] = silu(gu[i * 2 * I + r]) * gu[i * 2 * I + I + r];
#pragma omp barrier
#pragma omp single
    prep(&B->P, B->hid, n * I, S->loom, S->q8);
    part(d, tid, nt, &r0, &r1);
    mat_rows(&L->down, &B->P, B->tmp, d, r0, r1, S->q8, n);
    for (int64_t i = 0; i < n; i++)
        for (int64_t r = r0; r < r1; r++) x[i * d + r] += B->tmp[i * d + r];
#pragma omp barrier
}

/* scratch floats for step S with nt threads (see carve) */
static size_t scratch_floats(const step_t *S, int nt) {
    const int64_t n = S->n, kmax = S->maxw > S->inter ? S->maxw : S->inter;
    return (size_t)(n * (2 * S->d + S->maxw + S->maxq + 3 * S->inter + 3 * kmax) + (S->maxpos + 1) * nt + 64);
}

static void carve(const step_t *S, float *f, int nt, bufs_t *B) {
    const int64_t n = S->n, kmax = S->maxw > S->inter ? S->maxw : S->inter;
    B->h = f; B->qkv = B->h + n * S->d; B->att = B->qkv + n * S->maxw; B->tmp = B->att + n * S->maxq;
    B->gu = B->tmp + n * S->d; B->hid = B->gu + 2 * n * S->inter; B->sc = B->hid + n * S->inter;
    B->P.xs = B->sc + (S->maxpos + 1) * nt;
    B->P.dx = B->P.xs + n * kmax / 32 + 1;
    B->P.xp = B->P.dx + n * kmax / 32 + 1;
    B->P.xq = (int8_t *)(B->P.xp + n * kmax);
    B->P.xqp = B->P.xq + 2 * n * kmax;
}

static void run_step(const step_t *S, float *scratch, int nt) {
    bufs_t B;
    carve(S, scratch, nt, &B);
#pragma omp parallel num_threads(nt)
    {
#ifdef _OPENMP
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
#else
        const int tid = 0, nth = 1;
#endif
        int64_t r0, r1;
        for (int l = 0; l < S->nl; l++) {
            block_attn(S, &S->L[l], &B, tid, nth);
            block_ffn(S, &S->L[l], &B, tid, nth);
        }
#pragma omp single
        norm_prep(S, S->x, S->g_final, S->eps_final, &B);
        part(S->lm.A.m, tid, nth, &r0, &r1);
        mat_rows(&S->lm, &B.P, S->logits, S->lm.A.m, r0, r1, S->q8, S->n);
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
        if (parse_layer(H, PyTuple_GET_ITEM(layers, l), caches, l, S->n, S->pos, L, S->d, S->maxpos, &S->inter)) return -1;
        const int64_t q = (int64_t)L->heads * L->hd, w = q + 2 * (int64_t)L->kvh * L->hd;
        if (q > S->maxq) S->maxq = q;
        if (w > S->maxw) S->maxw = w;
        for (int i = 0; i < L->nqkv; i++) S->loom |= L->qkv[i].kind == K_LOOM_Q4;
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
    if (!(S->logits = (float *)hold(H, args[4], 1, V * 4 * S->n, "logits"))) return -1;
    return 0;
}

/* pos: a tuple of 1..MAX_N positions >= 0 -> S->n, S->pos, S->maxpos */
static int parse_pos(PyObject *o, step_t *S) {
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) < 1 || PyTuple_GET_SIZE(o) > MAX_N) {
        PyErr_Format(PyExc_ValueError, "pos must be a tuple of 1..%d positions", MAX_N);
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

PyObject *pk_py_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7) { PyErr_SetString(PyExc_TypeError, "decode(layers, caches, head, x, logits, pos, q8)"); return NULL; }
    step_t S = {0};
    if (parse_pos(args[5], &S)) return NULL;
    const int q8 = PyObject_IsTrue(args[6]);
    if (q8 < 0) return NULL;
    S.q8 = q8 && PK_SIMD;
    holds_t H = {0};
    Py_ssize_t nl = PyTuple_Check(args[0]) ? PyTuple_GET_SIZE(args[0]) : 0;
    if (nl > MAX_LAYERS) nl = MAX_LAYERS;
    H.cap = (int)(nl * (32 + 2 * S.n) + 16);
    H.bufs = calloc((size_t)H.cap, sizeof(Py_buffer));
    S.L = calloc((size_t)(nl ? nl : 1), sizeof(layer_t));
    PyObject *ret = NULL;
    float *scratch = NULL;
    if (!H.bufs || !S.L) { PyErr_NoMemory(); goto done; }
    if (parse_all(&H, args, &S)) goto done;
    const int nt = pk_threads;
    scratch = malloc(scratch_floats(&S, nt) * 4);
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

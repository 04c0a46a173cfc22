/* Argument parsing of poly.runtime.native.ckernels.decode (see csrc/decode/step.h for the call): every buffer
 * is taken with the buffer protocol, sized against the dims, and held until the call ends. */
#ifndef POLY_DECODE_ARGS_BUFFERS_H
#define POLY_DECODE_ARGS_BUFFERS_H
#include "core/common.h"
#include "formats/kinds.h"
#include "core/matrix_check.h"
#include "formats/kquant_interleave8_panels.h"
#include "gemm/dequant.h"
#include "decode/step.h"

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

/* whether buffer b holds one native-order item type `code` of `size` bytes ("f" 4, "e" 2, "i" 4) */
static int buf_is(const Py_buffer *b, const char *code, Py_ssize_t size) {
    const char *f = b->format ? b->format : "B";
    f += *f == '<' || *f == '='; /* the byte-order prefix */
    return b->itemsize == size && !strcmp(f, code);
}

/* a KV cache: writable float32 or float16 -> *es bytes an element */
static void *hold_kv(holds_t *H, PyObject *o, int *es, const char *what) {
    if (H->n == H->cap) { PyErr_SetString(PyExc_ValueError, "too many buffers"); return NULL; }
    Py_buffer *b = &H->bufs[H->n];
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) return NULL;
    H->n++;
    *es = buf_is(b, "f", 4) ? 4 : buf_is(b, "e", 2) ? 2 : buf_is(b, "b", 1) ? 1 : 0; /* 1: q8_0 rows */
    if (!*es) {
        PyErr_Format(PyExc_ValueError, "%s must be float32, float16 or int8 (q8_0 rows)", what);
        return NULL;
    }
    return b->buf;
}

static int as_tuple(PyObject *o, Py_ssize_t n, const char *what) {
    if (!PyTuple_Check(o) || (n >= 0 && PyTuple_GET_SIZE(o) != n)) {
        PyErr_Format(PyExc_ValueError, "%s must be a tuple of %zd items", what, n);
        return -1;
    }
    return 0;
}

/* row i's page table covers its position and names pages in [0, npages) */
static int check_table(const step_t *S, int i, int64_t npages) {
    const int64_t need = S->pos[i] / S->ps + 1;
    if (S->ntab[i] < need) { PyErr_SetString(PyExc_ValueError, "page table too short"); return -1; }
    for (int64_t j = 0; j < need; j++)
        if (S->tab[i][j] < 0 || S->tab[i][j] >= npages) { PyErr_SetString(PyExc_ValueError, "page id outside the pool"); return -1; }
    return 0;
}

/* paged: None or (page_size, (int32 table per row)) -> S->ps, S->tab, S->ntab */
static int parse_paged(holds_t *H, PyObject *o, step_t *S) {
    if (o == Py_None) return 0;
    if (as_tuple(o, 2, "paged")) return -1;
    S->ps = PyLong_AsLongLong(PyTuple_GET_ITEM(o, 0));
    if (PyErr_Occurred()) return -1;
    PyObject *tabs = PyTuple_GET_ITEM(o, 1);
    if (S->ps < 1 || as_tuple(tabs, S->n, "page tables")) return -1;
    for (int i = 0; i < S->n; i++) {
        if (H->n == H->cap) { PyErr_SetString(PyExc_ValueError, "too many buffers"); return -1; }
        Py_buffer *b = &H->bufs[H->n];
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(tabs, i), b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
        H->n++;
        S->tab[i] = b->buf;
        if (!buf_is(b, "i", 4)) { PyErr_SetString(PyExc_ValueError, "page tables must be int32 arrays"); return -1; }
        S->ntab[i] = b->len / 4;
    }
    return 0;
}

/* (kind, w, aux|None, m, k, bias|None[, rp|None]) with m rows of k inputs; rp: Q4_0/Q4_1/Q8_0/int8
 * rows repacked by 16 (csrc/formats/interleave16.h), or float16 rows by 16, k-major (csrc/formats/float_kmajor16.h: M->hk) */
static int parse_mat(holds_t *H, PyObject *t, mat_t *M, int64_t m, int64_t k) {
    if (as_tuple(t, -1, "a matrix") || (PyTuple_GET_SIZE(t) != 6 && as_tuple(t, 7, "a matrix"))) return -1;
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
    if (KINDS[kind]->aux && oa == Py_None) { PyErr_SetString(PyExc_ValueError, "this kind needs its scales"); return -1; }
    if (oa != Py_None) {
        if (!(M->A.aux = hold(H, oa, 0, -1, "aux"))) return -1;
        ba = &H->bufs[H->n - 1];
    }
    if (check_matrix((int)kind, bw, ba, &M->A)) return -1;
    if (KINDS[kind]->flat && k % 32) { PyErr_SetString(PyExc_ValueError, "Loom Q4 rows must hold whole blocks"); return -1; }
    PyObject *ob = PyTuple_GET_ITEM(t, 5), *orp = PyTuple_GET_SIZE(t) == 7 ? PyTuple_GET_ITEM(t, 6) : Py_None;
    if (ob != Py_None && !(M->bias = hold(H, ob, 0, m * 4, "bias"))) return -1;
    if (orp == Py_None) return 0; /* nothing repacked */
    if (KINDS[kind]->kil8) { /* rows by 8 (csrc/formats/kquant_interleave8.h) */
        const int64_t nrk = kil8_bytes((int)kind, m, k);
        if (nrk < 0) { PyErr_SetString(PyExc_ValueError, "rp: Q4_K/Q6_K rows by 8 need m % 8 == 0 and k % 256 == 0"); return -1; }
        return (M->rk = hold(H, orp, 0, nrk, "rp")) ? 0 : -1;
    }
    int hk;
    const int64_t nrp = rp_bytes((int)kind, m, k, &hk);
    if (nrp < 0) { PyErr_SetString(PyExc_ValueError, "rp: Q4_0/Q4_1/Q8_0/int8 rows by 16, float32/float16 by 16 on SIMD builds"); return -1; }
    const void *p = hold(H, orp, 0, nrp, "rp");
    if (hk) M->hk = p; else M->rp = p;
    return p ? 0 : -1;
}

/* gate/up (1 or 2 matrices) and down of a SwiGLU with d inputs; *inter = max(*inter, I) */
static int parse_ffn(holds_t *H, PyObject *mg, PyObject *md, int *ngu, mat_t *gu, mat_t *down, int64_t d,
                     int64_t *inter) {
    if (!PyTuple_Check(mg) || (PyTuple_GET_SIZE(mg) != 1 && PyTuple_GET_SIZE(mg) != 2) || !PyTuple_Check(md) || PyTuple_GET_SIZE(md) < 6) {
        PyErr_SetString(PyExc_ValueError, "gate/up must be 1 or 2 matrices");
        return -1;
    }
    *ngu = (int)PyTuple_GET_SIZE(mg);
    const int64_t I = PyLong_AsLongLong(PyTuple_GET_ITEM(md, 4));
    if (PyErr_Occurred() || I < 1) { PyErr_SetString(PyExc_ValueError, "bad intermediate size"); return -1; }
    for (int i = 0; i < *ngu; i++)
        if (parse_mat(H, PyTuple_GET_ITEM(mg, i), &gu[i], *ngu == 1 ? 2 * I : I, d)) return -1;
    if (parse_mat(H, md, down, d, I)) return -1;
    if (I > *inter) *inter = I;
    return 0;
}

#endif /* POLY_DECODE_ARGS_BUFFERS_H */

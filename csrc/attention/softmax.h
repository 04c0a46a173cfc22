/* softmax_causal(scores, n, start, threads): the attention weights of a prefill, in place and
 * in parallel. scores float32 [R, T], row r the query at position start + r % n (rows are
 * [kv head, group, query]); its keys 0..start + r % n keep softmax weights, later keys get 0.
 *
 * Why: numpy's mask, max, exp, sum and divide are five single-threaded passes over [R, T]. */
#ifndef POLY_ATTENTION_SOFTMAX_H
#define POLY_ATTENTION_SOFTMAX_H
#include "core/common.h"
#include "core/activations.h"
#include "attention/decode_row.h"

static void softmax_row(float *sc, int64_t len, int64_t T) {
    float mx = -INFINITY;
    int64_t t0 = 0;
#if PK_SIMD /* max in vector registers (NaN scores: fmaxf skipped them, max_ps keeps mx alike) */
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (; t0 + 8 <= len; t0 += 8) m = _mm256_max_ps(_mm256_loadu_ps(sc + t0), m);
    mx = hmax8(m);
#endif
    for (int64_t t = t0; t < len; t++) mx = fmaxf(mx, sc[t]);
#if PK_SIMD
    const float sum = attn_exp(sc, 0, len - 1, mx);
#else
    float sum = 0.0f;
    for (int64_t t = 0; t < len; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
#endif
    const float inv = 1.0f / sum;
    for (int64_t t = 0; t < len; t++) sc[t] *= inv;
    for (int64_t t = len; t < T; t++) sc[t] = 0.0f;
}

static PyObject *pk_py_softmax_causal(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) { PyErr_SetString(PyExc_TypeError, "softmax_causal(scores, n, start, threads)"); return NULL; }
    const int64_t n = PyLong_AsLongLong(args[1]), start = PyLong_AsLongLong(args[2]);
    const long threads = PyLong_AsLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer b = {0};
    if (PyObject_GetBuffer(args[0], &b, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_ND) < 0) return NULL;
    PyObject *ret = NULL;
    const int64_t R = b.ndim == 2 ? b.shape[0] : 0, T = b.ndim == 2 ? b.shape[1] : 0;
    if (R < 1 || T < 1 || b.len != R * T * 4 || n < 1 || R % n || start < 0 || start + n > T || threads < 0) {
        PyErr_SetString(PyExc_ValueError, "softmax_causal needs float32 [R, T] with R % n == 0 and start + n <= T");
        goto done;
    }
    float *s = b.buf;
    const int nt = threads ? (int)threads : pk_threads;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(static) num_threads(R * T < SERIAL_WORK ? 1 : nt)
    for (int64_t r = 0; r < R; r++) softmax_row(s + r * T, start + r % n + 1, T);
    Py_END_ALLOW_THREADS
    ret = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&b);
    return ret;
}

#endif /* POLY_ATTENTION_SOFTMAX_H */

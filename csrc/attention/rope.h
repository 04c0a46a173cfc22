/* rope for the prefill path (poly.runtime.ckernels.rope_inplace): serial, no OpenMP (it runs
 * between BLAS calls). */
#ifndef POLY_ATTENTION_ROPE_H
#define POLY_ATTENTION_ROPE_H
#include "core/common.h"

/* rope(x, cos, sin, start): x float32 [n, heads, hd] rotated in place at positions start.. */
static PyObject *pk_py_rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) { PyErr_SetString(PyExc_TypeError, "rope(x, cos, sin, start, n, hd)"); return NULL; }
    const int64_t start = PyLong_AsLongLong(args[3]), n = PyLong_AsLongLong(args[4]), hd = PyLong_AsLongLong(args[5]);
    if (PyErr_Occurred()) return NULL;
    if (start < 0 || n < 1 || hd < 2 || hd % 2) { PyErr_SetString(PyExc_ValueError, "bad rope dims"); return NULL; }
    Py_buffer bx = {0}, bc = {0}, bs = {0};
    PyObject *ret = NULL;
    if (PyObject_GetBuffer(args[0], &bx, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &bc, PyBUF_C_CONTIGUOUS) < 0) goto done_x;
    if (PyObject_GetBuffer(args[2], &bs, PyBUF_C_CONTIGUOUS) < 0) goto done_c;
    const int64_t half = hd / 2, heads = bx.len / (4 * n * hd);
    if (heads < 1 || bx.len != heads * n * hd * 4 || bc.len != bs.len || bc.len < (start + n) * half * 4) {
        PyErr_SetString(PyExc_ValueError, "rope buffers do not match [n, heads, hd] and the tables");
        goto done_s;
    }
    float *x = bx.buf;
    const float *cs = bc.buf, *sn = bs.buf;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n; i++) {
        const float *c = cs + (start + i) * half, *s = sn + (start + i) * half;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + (i * heads + h) * hd;
            for (int64_t j = 0; j < half; j++) {
                const float x1 = v[j], x2 = v[j + half];
                v[j] = x1 * c[j] - x2 * s[j];
                v[j + half] = x2 * c[j] + x1 * s[j];
            }
        }
    }
    Py_END_ALLOW_THREADS
    ret = Py_NewRef(Py_None);
done_s:
    PyBuffer_Release(&bs);
done_c:
    PyBuffer_Release(&bc);
done_x:
    PyBuffer_Release(&bx);
    return ret;
}

#endif /* POLY_ATTENTION_ROPE_H */

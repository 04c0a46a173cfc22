/* gemm's Python entry (poly.runtime.ckernels.gemm): argument checks, then gemm_any. */
#ifndef POLY_GEMM_PYTHON_H
#define POLY_GEMM_PYTHON_H
#include "core/common.h"
#include "formats/kinds.h"
#include "core/matrix_check.h"
#include "formats/kquant_interleave8_panels.h"
#include "gemm/dequant.h"
#include "matmul/entry.h"
#include "gemm/gemm.h"

/* gemm(kind, x, out, w, aux, n, k, m, threads): shapes and byte sizes checked like dequantize's */
static PyObject *pk_py_gemm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 9 || nargs > 11) {
        PyErr_SetString(PyExc_TypeError, "gemm(kind, x, out, w, aux, n, k, m, threads[, q8[, rp]])");
        return NULL;
    }
    const long kind = PyLong_AsLong(args[0]), nt = PyLong_AsLong(args[8]), q8 = nargs >= 10 ? PyLong_AsLong(args[9]) : 0;
    const int64_t n = PyLong_AsLongLong(args[5]), k = PyLong_AsLongLong(args[6]), m = PyLong_AsLongLong(args[7]);
    if (PyErr_Occurred()) return NULL;
    if (kind < 0 || kind >= K_COUNT || n < 1 || k < 1 || m < 1 || nt < 0) {
        PyErr_SetString(PyExc_ValueError, "bad kind, shape or threads");
        return NULL;
    }
    const int scaled = KINDS[kind]->aux != AUX_NONE; /* the kinds with a scales array */
    if (scaled != (args[4] != Py_None)) {
        PyErr_SetString(PyExc_ValueError, "int8 rows and Loom Q4 need their scales; other kinds take none");
        return NULL;
    }
    if (KINDS[kind]->flat && k % 32) {
        PyErr_SetString(PyExc_ValueError, "Loom Q4 rows must hold whole blocks");
        return NULL;
    }
    Py_buffer bx = {0}, bo = {0}, bw = {0}, ba = {0}, br = {0};
    PyObject *orp = nargs == 11 ? args[10] : Py_None; /* rows repacked by 16 (csrc/formats/interleave16.h) or 8 (formats/kquant_interleave8_panels.h) */
    int hk = 0;
    const int by8 = KINDS[kind]->kil8 != KIL8_NONE;
    const int64_t nrp = by8 ? kil8_bytes((int)kind, m, k) : rp_bytes((int)kind, m, k, &hk);
    if (orp != Py_None && nrp < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "rp: Q4_0/Q4_1/Q8_0/int8 rows by 16, float32/float16 by 16 on SIMD builds, Q4_K/Q6_K by 8");
        return NULL;
    }
    PyObject *ret = NULL;
    mm_args A = {0};
    A.n = n; A.k = k; A.m = m;
    if (PyObject_GetBuffer(args[1], &bx, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[2], &bo, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done_x;
    if (PyObject_GetBuffer(args[3], &bw, PyBUF_C_CONTIGUOUS) < 0) goto done_o;
    if (scaled && PyObject_GetBuffer(args[4], &ba, PyBUF_C_CONTIGUOUS) < 0) goto done_w;
    if (check_sizes((int)kind, &bx, &bo, &bw, scaled ? &ba : NULL, &A) < 0) goto done_a;
    dq_args D = {0};
    D.w = bw.buf; D.aux = scaled ? ba.buf : NULL; D.k = k; D.rb = A.rb; D.r0 = 0; D.r1 = m;
    if (orp != Py_None) {
        if (PyObject_GetBuffer(orp, &br, PyBUF_C_CONTIGUOUS) < 0) goto done_a;
        if (want_len(&br, nrp, "rp")) { PyBuffer_Release(&br); goto done_a; }
        if (hk) D.hk = br.buf;
        else if (by8) D.rk = br.buf;
        else D.rp = br.buf;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = gemm_any((int)kind, &D, bx.buf, n, bo.buf, m, nt ? (int)nt : pk_threads, (int)q8);
    Py_END_ALLOW_THREADS
    if (br.buf) PyBuffer_Release(&br);
    if (rc < 0) PyErr_NoMemory();
    else ret = Py_NewRef(Py_None);
done_a:
    if (scaled) PyBuffer_Release(&ba);
done_w:
    PyBuffer_Release(&bw);
done_o:
    PyBuffer_Release(&bo);
done_x:
    PyBuffer_Release(&bx);
    return ret;
}

#endif /* POLY_GEMM_PYTHON_H */

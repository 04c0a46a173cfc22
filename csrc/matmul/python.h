/* The Python entries of the row products: matmul, dequantize and the k-major copy (km16). */
#ifndef POLY_MATMUL_PYTHON_H
#define POLY_MATMUL_PYTHON_H
#include "core/common.h"
#include "formats/kinds.h"
#include "formats/kquant_rows.h"
#include "core/matrix_check.h"
#include "formats/kquant_panels.h"
#include "formats/vdpbf16_rows.h"
#include "formats/interleave16.h"
#include "formats/interleave16_range.h"
#include "gemm/dequant.h"
#include "matmul/entry.h"
#include "formats/float_kmajor16.h"
#include "gemm/gemm.h"
static PyObject *py_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 9 && nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "matmul(kind, x, out, w, aux, n, k, m, q8[, rp])");
        return NULL;
    }
    long kind = PyLong_AsLong(args[0]);
    mm_args A = {0};
    A.n = PyLong_AsLongLong(args[5]); A.k = PyLong_AsLongLong(args[6]); A.m = PyLong_AsLongLong(args[7]);
    A.ldo = A.m;
    long q8 = PyLong_AsLong(args[8]); /* 0 float, 1 int8 activations, 2 auto (K-quants); | Q8_EXACT_BFLOAT16 */
    if (q8 == -1 && PyErr_Occurred()) return NULL;
    const int q8in = (int)q8;
    q8 &= 3;
    /* rp: the rows repacked by 16 (csrc/formats/interleave16.h), read instead of w unless q8 is 0 */
    int hk; /* rows laid out by 16 (csrc/formats/float_kmajor16.h): read whatever q8 */
    const int64_t nrp = rp_bytes((int)kind, A.m, A.k, &hk);
    PyObject *orp = nargs == 10 && ((q8 && PK_IL16) || hk) ? args[9] : Py_None;
    const int valid = kind >= 0 && kind < K_COUNT;
    const int kqp = valid && q8 == 2 && kqp_fits((int)kind, A.k) && A.n >= KQP_MIN && A.n <= KQP_MAX; /* int8 panels */
    A.x1 = q8 == 2; /* as the fused step: K-quant, Q5_0/Q5_1/IQ4 rows on x's first code in the auto mode */
    if (q8 == 2) /* as the fused step */
        q8 = valid && (k8_kind((int)kind) || (PK_SIMD && pq8_kind((int)kind)) || (PK_LOOM8 && KINDS[kind]->loom8)) && A.n <= K8_ROWS;
    if (kind < 0 || kind >= K_COUNT || A.n < 1 || A.n > MAX_N || A.k < 1 || A.m < 0) {
        PyErr_SetString(PyExc_ValueError, "bad kind or shape");
        return NULL;
    }
    if (orp != Py_None && nrp < 0) {
        PyErr_SetString(PyExc_ValueError, "rp: Q4_0/Q4_1/Q8_0/int8 rows by 16, float32/float16 by 16 on SIMD builds");
        return NULL;
    }
    Py_buffer bx = {0}, bo = {0}, bw = {0}, ba = {0}, br = {0};
    PyObject *ret = NULL;
    int have_aux = args[4] != Py_None;
    if (PyObject_GetBuffer(args[1], &bx, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[2], &bo, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done_x;
    if (PyObject_GetBuffer(args[3], &bw, PyBUF_C_CONTIGUOUS) < 0) goto done_o;
    if (have_aux && PyObject_GetBuffer(args[4], &ba, PyBUF_C_CONTIGUOUS) < 0) goto done_w;
    if (KINDS[kind]->aux && !have_aux) {
        PyErr_SetString(PyExc_ValueError, "this kind needs its scales");
        goto done_a;
    }
    if (check_sizes((int)kind, &bx, &bo, &bw, &ba, &A) < 0) goto done_a;
    A.x = bx.buf; A.out = bo.buf; A.w = bw.buf; A.aux = have_aux ? ba.buf : NULL;
    if (orp != Py_None) {
        if (PyObject_GetBuffer(orp, &br, PyBUF_C_CONTIGUOUS) < 0) goto done_a;
        if (want_len(&br, nrp, "rp")) { PyBuffer_Release(&br); goto done_a; }
    }
    int rc;
    uint16_t *xb = NULL; /* a prompt's BF16 rows on vdpbf16ps, as the fused step (csrc/formats/vdpbf16_rows.h) */
    if (bf16_rows((int)kind, q8in, A.k) && bf16_tiles(A.n) && !(xb = malloc((size_t)(A.n * A.k) * 2))) {
        if (br.buf) PyBuffer_Release(&br);
        PyErr_NoMemory();
        goto done_a;
    }
    for (int64_t i = 0; xb && i < A.n; i++) bf16_x(A.x + i * A.k, A.k, xb + i * A.k);
    A.xb = xb;
    Py_BEGIN_ALLOW_THREADS
    if (hk && br.buf) {
        rc = 0;
#pragma omp parallel num_threads(A.m * A.k < SERIAL_WORK ? 1 : pk_threads)
        km16_range((int)kind, br.buf, A.k, A.x, A.k, A.n, A.out, A.m, A.m * pk_tid() / pk_nth(), A.m * (pk_tid() + 1) / pk_nth());
    } else if (kqp) {
        const dq_args D = {A.w, A.aux, NULL, A.k, A.rb, 0, A.m};
        rc = gemm_any((int)kind, &D, A.x, A.n, A.out, A.m, pk_threads, 2);
    } else
        rc = run((int)kind, &A, pk_threads, q8 != 0, br.buf);
    Py_END_ALLOW_THREADS
    free(xb);
    if (br.buf) PyBuffer_Release(&br);
    if (rc < 0) PyErr_NoMemory();
    else ret = Py_NewRef(Py_None);
done_a:
    if (have_aux) PyBuffer_Release(&ba);
done_w:
    PyBuffer_Release(&bw);
done_o:
    PyBuffer_Release(&bo);
done_x:
    PyBuffer_Release(&bx);
    return ret;
}

/* dequantize(kind, w, aux, m, k, r0, r1, out, threads): rows [r0, r1) of the [m, k] matrix into
 * out; threads 0 = the set_threads value (1 before a BLAS call: idle OpenMP threads spin and
 * starve OpenBLAS's threads on a small machine, measured 7 vs 200+ tok/s prefill) */
static PyObject *py_dequantize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 9) { PyErr_SetString(PyExc_TypeError, "dequantize(kind, w, aux, m, k, r0, r1, out, threads)"); return NULL; }
    long nt = PyLong_AsLong(args[8]);
    long kind = PyLong_AsLong(args[0]);
    int64_t m = PyLong_AsLongLong(args[3]), k = PyLong_AsLongLong(args[4]);
    dq_args A = {0};
    A.k = k; A.r0 = PyLong_AsLongLong(args[5]); A.r1 = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred()) return NULL;
    if (kind < 0 || kind >= K_COUNT || m < 0 || k < 1 || nt < 0 || A.r0 < 0 || A.r0 > A.r1 || A.r1 > m) {
        PyErr_SetString(PyExc_ValueError, "bad kind, shape or row range");
        return NULL;
    }
    if (!KINDS[kind]->flat && k % BLOCK_ELEMS[kind]) {
        PyErr_Format(PyExc_ValueError, "k=%lld is not a multiple of %d", (long long)k, BLOCK_ELEMS[kind]);
        return NULL;
    }
    const int have_aux = args[2] != Py_None;
    if (KINDS[kind]->aux && !have_aux) {
        PyErr_SetString(PyExc_ValueError, "this kind needs its scales");
        return NULL;
    }
    Py_buffer bw = {0}, ba = {0}, bo = {0};
    PyObject *ret = NULL;
    if (PyObject_GetBuffer(args[1], &bw, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (have_aux && PyObject_GetBuffer(args[2], &ba, PyBUF_C_CONTIGUOUS) < 0) goto done_w;
    if (PyObject_GetBuffer(args[7], &bo, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done_a;
    const int64_t nb = (m * k + 31) / 32; /* Loom Q4 blocks of the flat matrix */
    A.rb = KINDS[kind]->flat ? 0 : (kind <= K_I8 ? k * ELEM_BYTES[kind] : k / BLOCK_ELEMS[kind] * BLOCK_BYTES[kind]);
    if (want_len(&bo, (A.r1 - A.r0) * k * 4, "out")) goto done_o;
    if (want_len(&bw, KINDS[kind]->flat ? nb * 16 : m * A.rb, "w")) goto done_o;
    if (kind == K_I8 && want_len(&ba, m * 4, "row scales")) goto done_o;
    if (KINDS[kind]->aux == AUX_BLOCKS && want_len(&ba, nb * 4, "block scales")) goto done_o;
    A.w = bw.buf; A.aux = have_aux ? ba.buf : NULL; A.out = bo.buf;
    Py_BEGIN_ALLOW_THREADS
    dq_rows((int)kind, &A, nt ? (int)nt : pk_threads);
    Py_END_ALLOW_THREADS
    ret = Py_NewRef(Py_None);
done_o:
    PyBuffer_Release(&bo);
done_a:
    if (have_aux) PyBuffer_Release(&ba);
done_w:
    PyBuffer_Release(&bw);
    return ret;
}

/* rows [m, k] of T as [m / 16, k, 16] (csrc/formats/float_kmajor16.h), 16 rows x 64 elements a block */
#define KM16_COPY(T)                                                                                 \
    do {                                                                                            \
        const T *s = (const T *)bs.buf;                                                             \
        T *d = (T *)bd.buf;                                                                         \
        _Pragma("omp parallel for num_threads(pk_threads) schedule(static)")                        \
        for (int64_t g = 0; g < m / 16; g++)                                                        \
            for (int64_t c = 0; c < k; c += 64)                                                     \
                for (int64_t r = 0; r < 16; r++)                                                    \
                    for (int64_t kk = c; kk < k && kk < c + 64; kk++) d[(g * k + kk) * 16 + r] = s[(g * 16 + r) * k + kk]; \
    } while (0)

/* float_kmajor16(src, dst, m, k, esz) (py_km16): rows [m, k] of esz-byte elements (2: float16, 4: float32) laid out by
 * 16, k-major (csrc/formats/float_kmajor16.h), into dst */
static PyObject *py_km16(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) { PyErr_SetString(PyExc_TypeError, "float_kmajor16(src, dst, m, k, esz)"); return NULL; }
    const int64_t m = PyLong_AsLongLong(args[2]), k = PyLong_AsLongLong(args[3]), esz = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (m < 0 || m % 16 || k < 1 || (esz != 2 && esz != 4)) {
        PyErr_SetString(PyExc_ValueError, "float_kmajor16: rows a multiple of 16, elements of 2 or 4 bytes");
        return NULL;
    }
    Py_buffer bs = {0}, bd = {0};
    PyObject *ret = NULL;
    if (PyObject_GetBuffer(args[0], &bs, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &bd, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done_s;
    if (want_len(&bs, m * k * esz, "src") || want_len(&bd, m * k * esz, "dst")) goto done_d;
    Py_BEGIN_ALLOW_THREADS
    if (esz == 2) KM16_COPY(uint16_t);
    else KM16_COPY(uint32_t);
    Py_END_ALLOW_THREADS
    ret = Py_NewRef(Py_None);
done_d:
    PyBuffer_Release(&bd);
done_s:
    PyBuffer_Release(&bs);
    return ret;
}

#endif /* POLY_MATMUL_PYTHON_H */

/* poly.runtime.native.ckernels: out[n, m] = x[n, k] @ W.T for few input rows (decode, batched decode),
 * reading W in its stored form, parallel over output rows with OpenMP.
 *
 * One entry point, matmul(kind, x, out, w, aux, n, k, m): buffers are taken with the buffer
 * protocol and their byte sizes checked against (kind, n, k, m) here, so a wrong call raises
 * ValueError instead of reading out of bounds (poly/ckernels.py validates dtypes first and
 * raises poly errors). Sums are float32 with many independent lanes (AVX2/FMA when compiled
 * for it, otherwise plain loops gcc vectorizes).
 *
 * Quantized kinds are read as 32-element blocks: value = q * D + M with q the block's codes,
 * D a scale and M an offset, so sum_j w_j x_j = D * (q . x) + M * sum(x block).
 */
#include "pk_kernels.h"

static int pk_threads = 1;

#include "pk_ranges.h"
#include "pk_r16.h"
#include "pk_r8k.h"

/* rows [0, m) split over nt threads, each range through the fused step's range function f
 * (pairs and quads of rows as there, so both give the same sums) */
static void run_rows(range_fn f, const mm_args *A, int nt) {
#pragma omp parallel num_threads(nt)
    {
        const int tid = pk_tid(), nth = pk_nth();
        f(A, A->m * tid / nth, A->m * (tid + 1) / nth);
    }
}

#include "pk_dequant.h"

/* ---- Python glue -------------------------------------------------------------------------- */

/* silu_mul(gate_up, out) with gate_up [n, 2I], or silu_mul(gate, out, up) with two [n, I]
 * arrays (the GGUF models' separate projections, no concatenated copy): out = silu(gate) * up,
 * rows split over the threads */
static PyObject *pk_py_silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2 && nargs != 3) { PyErr_SetString(PyExc_TypeError, "silu_mul(gate_up, out[, up])"); return NULL; }
    Py_buffer bg = {0}, bo = {0}, bu = {0};
    PyObject *ret = NULL;
    if (PyObject_GetBuffer(args[0], &bg, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &bo, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done_g;
    if (nargs == 3 && PyObject_GetBuffer(args[2], &bu, PyBUF_C_CONTIGUOUS) < 0) goto done_o;
    const Py_ssize_t rows = bo.ndim == 2 ? bo.shape[0] : 0, I = bo.ndim == 2 ? bo.shape[1] : 0;
    const int two = nargs == 3; /* gate and up apart */
    if (rows < 1 || I < 1 || bo.len != rows * I * 4 || bg.len != (two ? 1 : 2) * bo.len || (two && bu.len != bo.len)) {
        PyErr_SetString(PyExc_ValueError, "silu_mul needs gate_up [n, 2I] (or gate, up [n, I]) and out [n, I] float32");
        goto done_u;
    }
    const float *g = bg.buf, *u = two ? (const float *)bu.buf : g + I;
    const int64_t gs = two ? I : 2 * I; /* row strides of gate and up */
    float *o = bo.buf;
    const int nt = rows * I < SERIAL_WORK ? 1 : pk_threads;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(nt) schedule(static)
    for (Py_ssize_t r = 0; r < rows; r++) silu_mul(g + r * gs, u + r * gs, o + r * I, I);
    Py_END_ALLOW_THREADS
    ret = Py_NewRef(Py_None);
done_u:
    if (two) PyBuffer_Release(&bu);
done_o:
    PyBuffer_Release(&bo);
done_g:
    PyBuffer_Release(&bg);
    return ret;
}

static int check_sizes(int kind, Py_buffer *bx, Py_buffer *bo, Py_buffer *bw, Py_buffer *ba, mm_args *A) {
    if (want_len(bx, A->n * A->k * 4, "x") || want_len(bo, A->n * A->m * 4, "out")) return -1;
    return check_matrix(kind, bw, ba, A);
}

static int run(int kind, mm_args *A, int nt, int q8, const uint8_t *rp) {
    float *scratch = NULL;
    if (rp) q8 = 1; /* the repacked rows read x's int8 codes */
    if (kind == K_I8 && q8 && PK_SIMD && A->k % 32 == 0) A->nb = A->k / 32;
    else if (kind <= K_I8) q8 = 0;
    if (!PK_SIMD || !RF8[kind]) q8 = 0; /* kinds without an int8 kernel: the float path */
    if (kind > K_I8 || q8) {
        const int64_t nk = A->n * A->k, nbs = A->n * A->nb, ng = q8 && k8_kind(kind) && A->x1 ? nbs / 8 : 0;
        scratch = malloc((size_t)(4 * nbs + nk + ng) * 4 + 2 * nk + ng * XK_BYTES + 64);
        if (!scratch) return -1;
        float *xs = scratch, *dx = scratch + nbs, *xs16 = scratch + 2 * nbs, *xp = scratch + 4 * nbs;
        for (int64_t i = 0; i < nbs; i++) {
            float t = 0.0f;
            for (int l = 0; l < 32; l++) t += A->x[i * 32 + l];
            xs[i] = t;
        }
        A->xs = xs;
        if (kind == K_LOOM_Q4 && !rp) { loom_order(A->x, xp, nk); A->x = xp; } /* repacked: Q4_0's order */
        if (q8) {
            int8_t *xq = (int8_t *)(xp + nk);
            quantize_x(A->x, xq, dx, nbs);
            if (!A->x1) sums16(A->x, xs16, nbs); /* the two-code K-quant rows' offsets */
            A->xq = xq; A->dx = dx; A->xs16 = xs16;
            if (ng) { /* the K-quant rows' codes per 256, as the fused step's prep (q8 group 3) */
                float *dk = xp + nk + nk / 2;
                int8_t *xk = (int8_t *)(dk + ng);
                quantize_k(A->x, xk, dk, 0, ng);
                A->xk = xk; A->dk = dk;
            }
        }
    }
    if (A->m * A->k < SERIAL_WORK) nt = 1;
    if (rp) { /* as the fused step: whole groups of 16 rows per thread's range (csrc/pk_r16.h) */
        int bad = 0;
#pragma omp parallel num_threads(nt) reduction(| : bad)
        bad |= r16_range(kind, A, rp, A->m * pk_tid() / pk_nth(), A->m * (pk_tid() + 1) / pk_nth());
        free(scratch);
        return bad ? -1 : 0;
    }
    const int64_t piece = q8 || A->xb ? A->n : row_piece(A); /* pieces of rows that stay in L1 */
    for (int64_t c = 0; c < A->n; c += piece) {
        mm_args P = *A;
        P.n = A->n - c < piece ? A->n - c : piece;
        P.x = A->x + c * A->k;
        P.xs = A->xs ? A->xs + c * A->nb : NULL;
        P.out = A->out + c * A->ldo;
        run_rows((q8 ? RF8 : RF)[kind], &P, nt);
    }
    free(scratch);
    return 0;
}

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
    long q8 = PyLong_AsLong(args[8]); /* 0 float, 1 int8 activations, 2 auto (K-quants); | Q8_EXACT_BF16 */
    if (q8 == -1 && PyErr_Occurred()) return NULL;
    const int q8in = (int)q8;
    q8 &= 3;
    /* rp: the rows repacked by 16 (csrc/pk_r16.h), read instead of w unless q8 is 0 */
    int hk; /* rows laid out by 16 (csrc/pk_k16.h): read whatever q8 */
    const int64_t nrp = rp_bytes((int)kind, A.m, A.k, &hk);
    PyObject *orp = nargs == 10 && ((q8 && PK_R16) || hk) ? args[9] : Py_None;
    const int k8i = q8 == 2 && k8i_fits((int)kind, A.k) && A.n >= K8I_MIN && A.n <= K8I_MAX; /* int8 panels */
    A.x1 = q8 == 2; /* as the fused step: K-quant, Q5_0/Q5_1/IQ4 rows on x's first code in the auto mode */
    if (q8 == 2) /* as the fused step */
        q8 = (k8_kind((int)kind) || (PK_SIMD && pq8_kind((int)kind)) || (PK_LOOM8 && kind == K_LOOM_Q4)) && A.n <= K8_ROWS;
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
    if ((kind == K_I8 || kind == K_LOOM_Q4) && !have_aux) {
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
    uint16_t *xb = NULL; /* a prompt's BF16 rows on vdpbf16ps, as the fused step (csrc/pk_bf16.h) */
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
        k16_range((int)kind, br.buf, A.k, A.x, A.k, A.n, A.out, A.m, A.m * pk_tid() / pk_nth(), A.m * (pk_tid() + 1) / pk_nth());
    } else if (k8i) {
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
    if (kind > K_LOOM_Q4 && k % BLOCK_ELEMS[kind]) {
        PyErr_Format(PyExc_ValueError, "k=%lld is not a multiple of %d", (long long)k, BLOCK_ELEMS[kind]);
        return NULL;
    }
    const int have_aux = args[2] != Py_None;
    if ((kind == K_I8 || kind == K_LOOM_Q4) && !have_aux) {
        PyErr_SetString(PyExc_ValueError, "this kind needs its scales");
        return NULL;
    }
    Py_buffer bw = {0}, ba = {0}, bo = {0};
    PyObject *ret = NULL;
    if (PyObject_GetBuffer(args[1], &bw, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (have_aux && PyObject_GetBuffer(args[2], &ba, PyBUF_C_CONTIGUOUS) < 0) goto done_w;
    if (PyObject_GetBuffer(args[7], &bo, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done_a;
    const int64_t nb = (m * k + 31) / 32; /* Loom Q4 blocks of the flat matrix */
    A.rb = kind == K_LOOM_Q4 ? 0 : (kind <= K_I8 ? k * ELEM_BYTES[kind] : k / BLOCK_ELEMS[kind] * BLOCK_BYTES[kind]);
    if (want_len(&bo, (A.r1 - A.r0) * k * 4, "out")) goto done_o;
    if (want_len(&bw, kind == K_LOOM_Q4 ? nb * 16 : m * A.rb, "w")) goto done_o;
    if (kind == K_I8 && want_len(&ba, m * 4, "row scales")) goto done_o;
    if (kind == K_LOOM_Q4 && want_len(&ba, nb * 4, "block scales")) goto done_o;
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

/* rows [m, k] of T as [m / 16, k, 16] (csrc/pk_k16.h), 16 rows x 64 elements a block */
#define K16_COPY(T)                                                                                 \
    do {                                                                                            \
        const T *s = (const T *)bs.buf;                                                             \
        T *d = (T *)bd.buf;                                                                         \
        _Pragma("omp parallel for num_threads(pk_threads) schedule(static)")                        \
        for (int64_t g = 0; g < m / 16; g++)                                                        \
            for (int64_t c = 0; c < k; c += 64)                                                     \
                for (int64_t r = 0; r < 16; r++)                                                    \
                    for (int64_t kk = c; kk < k && kk < c + 64; kk++) d[(g * k + kk) * 16 + r] = s[(g * 16 + r) * k + kk]; \
    } while (0)

/* k16(src, dst, m, k, esz): rows [m, k] of esz-byte elements (2: float16, 4: float32) laid out by
 * 16, k-major (csrc/pk_k16.h), into dst */
static PyObject *py_k16(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) { PyErr_SetString(PyExc_TypeError, "k16(src, dst, m, k, esz)"); return NULL; }
    const int64_t m = PyLong_AsLongLong(args[2]), k = PyLong_AsLongLong(args[3]), esz = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (m < 0 || m % 16 || k < 1 || (esz != 2 && esz != 4)) {
        PyErr_SetString(PyExc_ValueError, "k16: rows a multiple of 16, elements of 2 or 4 bytes");
        return NULL;
    }
    Py_buffer bs = {0}, bd = {0};
    PyObject *ret = NULL;
    if (PyObject_GetBuffer(args[0], &bs, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &bd, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done_s;
    if (want_len(&bs, m * k * esz, "src") || want_len(&bd, m * k * esz, "dst")) goto done_d;
    Py_BEGIN_ALLOW_THREADS
    if (esz == 2) K16_COPY(uint16_t);
    else K16_COPY(uint32_t);
    Py_END_ALLOW_THREADS
    ret = Py_NewRef(Py_None);
done_d:
    PyBuffer_Release(&bd);
done_s:
    PyBuffer_Release(&bs);
    return ret;
}

static PyObject *py_set_threads(PyObject *self, PyObject *arg) {
    (void)self;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1) { PyErr_SetString(PyExc_ValueError, "threads must be >= 1"); return NULL; }
    pk_threads = (int)n;
    return PyLong_FromLong(pk_threads);
}

static PyObject *py_info(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
#ifdef _OPENMP
    int omp = 1;
#else
    int omp = 0;
#endif
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}", "simd", PK_SIMD, "openmp", omp, "threads", pk_threads, "r16", PK_R16, "k16", K16_KINDS,
                         "r8k", PK_R8K, "r16p", PK_R16P, "gemm_rows", GEMM_ROWS, "loom8", PK_LOOM8, "bf16", bf16_rows(K_BF16, 2, 2));
}

static PyMethodDef methods[] = {
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_FASTCALL, "out = x @ W.T (see poly.runtime.ckernels)"},
    {"dequantize", (PyCFunction)(void (*)(void))py_dequantize, METH_FASTCALL, "rows [r0, r1) as float32"},
    {"gemm", (PyCFunction)(void (*)(void))pk_py_gemm, METH_FASTCALL, "out = x @ W.T, any rows (csrc/pk_gemm.h)"},
    {"softmax_causal", (PyCFunction)(void (*)(void))pk_py_softmax_causal, METH_FASTCALL, "prefill attention weights in place"},
    {"decode", (PyCFunction)(void (*)(void))pk_py_decode, METH_FASTCALL, "one decode step of a whole model (see csrc/pk_decode.c)"},
    {"rope", (PyCFunction)(void (*)(void))pk_py_rope, METH_FASTCALL, "rotate [n, heads, hd] in place (HF half split)"},
    {"silu_mul", (PyCFunction)(void (*)(void))pk_py_silu_mul, METH_FASTCALL, "out = silu(gate) * up from [n, 2I], or from gate and up"},
    {"k16", (PyCFunction)(void (*)(void))py_k16, METH_FASTCALL, "float16/float32 rows laid out by 16, k-major (csrc/pk_k16.h)"},
    {"set_threads", py_set_threads, METH_O, "threads for the parallel row loop"},
    {"info", py_info, METH_NOARGS, "build facts: simd, openmp, threads"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "ckernels", NULL, -1, methods};
/* This instruction set's module (PK_MAKER names it: pk_make_avx2, ...; see csrc/pk_module.c). */
PyObject *PK_MAKER(void) { return PyModule_Create(&moddef); }

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
#ifndef POLY_MATMUL_ENTRY_H
#define POLY_MATMUL_ENTRY_H
#include "core/common.h"
#include "formats/kinds.h"
#include "rows/quant_tiles.h"
#include "formats/kquant_rows.h"
#include "core/matrix_check.h"
#include "core/activations.h"
#include "rows/ranges.h"
#include "formats/interleave16.h"
#include "formats/interleave16_avx2.h"
#include "formats/interleave16_range.h"
#include "rows/run.h"
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
        if (KINDS[kind]->flat && !rp) { loom_order(A->x, xp, nk); A->x = xp; } /* repacked: Q4_0's order */
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
    if (rp) { /* as the fused step: whole groups of 16 rows per thread's range (csrc/formats/interleave16.h) */
        int bad = 0;
#pragma omp parallel num_threads(nt) reduction(| : bad)
        bad |= il16_range(kind, A, rp, A->m * pk_tid() / pk_nth(), A->m * (pk_tid() + 1) / pk_nth());
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

#endif /* POLY_MATMUL_ENTRY_H */

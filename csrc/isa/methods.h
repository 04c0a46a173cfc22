/* The module's method table and this instruction set's module maker (isa/unit.h is the build unit). */
#ifndef POLY_ISA_METHODS_H
#define POLY_ISA_METHODS_H
#include "core/common.h"
#include "formats/vdpbf16_rows.h"
#include "formats/interleave16.h"
#include "formats/interleave16_avx2.h"
#include "formats/interleave16_range.h"
#include "formats/kquant_interleave8.h"
#include "gemm/dequant.h"
#include "matmul/entry.h"
#include "gemm/python.h"
#include "matmul/python.h"
#include "decode/args.h"
#include "attention/rope.h"
#include "attention/softmax.h"
static PyObject *py_set_threads(PyObject *self, PyObject *arg) {
    (void)self;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1) { PyErr_SetString(PyExc_ValueError, "threads must be >= 1"); return NULL; }
    pk_threads = (int)n;
    return PyLong_FromLong(pk_threads);
}

/* setup.py's hash of the sources, compiler and flags: the same build wherever it is installed */
#ifndef PK_BUILD_KEY
#define PK_BUILD_KEY ""
#endif

static PyObject *py_info(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
#ifdef _OPENMP
    int omp = 1;
#else
    int omp = 0;
#endif
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:s}", "simd", PK_SIMD, "openmp", omp, "threads", pk_threads,
                         "interleave16", PK_IL16, "float_kmajor16", KM16_KINDS, "kquant_interleave8", PK_KIL8,
                         "interleave16_panels", PK_IL16P, "gemm_rows", GEMM_ROWS, "loom8", PK_LOOM8, "bf16", bf16_auto(2),
                         "build", PK_BUILD_KEY);
}

static PyMethodDef methods[] = {
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_FASTCALL, "out = x @ W.T (see poly.runtime.ckernels)"},
    {"dequantize", (PyCFunction)(void (*)(void))py_dequantize, METH_FASTCALL, "rows [r0, r1) as float32"},
    {"gemm", (PyCFunction)(void (*)(void))pk_py_gemm, METH_FASTCALL, "out = x @ W.T, any rows (csrc/gemm/gemm.h)"},
    {"softmax_causal", (PyCFunction)(void (*)(void))pk_py_softmax_causal, METH_FASTCALL, "prefill attention weights in place"},
    {"decode", (PyCFunction)(void (*)(void))pk_py_decode, METH_FASTCALL, "one decode step of a whole model (see csrc/decode/step.h)"},
    {"rope", (PyCFunction)(void (*)(void))pk_py_rope, METH_FASTCALL, "rotate [n, heads, hd] in place (HF half split)"},
    {"silu_mul", (PyCFunction)(void (*)(void))pk_py_silu_mul, METH_FASTCALL, "out = silu(gate) * up from [n, 2I], or from gate and up"},
    {"act", (PyCFunction)(void (*)(void))pk_py_act, METH_FASTCALL, "the fused step's activations on vectors (csrc/decode/recipe.h)"},
    {"float_kmajor16", (PyCFunction)(void (*)(void))py_km16, METH_FASTCALL, "float16/float32 rows laid out by 16, k-major (csrc/formats/float_kmajor16.h)"},
    {"set_threads", py_set_threads, METH_O, "threads for the parallel row loop"},
    {"info", py_info, METH_NOARGS, "build facts: simd, openmp, threads"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "ckernels", NULL, -1, methods};
/* This instruction set's module (PK_MAKER names it: pk_make_avx2, ...; see csrc/module.c). */
PyObject *PK_MAKER(void) { return PyModule_Create(&moddef); }

#endif /* POLY_ISA_METHODS_H */

/* poly.runtime.native.ckernels: picks, at import, the build of the kernels for this CPU.
 *
 * setup.py compiles the kernels once per instruction set (csrc/isa/unit_base.c: plain C;
 * isa/unit_avx2.c: AVX2 + FMA + F16C; isa/unit_avx512.c: AVX-512 F/BW/DQ/VL/VNNI) into one
 * extension. At import cpuid (and the OS's saved register state, XGETBV) says which of them this
 * CPU runs; the best one becomes the module, so a wheel built on one machine never executes an
 * instruction another lacks. POLY_ISA=base|avx2|avx512 caps the choice (e.g. POLY_ISA=avx2 runs
 * the AVX2 kernels on an AVX-512 machine); a cap above what the CPU has is lowered to it.
 *
 * Module attributes: ISA (the build in use), ISAS (the builds this CPU can run, best last), and
 * variant(name) -> that build's module object (tests run every build present). */
#include <Python.h>
#include <stdlib.h>
#include <string.h>

#include "formats/gguf_strings.h"
#include "formats/repack_records.h"
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define PK_X86 1
#else
#define PK_X86 0
#endif

PyObject *pk_make_base(void);
#ifdef PK_HAVE_AVX2
PyObject *pk_make_avx2(void);
#endif
#ifdef PK_HAVE_AVX512
PyObject *pk_make_avx512(void);
#endif

enum { ISA_BASE, ISA_AVX2, ISA_AVX512, ISA_N };
static const char *const NAMES[ISA_N] = {"base", "avx2", "avx512"};
static PyObject *(*const MAKERS[ISA_N])(void) = {
    pk_make_base,
#ifdef PK_HAVE_AVX2
    pk_make_avx2,
#else
    NULL,
#endif
#ifdef PK_HAVE_AVX512
    pk_make_avx512,
#else
    NULL,
#endif
};

/* The best instruction set this CPU and OS run: AVX needs the OS to save YMM state (XCR0 bits
 * 1-2), AVX-512 also the opmask and ZMM state (bits 5-7). */
static int cpu_level(void) {
#if PK_X86
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return ISA_BASE;
    const int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!(osxsave && avx && fma && f16c)) return ISA_BASE;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 6) != 6 || __get_cpuid_max(0, NULL) < 7) return ISA_BASE;
    __cpuid_count(7, 0, a, b, c, d);
    if (!((b >> 5) & 1)) return ISA_BASE; /* AVX2 */
    const unsigned f512 = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31); /* F DQ BW VL */
    if ((b & f512) == f512 && ((c >> 11) & 1) && (lo & 0xe6) == 0xe6) return ISA_AVX512; /* VNNI */
    return ISA_AVX2;
#else
    return ISA_BASE;
#endif
}

static int usable(int isa) { return MAKERS[isa] != NULL && isa <= cpu_level(); }

static int chosen(void) {
    int cap = ISA_N - 1;
    const char *env = getenv("POLY_ISA");
    if (env && *env && strcmp(env, "auto") != 0)
        for (int i = 0; i < ISA_N; i++)
            if (strcmp(env, NAMES[i]) == 0) cap = i;
    for (int i = cap; i > 0; i--)
        if (usable(i)) return i;
    return ISA_BASE;
}

static PyObject *py_variant(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    for (int i = 0; i < ISA_N; i++)
        if (strcmp(name, NAMES[i]) == 0) {
            if (!usable(i)) break;
            PyObject *mod = MAKERS[i]();
            if (mod && PyModule_AddStringConstant(mod, "ISA", NAMES[i]) < 0) Py_CLEAR(mod);
            return mod;
        }
    PyErr_Format(PyExc_ValueError, "no %s build of the kernels runs on this machine", name);
    return NULL;
}

static PyMethodDef extra[] = {
    {"variant", py_variant, METH_O, "the module of one instruction-set build (see ISAS)"},
    {"gguf_strings", (PyCFunction)(void (*)(void))py_gguf_strings, METH_FASTCALL,
     "gguf_strings(buf, pos, count, cap) -> (list of str, end) or None (formats/gguf_strings.h)"},
    {"gguf_strings_end", (PyCFunction)(void (*)(void))py_gguf_strings_end, METH_FASTCALL,
     "gguf_strings_end(buf, pos, count, cap) -> end or None (formats/gguf_strings.h)"},
    {"merge_pairs", (PyCFunction)py_merge_pairs, METH_O,
     "merge_pairs(list of str) -> list of (left, right) or None (formats/gguf_strings.h)"},
    {"repack_records", (PyCFunction)(void (*)(void))py_repack_records, METH_FASTCALL,
     "repack_records(layout, raw, m, k, out): rows by 16 or 8 (formats/repack_records.h)"},
    {NULL, NULL, 0, NULL},
};

PyMODINIT_FUNC PyInit_ckernels(void) {
    const int isa = chosen();
    int n = 0;
    for (int i = 0; i < ISA_N; i++) n += usable(i);
    PyObject *isas = PyTuple_New(n), *mod = NULL;
    for (int i = 0, j = 0; isas && i < ISA_N; i++) {
        if (!usable(i)) continue;
        PyObject *s = PyUnicode_FromString(NAMES[i]);
        if (!s) { Py_CLEAR(isas); break; }
        PyTuple_SET_ITEM(isas, j++, s);
    }
    if (isas) mod = MAKERS[isa]();
    if (mod && (PyModule_AddObjectRef(mod, "ISAS", isas) < 0 ||
                PyModule_AddStringConstant(mod, "ISA", NAMES[isa]) < 0 || PyModule_AddFunctions(mod, extra) < 0))
        Py_CLEAR(mod);
    Py_XDECREF(isas);
    return mod;
}

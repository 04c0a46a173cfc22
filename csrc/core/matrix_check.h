/* A stored matrix's row prefetch and the byte-size checks of the Python entries. */
#ifndef POLY_CORE_MATRIX_CHECK_H
#define POLY_CORE_MATRIX_CHECK_H
#include "core/common.h"
#include "formats/kinds.h"
#include "core/prefetch.h"

/* Called once per row r: asks for the bytes PF_BYTES ahead of row r's, up to the matrix end. */
static inline void prefetch_row(const mm_args *A, int64_t r) {
    const int64_t end = A->m * A->rb, lo = r * A->rb + PF_BYTES;
    const int64_t hi = lo + A->rb < end ? lo + A->rb : end;
    for (int64_t o = lo & ~(int64_t)63; o < hi; o += 64) prefetch_line((const char *)A->w + o);
}

static inline int want_len(Py_buffer *v, int64_t want, const char *what) {
    if (v->len != want) {
        PyErr_Format(PyExc_ValueError, "%s has %zd bytes, expected %lld", what, v->len, (long long)want);
        return -1;
    }
    return 0;
}

/* Byte sizes of a stored [m, k] matrix (and its scales) against its kind; sets A->rb, A->nb. */
static inline int check_matrix(int kind, Py_buffer *bw, Py_buffer *ba, mm_args *A) {
    const int64_t k = A->k, m = A->m;
    if (kind <= K_I8) {
        A->rb = k * ELEM_BYTES[kind];
        A->nb = k / 32;
        if (want_len(bw, m * A->rb, "w")) return -1;
        return kind == K_I8 ? want_len(ba, m * 4, "row scales") : 0;
    }
    if (k % BLOCK_ELEMS[kind]) {
        PyErr_Format(PyExc_ValueError, "k=%lld is not a multiple of %d", (long long)k, BLOCK_ELEMS[kind]);
        return -1;
    }
    A->nb = k / 32;
    A->rb = k / BLOCK_ELEMS[kind] * BLOCK_BYTES[kind];
    if (want_len(bw, m * A->rb, "w")) return -1;
    return KINDS[kind]->aux == AUX_BLOCKS ? want_len(ba, m * A->nb * 4, "block scales") : 0;
}

#endif /* POLY_CORE_MATRIX_CHECK_H */

/* The repacked records of poly/runtime/repack.py made in C: GGUF Q4_0/Q4_1/Q8_0 rows by 16
 * (interleave16.h's records) and Q4_K/Q6_K rows by 8 (kquant_interleave8.h's). The same bytes as
 * repack.py's numpy copies (tests/test_repack_c.py), without numpy's strided copies: an 8B-class
 * file is gigabytes of them on every open its layouts are not cached for. Plain C, one thread:
 * module.c's. */
#ifndef POLY_FORMATS_REPACK_RECORDS_H
#define POLY_FORMATS_REPACK_RECORDS_H
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* One group of 16 rows [16][nb][bb] -> nb records: D[16] (f16 bits), then Q4_1's M[16],
 * then nq 64-byte vectors, byte 4 r + i of vector q = the stored code byte 4 q + i of row r. */
static void il16_group(const uint8_t *rows, int64_t nb, int bb, int nq, int field2, uint8_t *out, int64_t rec) {
    const int at = 32 * (1 + field2);
    for (int r = 0; r < 16; r++) {
        const uint8_t *blk = rows + (int64_t)r * nb * bb;
        for (int64_t b = 0; b < nb; b++, blk += bb) {
            uint8_t *o = out + b * rec;
            memcpy(o + 2 * r, blk, 2);
            if (field2) memcpy(o + 32 + 2 * r, blk + 2, 2);
            const uint8_t *codes = blk + bb - 4 * nq;
            for (int q = 0; q < nq; q++) memcpy(o + at + 64 * q + 4 * r, codes + 4 * q, 4);
        }
    }
}

/* One group of 8 Q4_K rows [8][ns][144] -> ns records of 1184 bytes: D[8], Dmin[8] (f16 bits),
 * the 6-bit scales unpacked (byte 32 + 8 j + r), the mins (byte 96 + 16 i + 2 r + e: sub-block
 * 2 i + e), then 32 vectors of 32 bytes, byte 4 r + b of vector v = code byte 4 v + b of row r. */
static void kil8_group(const uint8_t *rows, int64_t ns, uint8_t *out) {
    for (int r = 0; r < 8; r++) {
        const uint8_t *blk = rows + (int64_t)r * ns * 144;
        for (int64_t s = 0; s < ns; s++, blk += 144) {
            uint8_t *o = out + s * 1184;
            const uint8_t *q = blk + 4;
            memcpy(o + 2 * r, blk, 2);
            memcpy(o + 16 + 2 * r, blk + 2, 2);
            for (int j = 0; j < 4; j++) {
                o[32 + 8 * j + r] = q[j] & 63;
                o[32 + 8 * (j + 4) + r] = (uint8_t)((q[8 + j] & 15) | ((q[j] >> 6) << 4));
                const uint8_t lo = q[4 + j] & 63, hi = (uint8_t)((q[8 + j] >> 4) | ((q[4 + j] >> 6) << 4));
                o[96 + 16 * (j / 2) + 2 * r + (j & 1)] = lo;
                o[96 + 16 * ((j + 4) / 2) + 2 * r + (j & 1)] = hi;
            }
            for (int v = 0; v < 32; v++) memcpy(o + 160 + 32 * v + 4 * r, blk + 16 + 4 * v, 4);
        }
    }
}

/* One group of 8 Q6_K rows [8][ns][210] -> ns records of 1680 bytes: D[8] (f16 bits), the int8
 * scales (byte 16 + 16 i + 2 r + e: 16-group 2 i + e), then per 16-group j three 32-byte vectors:
 * byte 4 r + b of vector 3 j + k = the 6-bit code of element 16 j + 4 k + b, bits 6-7 bits
 * 4 - 2 k, 5 - 2 k of element 16 j + 12 + b's code. */
static void kil8q6_group(const uint8_t *rows, int64_t ns, uint8_t *out) {
    uint8_t c[256];
    for (int r = 0; r < 8; r++) {
        const uint8_t *blk = rows + (int64_t)r * ns * 210;
        for (int64_t s = 0; s < ns; s++, blk += 210) {
            uint8_t *o = out + s * 1680;
            const uint8_t *ql = blk, *qh = blk + 128;
            memcpy(o + 2 * r, blk + 208, 2);
            for (int i = 0; i < 8; i++) memcpy(o + 16 + 16 * i + 2 * r, blk + 192 + 2 * i, 2);
            for (int h = 0; h < 2; h++)
                for (int q = 0; q < 4; q++)
                    for (int l = 0; l < 32; l++)
                        c[128 * h + 32 * q + l] = (uint8_t)(((ql[64 * h + 32 * (q & 1) + l] >> (4 * (q >> 1))) & 15) |
                                                            (((qh[32 * h + l] >> (2 * q)) & 3) << 4));
            for (int j = 0; j < 16; j++)
                for (int k = 0; k < 3; k++)
                    for (int b = 0; b < 4; b++)
                        o[144 + 32 * (3 * j + k) + 4 * r + b] =
                            (uint8_t)(c[16 * j + 4 * k + b] | (uint8_t)((c[16 * j + 12 + b] >> (4 - 2 * k)) << 6));
        }
    }
}

/* repack_records(layout, raw, m, k, out): layout "q4_0" | "q4_1" | "q8_0" (by 16) | "q4_k" |
 * "q6_k" (by 8); raw the [m, row bytes] stored rows, out the records' buffer (writable). */
static PyObject *py_repack_records(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "repack_records(layout, raw, m, k, out)");
        return NULL;
    }
    const char *layout = PyUnicode_AsUTF8(args[0]);
    const int64_t m = PyLong_AsLongLong(args[2]), k = PyLong_AsLongLong(args[3]);
    if (!layout || PyErr_Occurred()) return NULL;
    int bb = 0, nq = 0, field2 = 0, rows = 16, cols = 32;
    int64_t rec = 0;
    if (!strcmp(layout, "q4_0")) bb = 18, nq = 4, rec = 288;
    else if (!strcmp(layout, "q4_1")) bb = 20, nq = 4, field2 = 1, rec = 320;
    else if (!strcmp(layout, "q8_0")) bb = 34, nq = 8, rec = 544;
    else if (!strcmp(layout, "q4_k")) bb = 144, rows = 8, cols = 256, rec = 1184;
    else if (!strcmp(layout, "q6_k")) bb = 210, rows = 8, cols = 256, rec = 1680;
    if (!bb || m <= 0 || k <= 0 || m % rows || k % cols) {
        PyErr_SetString(PyExc_ValueError, "repack_records: unknown layout or shape");
        return NULL;
    }
    Py_buffer in, out;
    if (PyObject_GetBuffer(args[1], &in, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[4], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&in);
        return NULL;
    }
    const int64_t nb = k / cols, groups = m / rows;
    if (in.len != m * nb * bb || out.len != groups * nb * rec) {
        PyErr_SetString(PyExc_ValueError, "repack_records: buffer sizes do not match the shape");
    } else {
        const uint8_t *src = in.buf;
        uint8_t *dst = out.buf;
        Py_BEGIN_ALLOW_THREADS
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *grp = src + g * rows * nb * bb;
            if (bb == 210) kil8q6_group(grp, nb, dst + g * nb * rec);
            else if (rows == 8) kil8_group(grp, nb, dst + g * nb * rec);
            else il16_group(grp, nb, bb, nq, field2, dst + g * nb * rec, rec);
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&in);
    PyBuffer_Release(&out);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

#endif

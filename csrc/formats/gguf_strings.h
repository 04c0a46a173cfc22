/* GGUF string arrays (each a little-endian u64 byte length, then UTF-8 bytes, `count` in a row)
 * as a Python list of str: a vocabulary and its merges are 100-400k strings, which a Python loop
 * reads at ~0.4 us each (entity/gguf/header.py Cursor.strings, its fallback and error path). */
#ifndef POLY_FORMATS_GGUF_STRINGS_H
#define POLY_FORMATS_GGUF_STRINGS_H
#include <Python.h>
#include <stdint.h>

static uint64_t gguf_u64(const unsigned char *p) {
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | p[i];
    return n;
}

/* gguf_strings(buf, pos, count, cap) -> (list, end) | None: None when a string is off (past the
 * end, longer than cap, not UTF-8): the caller's Python loop then raises the precise error. */
static PyObject *py_gguf_strings(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "gguf_strings(buf, pos, count, cap)");
        return NULL;
    }
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) return NULL;
    const Py_ssize_t pos0 = PyLong_AsSsize_t(args[1]), count = PyLong_AsSsize_t(args[2]);
    const unsigned long long cap = PyLong_AsUnsignedLongLong(args[3]);
    PyObject *list = NULL, *ret = NULL;
    if (PyErr_Occurred()) goto done;
    if (pos0 < 0 || pos0 > b.len || count < 0 || count > (b.len - pos0) / 8) goto off;
    if (!(list = PyList_New(count))) goto done;
    const unsigned char *p = b.buf;
    Py_ssize_t pos = pos0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (b.len - pos < 8) goto off;
        const uint64_t n = gguf_u64(p + pos);
        if (n > cap || n > (uint64_t)(b.len - pos - 8)) goto off;
        PyObject *s = PyUnicode_DecodeUTF8((const char *)p + pos + 8, (Py_ssize_t)n, NULL);
        if (!s) {
            if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) goto done;
            PyErr_Clear();
            goto off;
        }
        PyList_SET_ITEM(list, i, s);
        pos += 8 + (Py_ssize_t)n;
    }
    ret = Py_BuildValue("(On)", list, pos);
    goto done;
off:
    ret = Py_NewRef(Py_None);
done:
    Py_XDECREF(list);
    PyBuffer_Release(&b);
    return ret;
}

#endif

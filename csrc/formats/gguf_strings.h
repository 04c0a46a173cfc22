/* GGUF string arrays (each a little-endian u64 byte length, then UTF-8 bytes, `count` in a row)
 * as a Python list of str: a vocabulary and its merges are 100-400k strings, which a Python loop
 * reads one at a time (entity/gguf/header.py Cursor.strings, its fallback and error path). */
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

/* gguf_strings_end(buf, pos, count, cap) -> end | None: where `count` strings from `pos` end, their
 * lengths checked as gguf_strings checks them but their bytes not decoded (a vocabulary read only
 * when its tokenizer is built: entity/gguf/header.py StringArray). */
static PyObject *py_gguf_strings_end(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "gguf_strings_end(buf, pos, count, cap)");
        return NULL;
    }
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) return NULL;
    const Py_ssize_t pos0 = PyLong_AsSsize_t(args[1]), count = PyLong_AsSsize_t(args[2]);
    const unsigned long long cap = PyLong_AsUnsignedLongLong(args[3]);
    PyObject *ret = NULL;
    if (PyErr_Occurred()) goto done;
    if (pos0 < 0 || pos0 > b.len || count < 0 || count > (b.len - pos0) / 8) goto off;
    const unsigned char *p = b.buf;
    Py_ssize_t pos = pos0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (b.len - pos < 8) goto off;
        const uint64_t n = gguf_u64(p + pos);
        if (n > cap || n > (uint64_t)(b.len - pos - 8)) goto off;
        pos += 8 + (Py_ssize_t)n;
    }
    ret = PyLong_FromSsize_t(pos);
    goto done;
off:
    ret = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&b);
    return ret;
}

/* merge_pairs(list of str) -> list of (left, right) | None: a GGUF BPE merge "a b" split at its
 * first space, as tokenizers' BPE takes them; None when an entry is not a str or has no space
 * (entity/gguf/tokenizer.py then names it). */
static PyObject *py_merge_pairs(PyObject *self, PyObject *arg) {
    (void)self;
    if (!PyList_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "merge_pairs(list of str)");
        return NULL;
    }
    const Py_ssize_t n = PyList_GET_SIZE(arg);
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PyList_GET_ITEM(arg, i);
        if (!PyUnicode_Check(s)) goto off;
        const Py_ssize_t len = PyUnicode_GET_LENGTH(s);
        const Py_ssize_t at = PyUnicode_FindChar(s, ' ', 0, len, 1);
        if (at == -2) goto fail;
        if (at < 0) goto off;
        PyObject *a = PyUnicode_Substring(s, 0, at);
        PyObject *b = a ? PyUnicode_Substring(s, at + 1, len) : NULL;
        PyObject *pair = b ? PyTuple_Pack(2, a, b) : NULL;
        Py_XDECREF(a);
        Py_XDECREF(b);
        if (!pair) goto fail;
        PyList_SET_ITEM(out, i, pair);
    }
    return out;
off:
    Py_DECREF(out);
    Py_RETURN_NONE;
fail:
    Py_DECREF(out);
    return NULL;
}

#endif

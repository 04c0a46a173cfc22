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

/* Walks `count` strings from `pos0`, each length checked against `cap` and the buffer; with a
 * `list`, each is decoded into it. 1 with *end set; 0 when one is off (past the end, longer than
 * cap, not UTF-8); -1 with a Python error set. */
static int gguf_walk(const Py_buffer *b, Py_ssize_t pos0, Py_ssize_t count,
                     unsigned long long cap, PyObject *list, Py_ssize_t *end) {
    if (pos0 < 0 || pos0 > b->len || count < 0 || count > (b->len - pos0) / 8) return 0;
    const unsigned char *p = b->buf;
    Py_ssize_t pos = pos0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (b->len - pos < 8) return 0;
        const uint64_t n = gguf_u64(p + pos);
        if (n > cap || n > (uint64_t)(b->len - pos - 8)) return 0;
        if (list) {
            PyObject *s = PyUnicode_DecodeUTF8((const char *)p + pos + 8, (Py_ssize_t)n, NULL);
            if (!s) {
                if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) return -1;
                PyErr_Clear();
                return 0;
            }
            PyList_SET_ITEM(list, i, s);
        }
        pos += 8 + (Py_ssize_t)n;
    }
    *end = pos;
    return 1;
}

/* gguf_strings(buf, pos, count, cap[, decode]) -> (list, end) | None; with decode false
 * (gguf_strings_end) -> end | None: where the strings end, their bytes not decoded (a vocabulary
 * read only when its tokenizer is built: entity/gguf/header.py StringArray). None when a string
 * is off (past the end, longer than cap, not UTF-8): the caller's Python loop then raises the
 * precise error. */
static PyObject *gguf_strings_call(PyObject *const *args, Py_ssize_t nargs, int decode) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "gguf_strings(buf, pos, count, cap)");
        return NULL;
    }
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) return NULL;
    const Py_ssize_t pos0 = PyLong_AsSsize_t(args[1]), count = PyLong_AsSsize_t(args[2]);
    const unsigned long long cap = PyLong_AsUnsignedLongLong(args[3]);
    PyObject *list = NULL, *ret = NULL;
    Py_ssize_t end = 0;
    int got = -1;
    if (PyErr_Occurred()) goto done;
    if (decode && count >= 0 && count <= b.len / 8 && !(list = PyList_New(count))) goto done;
    got = gguf_walk(&b, pos0, count, cap, list, &end);
    if (got > 0)
        ret = decode ? Py_BuildValue("(On)", list, end) : PyLong_FromSsize_t(end);
    else if (got == 0)
        ret = Py_NewRef(Py_None);
done:
    Py_XDECREF(list);
    PyBuffer_Release(&b);
    return ret;
}

static PyObject *py_gguf_strings(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return gguf_strings_call(args, nargs, 1);
}

static PyObject *py_gguf_strings_end(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return gguf_strings_call(args, nargs, 0);
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

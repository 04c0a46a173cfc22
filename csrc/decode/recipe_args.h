/* Parsing of a layer's recipe options (the 16th item of a decode() layer tuple; decode/step.h's
 * layer_t fields after `moe`, poly/runtime/fused.py `_recipe`):
 *   (ln, attn_beta|None, mlp_beta|None, attn_post_gamma|None, attn_post_beta|None,
 *    mlp_post_gamma|None, mlp_post_beta|None, no_pre, par, rmult, act, scale, softcap, window,
 *    sinks|None, rot, interleaved, qk_all, qk_form, q_norm_beta|None, k_norm_beta|None); qk_form:
 *    bit 0 LayerNorm q/k norms, bit 1 one weight (and beta) row per head */
#ifndef POLY_DECODE_RECIPE_ARGS_H
#define POLY_DECODE_RECIPE_ARGS_H
#include "core/common.h"
#include "decode/step.h"
#include "decode/args_buffers.h"

#define RECIPE_ITEMS 21

/* llama's block: what a layer without the options item runs */
static void recipe_defaults(layer_t *L) {
    L->rmult = 1.0f;
    L->scale = (float)(1.0 / sqrt((double)L->hd));
    L->rot = L->hd;
}

/* a float32 vector of n values or None (NULL, no error) */
static int recipe_vec(holds_t *H, PyObject *o, int64_t n, const char *what, const float **out) {
    *out = NULL;
    if (o == Py_None) return 0;
    return (*out = hold(H, o, 0, n * 4, what)) ? 0 : -1;
}

static int parse_recipe(holds_t *H, PyObject *t, layer_t *L, int64_t d) {
    if (as_tuple(t, RECIPE_ITEMS, "recipe options")) return -1;
    long iv[8];
    const int at[8] = {0, 7, 8, 10, 15, 16, 17, 18};
    for (int j = 0; j < 8; j++) {
        iv[j] = PyLong_AsLong(PyTuple_GET_ITEM(t, at[j]));
        if (iv[j] == -1 && PyErr_Occurred()) return -1;
    }
    const double rmult = PyFloat_AsDouble(PyTuple_GET_ITEM(t, 9)), scale = PyFloat_AsDouble(PyTuple_GET_ITEM(t, 11));
    const double cap = PyFloat_AsDouble(PyTuple_GET_ITEM(t, 12));
    const long long win = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 13));
    if (PyErr_Occurred()) return -1;
    if (iv[2] < 0 || iv[2] > 2 || iv[3] < 0 || iv[3] > 3 || iv[4] < 0 || iv[4] > L->hd || iv[4] % 2 || win < 0 || iv[7] < 0 || iv[7] > 3 || (iv[6] && iv[7]) ||
        !(rmult > 0) || !(scale >= 0) || !(cap >= 0) || !isfinite(rmult) || !isfinite(scale) || !isfinite(cap)) {
        PyErr_SetString(PyExc_ValueError, "bad recipe options");
        return -1;
    }
    L->ln = iv[0] != 0; L->no_pre = iv[1] != 0; L->par = (int)iv[2]; L->act = (int)iv[3];
    L->rot = (int)iv[4]; L->ileave = iv[5] != 0; L->qk_all = iv[6] != 0;
    L->qk_ln = (int)(iv[7] & 1); L->qk_heads = (int)(iv[7] >> 1);
    L->rmult = (float)rmult; L->softcap = (float)cap; L->window = win;
    if (scale > 0) L->scale = (float)scale;
    const char *names[6] = {"attn beta", "mlp beta", "attn post gamma", "attn post beta", "mlp post gamma",
                            "mlp post beta"};
    const float **vecs[6] = {&L->b_attn, &L->b_mlp, &L->g_apost, &L->b_apost, &L->g_mpost, &L->b_mpost};
    for (int j = 0; j < 6; j++)
        if (recipe_vec(H, PyTuple_GET_ITEM(t, 1 + j), d, names[j], vecs[j])) return -1;
    const int64_t qn = L->qk_heads ? (int64_t)L->heads * L->hd : L->hd, kn = L->qk_heads ? (int64_t)L->kvh * L->hd : L->hd;
    if (recipe_vec(H, PyTuple_GET_ITEM(t, 19), qn, "q norm beta", &L->b_q)) return -1;
    if (recipe_vec(H, PyTuple_GET_ITEM(t, 20), kn, "k norm beta", &L->b_k)) return -1;
    return recipe_vec(H, PyTuple_GET_ITEM(t, 14), L->heads, "sinks", &L->sinks);
}

/* a cache item: an array, or (array, position of its row 0) for a sliding window's moved rows */
static PyObject *cache_item(PyObject *o, int64_t *base) {
    *base = 0;
    if (!PyTuple_Check(o)) return o;
    if (as_tuple(o, 2, "a cache")) return NULL;
    *base = PyLong_AsLongLong(PyTuple_GET_ITEM(o, 1));
    if (PyErr_Occurred()) return NULL;
    if (*base < 0) { PyErr_SetString(PyExc_ValueError, "a cache's first position must be >= 0"); return NULL; }
    return PyTuple_GET_ITEM(o, 0);
}

#endif /* POLY_DECODE_RECIPE_ARGS_H */

/* The block recipes' pieces of the fused step (poly.config.BlockRecipe): LayerNorm beside RMSNorm,
 * and the FFN activations past SwiGLU (GeGLU, the plain GELU MLPs). */
#ifndef POLY_DECODE_RECIPE_H
#define POLY_DECODE_RECIPE_H
#include "core/common.h"
#include "core/activations.h"
#include "decode/rmsnorm.h"

/* LayerNorm of one row: (x - mean) / sqrt(var + eps) * g (+ b), sums in float64 */
static void pk_layernorm(const float *x, const float *g, const float *b, float eps, float *out, int64_t n) {
    double s = 0.0, ss = 0.0;
    for (int64_t i = 0; i < n; i++) s += x[i];
    const float mean = (float)(s / (double)n);
    for (int64_t i = 0; i < n; i++) ss += (double)(x[i] - mean) * (x[i] - mean);
    const float inv = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = (x[i] - mean) * inv * g[i] + (b ? b[i] : 0.0f);
}

/* one row of the layer's norm kind (ln: LayerNorm with beta b, else RMSNorm); in place allowed */
static inline void pk_norm(int ln, const float *x, const float *g, const float *b, float eps, float *out, int64_t n) {
    if (ln) pk_layernorm(x, g, b, eps, out, n);
    else pk_rmsnorm(x, g, eps, out, n);
}

/* exact GELU, x (1 + erf(x / sqrt 2)) / 2 (erf in float64, as poly.ops.gelu_erf) */
static inline float gelu_erf1(float x) {
    return (float)(0.5 * x * (1.0 + erf((double)x * 0.7071067811865476)));
}

/* out[j] = act(g[j]) * u[j] (act 1: GeGLU) or act(g[j]) (2: exact GELU, 3: tanh GELU MLP) */
static void act_rows(int act, const float *g, const float *u, float *out, int64_t n) {
    if (act == 2) for (int64_t j = 0; j < n; j++) out[j] = gelu_erf1(g[j]);
    else gelu_mul(g, act == 1 ? u : NULL, out, n); /* tanh GELU on 8 lanes (core/activations.h) */
}

/* act(kind, g, u | None, out, alpha, limit): the step's element-wise activations on float32
 * vectors of one length, for tests against torch: 1 GeGLU, 2 exact GELU, 3 tanh GELU (act_rows),
 * 4 tanh (the soft-cap's), 5 GPT-OSS's clamped SwiGLU (alpha, limit); u for 1 and 5 */
static PyObject *pk_py_act(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) { PyErr_SetString(PyExc_TypeError, "act(kind, g, u, out, alpha, limit)"); return NULL; }
    const long kind = PyLong_AsLong(args[0]);
    const double a = PyFloat_AsDouble(args[4]), lim = PyFloat_AsDouble(args[5]);
    if (PyErr_Occurred()) return NULL;
    const int gated = kind == 1 || kind == 5;
    if (kind < 1 || kind > 5 || (gated == (args[2] == Py_None))) {
        PyErr_SetString(PyExc_ValueError, "act: kind 1..5, u given for kinds 1 and 5 only");
        return NULL;
    }
    Py_buffer bg = {0}, bu = {0}, bo = {0};
    PyObject *ret = NULL;
    if (PyObject_GetBuffer(args[1], &bg, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[3], &bo, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done_g;
    if (gated && PyObject_GetBuffer(args[2], &bu, PyBUF_C_CONTIGUOUS) < 0) goto done_o;
    if (bg.len != bo.len || bo.len % 4 || (gated && bu.len != bo.len)) {
        PyErr_SetString(PyExc_ValueError, "act: g, u and out must be float32 of one length");
        goto done_u;
    }
    const int64_t n = bo.len / 4;
    float *o = bo.buf;
    const float *g = bg.buf, *u = bu.buf;
    if (kind <= 3) act_rows((int)kind, g, u, o, n);
    else if (kind == 4) { memcpy(o, g, (size_t)n * 4); softcap_rows(o, 1.0f, n); }
    else clamped_swiglu_rows(g, u, o, n, (float)a, (float)lim);
    ret = Py_NewRef(Py_None);
done_u:
    if (gated) PyBuffer_Release(&bu);
done_o:
    PyBuffer_Release(&bo);
done_g:
    PyBuffer_Release(&bg);
    return ret;
}

#endif /* POLY_DECODE_RECIPE_H */

/* The block recipes' pieces of the fused step (poly.config.BlockRecipe): LayerNorm beside RMSNorm,
 * and the FFN activations past SwiGLU (GeGLU, the plain GELU MLPs). */
#ifndef POLY_DECODE_RECIPE_H
#define POLY_DECODE_RECIPE_H
#include "core/common.h"
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

/* GELU's tanh form (HF gelu_pytorch_tanh, poly.ops.gelu_tanh) */
static inline float gelu_tanh1(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

/* exact GELU, x (1 + erf(x / sqrt 2)) / 2 (erf in float64, as poly.ops.gelu_erf) */
static inline float gelu_erf1(float x) {
    return (float)(0.5 * x * (1.0 + erf((double)x * 0.7071067811865476)));
}

/* out[j] = act(g[j]) * u[j] (act 1: GeGLU) or act(g[j]) (2: exact GELU, 3: tanh GELU MLP) */
static void act_rows(int act, const float *g, const float *u, float *out, int64_t n) {
    if (act == 1) for (int64_t j = 0; j < n; j++) out[j] = gelu_tanh1(g[j]) * u[j];
    else if (act == 2) for (int64_t j = 0; j < n; j++) out[j] = gelu_erf1(g[j]);
    else for (int64_t j = 0; j < n; j++) out[j] = gelu_tanh1(g[j]);
}

#endif /* POLY_DECODE_RECIPE_H */

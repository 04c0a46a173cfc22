/* RMSNorm of one row, the fused step's (float64 sum of squares). */
#ifndef POLY_DECODE_RMSNORM_H
#define POLY_DECODE_RMSNORM_H
#include "core/common.h"

static void pk_rmsnorm(const float *x, const float *g, float eps, float *out, int64_t n) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float inv = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * g[i];
}

#endif /* POLY_DECODE_RMSNORM_H */

/* The fused step's KV caches: a position's slot (contiguous or paged), stores (float32, float16,
 * q8_0), rope of the new row. */
#ifndef POLY_DECODE_KV_H
#define POLY_DECODE_KV_H
#include "core/common.h"
#include "core/half.h"
#include "decode/step.h"
#include "decode/rmsnorm.h"
#include "decode/recipe.h"
#include "decode/kv_q8.h"

/* the cache slot of position t of row i of layer L (its page table, or t less the position of the
 * cache's row 0 when contiguous: a sliding window's cache keeps its last rows only) */
static inline int64_t slot(const step_t *S, const layer_t *L, int i, int64_t t) {
    return S->tab[i] ? (int64_t)S->tab[i][t / S->ps] * S->ps + t % S->ps : t - L->kbase[i];
}

/* n floats of src to elements at.. of a cache: copied, or rounded to float16 (kv16) */
static void kv_store(void *cache, int64_t at, const float *src, int64_t n, int kv16) {
    if (!kv16) {
        memcpy((float *)cache + at, src, (size_t)n * 4);
        return;
    }
    uint16_t *dst = (uint16_t *)cache + at;
    int64_t j = 0;
#if PK_SIMD
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(dst + j), _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; j < n; j++) dst[j] = f2h(src[j]);
}

/* rotate pairs (j, j + rot/2), or (2j, 2j + 1) when ileave, of the first rot values of v */
static inline void rope_head(float *v, const float *c, const float *s, int64_t rot, int ileave) {
    const int64_t half = rot / 2, a = ileave ? 2 : 1, b = ileave ? 1 : half;
    for (int64_t j = 0; j < half; j++) {
        const float x1 = v[a * j], x2 = v[a * j + b];
        v[a * j] = x1 * c[j] - x2 * s[j];
        v[a * j + b] = x2 * c[j] + x1 * s[j];
    }
}

/* row i: q/k norm (per head, RMSNorm or LayerNorm, or RMSNorm over all heads with qk_all), RoPE of the first rot values of each
 * head at pos, then k/v appended to its caches */
static void rope_append(const step_t *S, const layer_t *L, float *qkv, int64_t pos, int i) {
    const int64_t hd = L->hd, q = (int64_t)L->heads * hd, kvd = (int64_t)L->kvh * hd, half = L->rot / 2;
    if (L->qk_all && L->g_q) pk_rmsnorm(qkv, L->g_q, L->eps, qkv, q);
    if (L->qk_all && L->g_k) pk_rmsnorm(qkv + q, L->g_k, L->eps, qkv + q, kvd);
    for (int64_t h = 0; h < L->heads + L->kvh; h++) {
        float *v = qkv + h * hd;
        const int isq = h < L->heads;
        const int64_t row = L->qk_heads ? (isq ? h : h - L->heads) * hd : 0; /* one weight row per head */
        const float *g = isq ? L->g_q : L->g_k, *b = isq ? L->b_q : L->b_k;
        if (g && !L->qk_all) pk_norm(L->qk_ln, v, g + row, b ? b + row : NULL, L->eps, v, hd);
        if (L->rot) rope_head(v, L->cos + pos * half, L->sin + pos * half, L->rot, L->ileave);
    }
    const int64_t at = slot(S, L, i, pos);
    if (L->kv8) { /* q8_0: the row's codes and scales (decode/kv_q8.h) */
        const int64_t rb = kv_row_bytes(kvd, 1);
        kv8_store((uint8_t *)L->kc[i] + at * rb, qkv + q, kvd);
        kv8_store((uint8_t *)L->vc[i] + at * rb, qkv + q + kvd, kvd);
        return;
    }
    kv_store(L->kc[i], at * kvd, qkv + q, kvd, L->kv16);
    kv_store(L->vc[i], at * kvd, qkv + q + kvd, kvd, L->kv16);
}

#endif /* POLY_DECODE_KV_H */

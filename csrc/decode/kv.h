/* The fused step's KV caches: a position's slot (contiguous or paged), stores, rope of the new row. */
#ifndef POLY_DECODE_KV_H
#define POLY_DECODE_KV_H
#include "core/common.h"
#include "core/half.h"
#include "decode/step.h"
#include "decode/rmsnorm.h"

/* the cache slot of position t of row i (its page table, or t itself when contiguous) */
static inline int64_t slot(const step_t *S, int i, int64_t t) {
    return S->tab[i] ? (int64_t)S->tab[i][t / S->ps] * S->ps + t % S->ps : t;
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

/* row i: q/k norm, RoPE (pairs j, j + hd/2) at pos, then k/v appended to its caches */
static void rope_append(const step_t *S, const layer_t *L, float *qkv, int64_t pos, int i) {
    const int64_t hd = L->hd, half = hd / 2, q = (int64_t)L->heads * hd, kvd = (int64_t)L->kvh * hd;
    const float *c = L->cos + pos * half, *s = L->sin + pos * half;
    for (int64_t h = 0; h < L->heads + L->kvh; h++) {
        float *v = qkv + h * hd;
        const float *g = h < L->heads ? L->g_q : L->g_k;
        if (g) pk_rmsnorm(v, g, L->eps, v, hd);
        for (int64_t j = 0; j < half; j++) {
            const float x1 = v[j], x2 = v[j + half];
            v[j] = x1 * c[j] - x2 * s[j];
            v[j + half] = x2 * c[j] + x1 * s[j];
        }
    }
    const int64_t at = slot(S, i, pos);
    kv_store(L->kc[i], at * kvd, qkv + q, kvd, L->kv16);
    kv_store(L->vc[i], at * kvd, qkv + q + kvd, kvd, L->kv16);
}

#endif /* POLY_DECODE_KV_H */

/* Attention of one decode row (contiguous, or paged through slot(): the server's KV pool) for the fused step: softmax(q . K[0..pos] / sqrt(hd)) . V[0..pos].
 * Included by pk_decode.c. The 8-lane version keeps the output row in registers while it
 * streams V (head_dim 64 and 128 unrolled), takes exp on 8 lanes (exp8) and divides once at the
 * end: at position 1,000 the scalar loop (a load, FMA and store of o per V element, a libm expf
 * and a division per position) cost more than the 4-bit weights of the step. */
#ifndef PK_ATTN_H
#define PK_ATTN_H

/* scores sc[t] = q . K_t * scale for t <= pos; returns their max */
static inline float attn_scores(const step_t *S, int i, const float *K, int64_t kvd, const float *q, int64_t hd,
                                float scale, float *sc, int64_t pos) {
    float mx = -INFINITY;
    for (int64_t t = 0; t <= pos; t++) {
        /* the SIMD dot of the matrix kernels: a plain loop is one dependent add chain */
        sc[t] = dense_dot(K_F32, (const uint8_t *)(K + slot(S, i, t) * kvd), q, hd) * scale;
        mx = fmaxf(mx, sc[t]);
    }
    return mx;
}

#if PK_SIMD
/* sc[t] = exp(sc[t] - mx) for t <= pos; returns their sum (NaN scores stay NaN) */
static inline float attn_exp(float *sc, int64_t pos, float mx) {
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= pos + 1; t += 8) {
        const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(sc + t), vm);
        const __m256 e = _mm256_blendv_ps(exp8(x), x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        _mm256_storeu_ps(sc + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum(acc);
    for (; t <= pos; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
    return sum;
}

/* o = (sum_t p[t] * V_t) / sum for NV * 8 = head_dim (NV a constant: the row stays in registers) */
static inline __attribute__((always_inline)) void attn_values(const step_t *S, int i, const float *V, int64_t kvd,
                                                              const float *p, int64_t pos, float inv, float *o,
                                                              const int NV) {
    __m256 acc[32];
    for (int c = 0; c < NV; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t t = 0; t <= pos; t++) {
        const __m256 pt = _mm256_set1_ps(p[t]);
        const float *v = V + slot(S, i, t) * kvd;
        for (int c = 0; c < NV; c++) acc[c] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * c), acc[c]);
    }
    for (int c = 0; c < NV; c++) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[c], _mm256_set1_ps(inv)));
}
#endif

/* row i, head h: softmax(q . K[0..pos] / sqrt(hd)) . V[0..pos] */
static void attend(const step_t *S, const layer_t *L, const float *q, float *o, float *sc, int64_t pos, int i, int h) {
    const int64_t hd = L->hd, kvd = (int64_t)L->kvh * hd, g = h / (L->heads / L->kvh);
    const float scale = (float)(1.0 / sqrt((double)hd));
    const float *K = L->kc[i] + g * hd, *V = L->vc[i] + g * hd;
    const float mx = attn_scores(S, i, K, kvd, q, hd, scale, sc, pos);
#if PK_SIMD
    if (hd % 8 == 0 && hd <= 256) {
        const float inv = 1.0f / attn_exp(sc, pos, mx);
        if (hd == 64) attn_values(S, i, V, kvd, sc, pos, inv, o, 8);
        else if (hd == 128) attn_values(S, i, V, kvd, sc, pos, inv, o, 16);
        else attn_values(S, i, V, kvd, sc, pos, inv, o, (int)(hd / 8));
        return;
    }
#endif
    float sum = 0.0f;
    for (int64_t t = 0; t <= pos; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
    for (int64_t j = 0; j < hd; j++) o[j] = 0.0f;
    for (int64_t t = 0; t <= pos; t++) {
        const float p = sc[t] / sum, *v = V + slot(S, i, t) * kvd;
        for (int64_t j = 0; j < hd; j++) o[j] += p * v[j];
    }
}

#endif /* PK_ATTN_H */

/* Attention of one decode row (contiguous, or paged through slot(): the server's KV pool) for the fused step: softmax(q . K[lo..pos] * scale) . V[lo..pos] (lo: a sliding window's first
 * position; options: tanh soft-capping, a sink logit per head).
 * The 8-lane version keeps the output row in registers while it
 * streams V (head_dim 64 and 128 unrolled), takes exp on 8 lanes (exp8) and divides once at the
 * end: at position 1,000 the scalar loop (a load, FMA and store of o per V element, a libm expf
 * and a division per position) cost more than the 4-bit weights of the step.
 * The caches hold float32, float16 (llama.cpp's default, half the bytes a position to read at
 * long context) or q8_0 rows (decode/kv_q8.h); every function takes the form fm (KV_F32, KV_F16,
 * KV_Q8) as a constant, so each form is its own loop. A q8_0 head's scales sit so bytes after
 * its codes (so: 0 for the float forms).
 * A thread's heads go together in blocks of positions (attend_heads_kv): 1B Q4_0 decode at context
 * 1,000 +11 % (float16 cache), +5 % (float32). */
#ifndef POLY_ATTENTION_DECODE_ROW_H
#define POLY_ATTENTION_DECODE_ROW_H
#include "core/common.h"
#include "core/half.h"
#include "rows/avx512.h"
#include "rows/dense_dot.h"
#include "core/activations.h"
#include "decode/step.h"
#include "decode/kv.h"
#include "decode/kv_q8.h"

enum { KV_F32, KV_F16, KV_Q8 }; /* a layer's cache form (fm) */

/* the form of layer L's caches */
static inline int kv_form(const layer_t *L) { return L->kv8 ? KV_Q8 : L->kv16 ? KV_F16 : KV_F32; }

/* a position's row bytes, and KV group g's offset in it (so: its scales' offset from its codes) */
static inline int64_t kv_group(const layer_t *L, int64_t g, const int fm, int64_t *rb, int64_t *so) {
    const int64_t hd = L->hd, kvd = (int64_t)L->kvh * hd, es = fm == KV_F32 ? 4 : fm == KV_F16 ? 2 : 1;
    *rb = kv_row_bytes(kvd, (int)es);
    *so = fm == KV_Q8 ? kvd + g * hd / 16 - g * hd : 0;
    return g * hd * es;
}

/* element j of a cache row (float32 or float16) */
static inline __attribute__((always_inline)) float kv_ld1(const uint8_t *p, int64_t j, const int h16) {
    return h16 ? h2f(p + 2 * j) : ((const float *)p)[j];
}

#if PK_SIMD
static inline __attribute__((always_inline)) __m256 kv_ld8(const uint8_t *p, int64_t j, const int h16) {
    return h16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * j))) : _mm256_loadu_ps((const float *)p + j);
}

/* the 8 dot products q . k[j] (hd % 8 == 0) as one vector: the 8 sums reduced together by one
 * transpose-add, not one horizontal sum each (that reduction cost as much as the FMAs at hd 64) */
static inline __attribute__((always_inline)) __m256 dot8x(const uint8_t *const k[8], const float *q, int64_t hd,
                                                          const int h16) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    int64_t c = 0;
#if PK_AVX512
    if (hd % 16 == 0) { /* 16 lanes, each sum folded to 8 before the transpose-add */
        __m512 b[8];
        for (int j = 0; j < 8; j++) b[j] = _mm512_setzero_ps();
        for (; c < hd; c += 16) {
            const __m512 qv = _mm512_loadu_ps(q + c);
            for (int j = 0; j < 8; j++) {
                const __m512 kj = h16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(k[j] + 2 * c)))
                                      : _mm512_loadu_ps((const float *)k[j] + c);
                b[j] = _mm512_fmadd_ps(kj, qv, b[j]);
            }
        }
#define FOLD(j) _mm256_add_ps(_mm512_castps512_ps256(b[j]), _mm512_extractf32x8_ps(b[j], 1))
        a0 = FOLD(0); a1 = FOLD(1); a2 = FOLD(2); a3 = FOLD(3); a4 = FOLD(4); a5 = FOLD(5); a6 = FOLD(6); a7 = FOLD(7);
#undef FOLD
    }
#endif
    for (; c < hd; c += 8) {
        const __m256 qv = _mm256_loadu_ps(q + c);
        a0 = _mm256_fmadd_ps(kv_ld8(k[0], c, h16), qv, a0);
        a1 = _mm256_fmadd_ps(kv_ld8(k[1], c, h16), qv, a1);
        a2 = _mm256_fmadd_ps(kv_ld8(k[2], c, h16), qv, a2);
        a3 = _mm256_fmadd_ps(kv_ld8(k[3], c, h16), qv, a3);
        a4 = _mm256_fmadd_ps(kv_ld8(k[4], c, h16), qv, a4);
        a5 = _mm256_fmadd_ps(kv_ld8(k[5], c, h16), qv, a5);
        a6 = _mm256_fmadd_ps(kv_ld8(k[6], c, h16), qv, a6);
        a7 = _mm256_fmadd_ps(kv_ld8(k[7], c, h16), qv, a7);
    }
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3)); /* [0123|0123] halves */
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7)); /* [4567|4567] */
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}
#endif

/* scores sc[t] = q . K_t * scale for t0 <= t < t1 (rb: a position's bytes; t0 a multiple of 8, so a
 * position takes the same 8-lane or scalar dot whatever the range); returns their max */
static inline __attribute__((always_inline)) float attn_scores(const step_t *S, const layer_t *L, int i, const uint8_t *K, int64_t rb,
                                                                const float *q, int64_t hd, float scale, float *sc,
                                                                int64_t t0, int64_t t1, int64_t so, const int fm) {
    float mx = -INFINITY;
    int64_t t = t0;
#if PK_SIMD
    if (hd % 8 == 0 && t + 8 <= t1) {
        __m256 vmx = _mm256_set1_ps(-INFINITY);
        const __m256 vs = _mm256_set1_ps(scale);
        for (; t + 8 <= t1; t += 8) {
            const uint8_t *k[8];
            for (int j = 0; j < 8; j++) k[j] = K + slot(S, L, i, t + j) * rb;
            const __m256 d = fm == KV_Q8 ? kv8_dot8x(k, so, q, hd) : dot8x(k, q, hd, fm == KV_F16);
            const __m256 s = _mm256_mul_ps(d, vs);
            _mm256_storeu_ps(sc + t, s);
            vmx = _mm256_max_ps(s, vmx); /* a NaN score is skipped, like fmaxf; exp keeps it NaN */
        }
        float m8[8];
        _mm256_storeu_ps(m8, vmx);
        for (int j = 0; j < 8; j++) mx = fmaxf(mx, m8[j]);
    }
#endif
    for (; t < t1; t++) {
        /* the SIMD dot of the matrix kernels: a plain loop is one dependent add chain */
        const uint8_t *k = K + slot(S, L, i, t) * rb;
        sc[t] = (fm == KV_Q8 ? kv8_dot(k, so, q, hd) : dense_dot(fm == KV_F16 ? K_F16 : K_F32, k, q, hd)) * scale;
        mx = fmaxf(mx, sc[t]);
    }
    if (L->softcap > 0.0f) { /* cap * tanh(s / cap) (gemma2), on 8 lanes (core/activations.h) */
        softcap_rows(sc + t0, L->softcap, t1 - t0);
        mx = -INFINITY;
        for (t = t0; t < t1; t++) mx = fmaxf(mx, sc[t]);
    }
    return mx;
}

#if PK_SIMD
/* sc[t] = exp(sc[t] - mx) for lo <= t <= pos; returns their sum (NaN scores stay NaN) */
static inline float attn_exp(float *sc, int64_t lo, int64_t pos, float mx) {
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    int64_t t = lo;
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

/* o += sum_t p[t] * V_t over t0 <= t < t1 (o zero when t0 == lo, the first), then o *= inv if last;
 * NV * 8 = head_dim (NV a constant: the row stays in registers) */
static inline __attribute__((always_inline)) void attn_values(const step_t *S, const layer_t *L, int i, const uint8_t *V,
                                                              int64_t rb, const float *p, int64_t lo, int64_t t0, int64_t t1, int last,
                                                              float inv, float *o, int64_t so, const int NV, const int fm) {
    __m256 acc[32];
    for (int c = 0; c < NV; c++) acc[c] = t0 > lo ? _mm256_loadu_ps(o + 8 * c) : _mm256_setzero_ps();
    for (int64_t t = t0; t < t1; t++) {
        const __m256 pt = _mm256_set1_ps(p[t]);
        const uint8_t *v = V + slot(S, L, i, t) * rb;
        if (fm == KV_Q8) kv8_axpy(acc, p[t], v, so, NV);
        else
            for (int c = 0; c < NV; c++) acc[c] = _mm256_fmadd_ps(pt, kv_ld8(v, 8 * c, fm == KV_F16), acc[c]);
    }
    for (int c = 0; c < NV; c++) _mm256_storeu_ps(o + 8 * c, last ? _mm256_mul_ps(acc[c], _mm256_set1_ps(inv)) : acc[c]);
}

static inline __attribute__((always_inline)) void attn_values_hd(const step_t *S, const layer_t *L, int i,
                                                                 const uint8_t *V, int64_t rb, const float *p, int64_t lo,
                                                                 int64_t t0, int64_t t1, int last, float inv, float *o,
                                                                 int64_t hd, int64_t so, const int fm) {
    if (hd == 64) attn_values(S, L, i, V, rb, p, lo, t0, t1, last, inv, o, so, 8, fm);
    else if (hd == 128) attn_values(S, L, i, V, rb, p, lo, t0, t1, last, inv, o, so, 16, fm);
    else attn_values(S, L, i, V, rb, p, lo, t0, t1, last, inv, o, so, (int)(hd / 8), fm);
}
#endif

/* the first position row i's query at pos sees (a sliding window's) */
static inline int64_t attn_lo(const layer_t *L, int64_t pos) {
    return L->window && pos - L->window + 1 > 0 ? pos - L->window + 1 : 0;
}

/* head h's sink: the score max with it, and exp(sink - max) for the denominator (0 without) */
static inline float sink_max(const layer_t *L, int h, float mx) {
    return L->sinks ? fmaxf(mx, L->sinks[h]) : mx;
}
static inline float sink_exp(const layer_t *L, int h, float mx) {
    return L->sinks ? expf(L->sinks[h] - mx) : 0.0f;
}

/* row i, head h: softmax(q . K[lo..pos] * scale) . V[lo..pos], scalar (builds without SIMD, head
 * dims the 8-lane loops do not take) */
static inline __attribute__((always_inline)) void attend_kv(const step_t *S, const layer_t *L, const float *q, float *o,
                                                            float *sc, int64_t pos, int i, int h, const int fm) {
    const int64_t hd = L->hd, lo = attn_lo(L, pos);
    int64_t rb, so;
    const int64_t go = kv_group(L, h / (L->heads / L->kvh), fm, &rb, &so);
    const uint8_t *K = (const uint8_t *)L->kc[i] + go, *V = (const uint8_t *)L->vc[i] + go;
    const float mx = sink_max(L, h, attn_scores(S, L, i, K, rb, q, hd, L->scale, sc, lo, pos + 1, so, fm));
    float sum = sink_exp(L, h, mx);
    for (int64_t t = lo; t <= pos; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
    for (int64_t j = 0; j < hd; j++) o[j] = 0.0f;
    for (int64_t t = lo; t <= pos; t++) {
        const float p = sc[t] / sum;
        const uint8_t *v = V + slot(S, L, i, t) * rb;
        for (int64_t j = 0; j < hd; j++) o[j] += p * (fm == KV_Q8 ? kv8_ld1(v, so, j) : kv_ld1(v, j, fm == KV_F16));
    }
}

#if PK_SIMD
/* heads [h0, h1) of row i (q, o: the row's), in blocks of positions: each block's keys (values)
 * of the heads' KV groups are read from memory once and stay in L1 for every head of a group
 * (one head at a time over all positions read a group's keys from memory, then again from L2
 * for each other head). sc: the heads' scores, sst floats each. The same sums in the same
 * order as one head at a time (o carries a head's value sums between blocks). */
static inline __attribute__((always_inline)) void attend_heads_kv(const step_t *S, const layer_t *L, const float *q,
                                                                  float *o, float *sc, int64_t sst, int64_t pos, int i,
                                                                  int h0, int h1, const int fm) {
    const int G = L->heads / L->kvh;
    const int64_t hd = L->hd, blk = fm == KV_F32 ? 32 : 64;
    const int64_t lo = attn_lo(L, pos);
    const uint8_t *K = (const uint8_t *)L->kc[i], *V = (const uint8_t *)L->vc[i];
    float mx[h1 - h0], inv[h1 - h0];
    for (int h = h0; h < h1; h++) mx[h - h0] = -INFINITY;
    for (int64_t t0 = lo; t0 <= pos; t0 += blk) {
        const int64_t t1 = t0 + blk < pos + 1 ? t0 + blk : pos + 1;
        for (int h = h0; h < h1; h++) {
            int64_t rb, so;
            const int64_t go = kv_group(L, h / G, fm, &rb, &so);
            const float m = attn_scores(S, L, i, K + go, rb, q + h * hd, hd, L->scale, sc + (h - h0) * sst, t0, t1, so, fm);
            mx[h - h0] = fmaxf(mx[h - h0], m);
        }
    }
    for (int h = h0; h < h1; h++) {
        const float m = sink_max(L, h, mx[h - h0]);
        inv[h - h0] = 1.0f / (attn_exp(sc + (h - h0) * sst, lo, pos, m) + sink_exp(L, h, m));
    }
    for (int64_t t0 = lo; t0 <= pos; t0 += blk) {
        const int64_t t1 = t0 + blk < pos + 1 ? t0 + blk : pos + 1;
        for (int h = h0; h < h1; h++) {
            int64_t rb, so;
            const int64_t go = kv_group(L, h / G, fm, &rb, &so);
            attn_values_hd(S, L, i, V + go, rb, sc + (h - h0) * sst, lo, t0, t1, t1 == pos + 1, inv[h - h0], o + h * hd,
                           hd, so, fm);
        }
    }
}
#endif

/* heads [h0, h1) of row i: q and o point at the row's query and output (head h at h * hd) */
static void attend_heads(const step_t *S, const layer_t *L, const float *q, float *o, float *sc, int64_t sst,
                         int64_t pos, int i, int h0, int h1) {
#if PK_SIMD
    if (L->hd % 8 == 0 && L->hd <= 256) {
        if (L->kv8) attend_heads_kv(S, L, q, o, sc, sst, pos, i, h0, h1, KV_Q8);
        else if (L->kv16) attend_heads_kv(S, L, q, o, sc, sst, pos, i, h0, h1, KV_F16);
        else attend_heads_kv(S, L, q, o, sc, sst, pos, i, h0, h1, KV_F32);
        return;
    }
#endif
    for (int h = h0; h < h1; h++) {
        if (L->kv8) attend_kv(S, L, q + h * L->hd, o + h * L->hd, sc, pos, i, h, KV_Q8);
        else if (L->kv16) attend_kv(S, L, q + h * L->hd, o + h * L->hd, sc, pos, i, h, KV_F16);
        else attend_kv(S, L, q + h * L->hd, o + h * L->hd, sc, pos, i, h, KV_F32);
    }
}

#endif /* POLY_ATTENTION_DECODE_ROW_H */

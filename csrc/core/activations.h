/* Vector helpers shared by the kernels: activation layouts for the quantized kernels (Loom
 * order, int8 codes) and the SwiGLU activation. */
#ifndef POLY_CORE_ACTIVATIONS_H
#define POLY_CORE_ACTIVATIONS_H
#include "core/common.h"
#include "rows/dense_dot.h"

/* x with every 32-block reordered [x0, x2, ..., x30, x1, x3, ..., x31] (Loom nibble order) */
static inline void loom_order(const float *x, float *dst, int64_t len) {
    for (int64_t b = 0; b + 32 <= len; b += 32)
        for (int l = 0; l < 16; l++) { dst[b + l] = x[b + 2 * l]; dst[b + 16 + l] = x[b + 2 * l + 1]; }
}

#if PK_SIMD
/* the largest of v's 8 lanes (v holds no NaN) */
static inline float hmax8(__m256 v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}
#endif

/* max |x[l]| over len elements (NaNs skipped, as fmaxf does) */
static inline float absmax(const float *x, int64_t len) {
    float amax = 0.0f;
    int64_t l = 0;
#if PK_SIMD
    __m256 m = _mm256_setzero_ps();
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (; l + 8 <= len; l += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + l), abs), m); /* NaN: keeps m */
    amax = hmax8(m);
#endif
    for (; l < len; l++) amax = fmaxf(amax, fabsf(x[l]));
    return amax;
}

#if PK_SIMD
/* 32 int32 (in [-127, 127]) -> 32 int8 in order */
static inline __m256i pack32i(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
    return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* 32 floats (integers in [-127, 127]) -> 32 int8 in order */
static inline __m256i pack32(__m256 a, __m256 b, __m256 c, __m256 d) {
    return pack32i(_mm256_cvtps_epi32(a), _mm256_cvtps_epi32(b), _mm256_cvtps_epi32(c), _mm256_cvtps_epi32(d));
}

/* v rounded to the nearest integer, clamped to [-127, 127] (an int8 code, as a float) */
static inline __m256 code8(__m256 v) {
    const __m256 r = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
}

/* quantize_x's codes of one block, the same float operations on 8 lanes (bitwise equal) */
static inline void codes32(const float *xb, float id, int8_t *h, int8_t *lo) {
    const __m256 vid = _mm256_set1_ps(id), r = _mm256_set1_ps(XL_SCALE);
    __m256 hv[4], lv[4];
    for (int q = 0; q < 4; q++) {
        const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xb + 8 * q), vid);
        hv[q] = code8(v);
        lv[q] = code8(_mm256_mul_ps(_mm256_sub_ps(v, hv[q]), r));
    }
    _mm256_storeu_si256((__m256i *)h, pack32(hv[0], hv[1], hv[2], hv[3]));
    _mm256_storeu_si256((__m256i *)lo, pack32(lv[0], lv[1], lv[2], lv[3]));
}
#endif

/* q8 scheme: x as two int8 codes per element, x ~= dx * (xh + xl / 254) with dx = max|x| / 127
 * per 32-block: xh = round(x / dx), xl = round((x / dx - xh) * 254), laid out [xh 32][xl 32].
 * Two integer dot products give ~15-bit activations (error <= dx / 508 per element) at integer
 * speed. */
static inline void quantize_x(const float *x, int8_t *xq, float *dx, int64_t nblocks) {
    for (int64_t i = 0; i < nblocks; i++) {
        const float *xb = x + i * 32;
        int8_t *h = xq + i * 64, *lo = h + 32;
        const float amax = absmax(xb, 32);
        if (!isfinite(amax)) { dx[i] = NAN; memset(h, 0, 64); continue; }
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        dx[i] = d;
#if PK_SIMD
        codes32(xb, id, h, lo);
#else
        for (int l = 0; l < 32; l++) {
            const float v = xb[l] * id, hv = fminf(fmaxf(rintf(v), -127.0f), 127.0f);
            h[l] = (int8_t)hv;
            lo[l] = (int8_t)fminf(fmaxf(rintf((v - hv) * XL_SCALE), -127.0f), 127.0f);
        }
#endif
    }
}

/* q8 scheme: the sums of x per 16 elements (the K-quant kernels' offsets, csrc/formats/kquant_rows.h) */
static inline void sums16(const float *x, float *xs16, int64_t nblocks) {
    for (int64_t g = 0; g < 2 * nblocks; g++) {
        float t = 0.0f;
        for (int l = 0; l < 16; l++) t += x[g * 16 + l];
        xs16[g] = t;
    }
}

/* the auto mode's K-quant rows (formats/kquant_rows.h): x as one int8 code per element with one scale a
 * 256-element super-block (llama.cpp's Q8_K), so a row's eight sub-block dots add up in int32
 * and convert once a super-block (the 32-block scales cost a convert and an FMA a sub-block:
 * Zen 4 Q4_K rows 12.8 -> 14+ GB/s a thread). Group g: XK_BYTES bytes, the 256 codes, then 16
 * int16 sums of the codes per 16 elements (the offsets and mins meet them); dk[g] its scale,
 * NaN when the group holds a NaN or an infinity (the rows' sums NaN through it). */
static inline void quantize_k(const float *x, int8_t *xk, float *dk, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) {
        const float *xb = x + g * 256;
        int8_t *c = xk + g * XK_BYTES;
        int l = 0, bad = 0; /* a NaN or an infinity in the group */
#if PK_SIMD
        const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
        for (; l < 256; l += 8) {
            const __m256 xv = _mm256_loadu_ps(xb + l);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));
            m = _mm256_max_ps(_mm256_and_ps(xv, abs), m); /* NaN: keeps m */
        }
        const float amax = hmax8(m);
        bad = _mm256_movemask_ps(nan) != 0;
#else
        float amax = 0.0f;
        for (; l < 256; l++) { bad |= isnan(xb[l]); amax = fmaxf(amax, fabsf(xb[l])); }
#endif
        bad |= !isfinite(amax);
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        l = 0;
#if PK_SIMD
        const __m256 vid = _mm256_set1_ps(id);
        for (; l < 256; l += 32) {
            __m256 v[4];
            for (int q = 0; q < 4; q++) v[q] = code8(_mm256_mul_ps(_mm256_loadu_ps(xb + l + 8 * q), vid));
            _mm256_storeu_si256((__m256i *)(c + l), pack32(v[0], v[1], v[2], v[3]));
        }
#endif
        for (; l < 256; l++) c[l] = (int8_t)fminf(fmaxf(rintf(xb[l] * id), -127.0f), 127.0f);
        dk[g] = bad ? NAN : d;
        int16_t s16[16];
        for (int h = 0; h < 16; h++) {
            int t = 0;
            for (int e = 0; e < 16; e++) t += c[16 * h + e];
            s16[h] = (int16_t)t;
        }
        memcpy(c + 256, s16, 32);
    }
}

#if PK_SIMD
/* exp(x) on 8 lanes: Cephes' expf polynomial (relative error ~2e-7), x clamped to +-88.38 so it
 * never overflows (exp(-inf) -> ~0, not NaN; NaN lanes give garbage: callers handle NaN). */
static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
    const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), half));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, one));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

/* out[j] = silu(g[j]) * u[j] = g / (1 + exp(-g)) * u. exp is Cephes' expf polynomial on 8 lanes
 * (relative error ~2e-7, the libm's is ~1e-7): a scalar expf per element cost more than the
 * matrix reads of a 4-bit FFN. NaN in g stays NaN; exp(-g) is clamped so it never overflows. */
static inline void silu_mul(const float *g, const float *u, float *out, int64_t n) {
    int64_t j = 0;
#if PK_SIMD
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; j + 8 <= n; j += 8) {
        const __m256 gvec = _mm256_loadu_ps(g + j);
        const __m256 ex = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gvec)); /* exp(-g) */
        __m256 s = _mm256_div_ps(gvec, _mm256_add_ps(one, ex));
        s = _mm256_blendv_ps(s, gvec, _mm256_cmp_ps(gvec, gvec, _CMP_UNORD_Q)); /* NaN stays NaN */
        _mm256_storeu_ps(out + j, _mm256_mul_ps(s, _mm256_loadu_ps(u + j)));
    }
#endif
    for (; j < n; j++) out[j] = g[j] / (1.0f + expf(fminf(-g[j], 88.3762626647949f))) * u[j];
}

/* GELU's tanh form as x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): the same function as
 * 0.5 x (1 + tanh u), without its cancellation below x ~ -3 (there tanhf's form loses every
 * digit: x = -5 gives -2.98e-7 for -2.29e-7). Past exp's clamp (|gelu| < |x| 1e-38) x * 0, so
 * -inf gives NaN and -100 gives -0, as torch's. HF gelu_pytorch_tanh, poly.ops.gelu_tanh. */
static inline float gelu_tanh1(float x) {
    const float a = -1.5957691216057308f * (x + 0.044715f * x * x * x); /* -2u */
    return a > 88.3762626647949f ? x * 0.0f : x / (1.0f + expf(a));
}

/* tanh with Cephes' tanhf split: x + x^3 P(x^2) below |x| 0.625 (relative, no cancellation),
 * else 1 - 2 / (exp(2|x|) + 1) with x's sign */
static inline float tanh1(float x) {
    const float ax = fabsf(x);
    if (!(ax >= 0.625f)) {
        const float z = x * x;
        return ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z + 1.33314422036e-1f) * z -
                3.33332819422e-1f) * z * x + x;
    }
    return copysignf(1.0f - 2.0f / (expf(fminf(2.0f * ax, 88.3762626647949f)) + 1.0f), x);
}

#if PK_SIMD
/* gelu_tanh1 on 8 lanes (exp8: relative error ~2e-7); NaN stays NaN */
static inline __m256 gelu8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), c = _mm256_set1_ps(-1.5957691216057308f);
    const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 a = _mm256_mul_ps(c, _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
    const __m256 r = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(a)));
    return _mm256_blendv_ps(r, _mm256_mul_ps(x, _mm256_setzero_ps()), _mm256_cmp_ps(a, hi, _CMP_GT_OQ));
}

/* tanh1 on 8 lanes (both branches, blended); NaN stays NaN */
static inline __m256 tanh8(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    const __m256 ax = _mm256_andnot_ps(sign, x), z = _mm256_mul_ps(x, x);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(-5.70498872745e-3f), z, _mm256_set1_ps(2.06390887954e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036e-1f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
    const __m256 e = exp8(_mm256_add_ps(ax, ax));
    const __m256 big = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    const __m256 r = _mm256_blendv_ps(_mm256_or_ps(big, _mm256_and_ps(x, sign)), p,
                                      _mm256_cmp_ps(ax, _mm256_set1_ps(0.625f), _CMP_LT_OQ));
    return _mm256_blendv_ps(r, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
#endif

/* out[j] = gelu_tanh(g[j]) * u[j] (GeGLU), or gelu_tanh(g[j]) when u is NULL: a tanhf per
 * element cost as much as a 4-bit FFN's matrix reads (Gemma-2's 0.91x of llama's speed) */
static void gelu_mul(const float *g, const float *u, float *out, int64_t n) {
    int64_t j = 0;
#if PK_SIMD
    for (; j + 8 <= n; j += 8) {
        const __m256 v = gelu8(_mm256_loadu_ps(g + j));
        _mm256_storeu_ps(out + j, u ? _mm256_mul_ps(v, _mm256_loadu_ps(u + j)) : v);
    }
#endif
    for (; j < n; j++) out[j] = u ? gelu_tanh1(g[j]) * u[j] : gelu_tanh1(g[j]);
}

/* x[j] = cap * tanh(x[j] / cap) (soft-capping of attention scores, Gemma-2) in place */
static void softcap_rows(float *x, float cap, int64_t n) {
    int64_t j = 0;
#if PK_SIMD
    const __m256 c = _mm256_set1_ps(cap);
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(x + j, _mm256_mul_ps(c, tanh8(_mm256_div_ps(_mm256_loadu_ps(x + j), c))));
#endif
    for (; j < n; j++) x[j] = cap * tanh1(x[j] / cap);
}

/* GPT-OSS's expert activation (poly/nn/moe.py clamped_swiglu): gate capped above at lim, up
 * clipped to +-lim, (up + 1) * gate * sigmoid(a * gate); NaN stays NaN as in numpy (min/max
 * take their second operand on NaN, so x goes second) */
static void clamped_swiglu_rows(const float *g, const float *u, float *out, int64_t n, float a, float lim) {
    int64_t j = 0;
#if PK_SIMD
    const __m256 vl = _mm256_set1_ps(lim), nl = _mm256_set1_ps(-lim), va = _mm256_set1_ps(-a), one = _mm256_set1_ps(1.0f);
    for (; j + 8 <= n; j += 8) {
        const __m256 gj = _mm256_min_ps(vl, _mm256_loadu_ps(g + j));
        const __m256 uj = _mm256_min_ps(vl, _mm256_max_ps(nl, _mm256_loadu_ps(u + j)));
        const __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_mul_ps(va, gj))));
        _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_add_ps(uj, one), _mm256_mul_ps(gj, s)));
    }
#endif
    for (; j < n; j++) {
        const float gj = g[j] > lim ? lim : g[j];
        const float uj = u[j] > lim ? lim : (u[j] < -lim ? -lim : u[j]);
        out[j] = (uj + 1.0f) * (gj * (1.0f / (1.0f + expf(-a * gj))));
    }
}

#if PK_SIMD
/* 8 rows of 8 floats (src, row stride lds elements of kind K_F32, K_F16 or K_BF16, read by
 * load8) stored transposed (the gemm panels' packing, the K-quant prompt panels' codes and
 * scales on AVX2): dst[j * ldd + i] = src[i * lds + j] */
static inline __attribute__((always_inline)) void transpose8(const void *src, int64_t lds, float *dst, int64_t ldd,
                                                             const int kind) {
    const int64_t esz = kind == K_F32 ? 4 : 2;
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = load8(kind, (const uint8_t *)src + i * lds * esz, 0);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}
#endif

#endif /* POLY_CORE_ACTIVATIONS_H */

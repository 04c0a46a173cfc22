/* poly._ckernels: out[n, m] = x[n, k] @ W.T for few input rows (decode, batched decode),
 * reading W in its stored form, parallel over output rows with OpenMP.
 *
 * One entry point, matmul(kind, x, out, w, aux, n, k, m): buffers are taken with the buffer
 * protocol and their byte sizes checked against (kind, n, k, m) here, so a wrong call raises
 * ValueError instead of reading out of bounds (poly/ckernels.py validates dtypes first and
 * raises poly errors). Sums are float32 with many independent lanes (AVX2/FMA when compiled
 * for it, otherwise plain loops gcc vectorizes).
 *
 * Quantized kinds are read as 32-element blocks: value = q * D + M with q the block's codes,
 * D a scale and M an offset, so sum_j w_j x_j = D * (q . x) + M * sum(x block).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PK_SIMD 1
#else
#define PK_SIMD 0
#endif

enum { K_F32, K_F16, K_BF16, K_I8, K_LOOM_Q4, K_Q4_0, K_Q4_1, K_Q8_0, K_Q4_K, K_Q6_K, K_COUNT };

static int g_threads = 1;
#define MAX_N 16
#define XL_SCALE 254.0f /* q8 scheme: residual code step, dx / 254 */
#define SERIAL_WORK 65536 /* below this many weights one thread is faster than waking others */

typedef struct {
    const float *x;   /* [n, k] (Loom Q4: each 32-block reordered evens then odds) */
    const float *xs;  /* [n, nb] block sums of x */
    float *out;       /* [n, m] */
    const uint8_t *w; /* kind-specific weight bytes */
    const float *aux; /* Loom Q4 block scales / int8 row scales */
    const int8_t *xq; /* q8 scheme: x as int8 per 32-block, [n, k] */
    const float *dx;  /* q8 scheme: block scales of xq, [n, nb] */
    int64_t n, k, m, rb, nb; /* rb = bytes per stored row, nb = 32-blocks per row */
} mm_args;

static inline float h2f(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if PK_SIMD
    return _cvtsh_ss(h);
#else
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, f = h & 1023, u;
    if (e == 31) u = s | 0x7F800000u | (f << 13);
    else if (e) u = s | ((e + 112) << 23) | (f << 13);
    else { float v = (float)f * 5.9604644775390625e-08f; memcpy(&u, &v, 4); u |= s; }
    float r; memcpy(&r, &u, 4); return r;
#endif
}

/* ---- dense rows (any k): float32, float16, bfloat16, int8 codes x row scale ------------- */

static inline float load1(int kind, const uint8_t *row, int64_t j) {
    switch (kind) {
    case K_F32: return ((const float *)row)[j];
    case K_F16: return h2f(row + 2 * j);
    case K_BF16: { uint32_t u = (uint32_t)((const uint16_t *)row)[j] << 16; float f; memcpy(&f, &u, 4); return f; }
    default: return (float)((const int8_t *)row)[j];
    }
}

#if PK_SIMD
static inline __m256 load8(int kind, const uint8_t *row, int64_t j) {
    switch (kind) {
    case K_F32: return _mm256_loadu_ps((const float *)row + j);
    case K_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * j)));
    case K_BF16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * j))), 16));
    default:
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + j))));
    }
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* Dense rows (float16/bfloat16/int8 codes; float32 matrices go to BLAS) sum in float32 with
 * four independent 8-wide accumulators, like BLAS sgemv: the same precision class as the
 * dequantize + sgemm prefill path, at memory speed. */
static inline __attribute__((always_inline)) float dense_dot(int kind, const uint8_t *row,
                                                             const float *x, int64_t k) {
    int64_t j = 0;
    float s = 0.0f;
#if PK_SIMD
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; j + 32 <= k; j += 32) {
        a0 = _mm256_fmadd_ps(load8(kind, row, j), _mm256_loadu_ps(x + j), a0);
        a1 = _mm256_fmadd_ps(load8(kind, row, j + 8), _mm256_loadu_ps(x + j + 8), a1);
        a2 = _mm256_fmadd_ps(load8(kind, row, j + 16), _mm256_loadu_ps(x + j + 16), a2);
        a3 = _mm256_fmadd_ps(load8(kind, row, j + 24), _mm256_loadu_ps(x + j + 24), a3);
    }
    for (; j + 8 <= k; j += 8) a0 = _mm256_fmadd_ps(load8(kind, row, j), _mm256_loadu_ps(x + j), a0);
    s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
    float acc[8] = {0};
    for (; j + 8 <= k; j += 8)
        for (int l = 0; l < 8; l++) acc[l] += load1(kind, row, j + l) * x[j + l];
    for (int l = 0; l < 8; l++) s += acc[l];
#endif
    for (; j < k; j++) s += load1(kind, row, j) * x[j];
    return s;
}

static inline __attribute__((always_inline)) void dense_row(int kind, const mm_args *A, int64_t r) {
    const int64_t esz = kind == K_F32 ? 4 : (kind == K_I8 ? 1 : 2);
    const uint8_t *row = A->w + r * A->k * esz;
    const float scale = kind == K_I8 ? A->aux[r] : 1.0f;
    for (int64_t i = 0; i < A->n; i++)
        A->out[i * A->m + r] = scale * dense_dot(kind, row, A->x + i * A->k, A->k);
}

/* ---- 32-element quantized blocks ---------------------------------------------------------- */

/* Scalar decoders: codes of block b of row r as floats q[32], value = q * D + M. */
static inline void q4_nibbles(const uint8_t *p, uint8_t x, float *q) {
    for (int l = 0; l < 16; l++) {
        q[l] = (float)((p[l] ^ x) & 15);
        q[l + 16] = (float)((p[l] ^ x) >> 4);
    }
}

static inline void k4_scale_min(int j, const uint8_t *s, int *sc, int *mn) {
    if (j < 4) { *sc = s[j] & 63; *mn = s[j + 4] & 63; }
    else { *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4); *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}

static inline void dec_scalar(int kind, const mm_args *A, int64_t r, int64_t b, float *q, float *D, float *M) {
    const uint8_t *row = A->w + r * A->rb;
    switch (kind) {
    case K_LOOM_Q4: /* nibble ^ 8 = code + 8; x is reordered so lows then highs line up */
        q4_nibbles(A->w + (r * A->nb + b) * 16, 0x88, q);
        *D = A->aux[r * A->nb + b]; *M = -8.0f * *D; return;
    case K_Q4_0:
        q4_nibbles(row + b * 18 + 2, 0, q); *D = h2f(row + b * 18); *M = -8.0f * *D; return;
    case K_Q4_1:
        q4_nibbles(row + b * 20 + 4, 0, q); *D = h2f(row + b * 20); *M = h2f(row + b * 20 + 2); return;
    case K_Q8_0: {
        const int8_t *c = (const int8_t *)(row + b * 34 + 2);
        for (int l = 0; l < 32; l++) q[l] = (float)c[l];
        *D = h2f(row + b * 34); *M = 0.0f; return;
    }
    case K_Q4_K: {
        const uint8_t *p = row + (b / 8) * 144, *qs = p + 16 + 32 * ((b % 8) / 2);
        int sc, mn, sh = 4 * (b & 1);
        k4_scale_min((int)(b % 8), p + 4, &sc, &mn);
        for (int l = 0; l < 32; l++) q[l] = (float)((qs[l] >> sh) & 15);
        *D = h2f(p) * (float)sc; *M = -h2f(p + 2) * (float)mn; return;
    }
    default: { /* K_Q6_K: 16-element scale groups, folded into q */
        const uint8_t *p = row + (b / 8) * 210;
        int j = (int)(b % 8), h = j / 4, t = j % 4;
        const uint8_t *ql = p + h * 64 + (t & 1) * 32, *qh = p + 128 + h * 32;
        const int8_t *sc = (const int8_t *)(p + 192) + h * 8 + 2 * t;
        for (int l = 0; l < 32; l++) {
            int c = ((ql[l] >> (4 * (t >> 1))) & 15) | (((qh[l] >> (2 * t)) & 3) << 4);
            q[l] = (float)(c - 32) * (float)sc[l / 16];
        }
        *D = h2f(p + 208); *M = 0.0f; return;
    }
    }
}

#if PK_SIMD
static inline void widen_u8(__m256i b, __m256 v[4]) { /* 32 uint8 -> 4 x 8 floats */
    __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

static inline void widen_i8(__m256i b, __m256 v[4]) {
    __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

static inline void nib16(const uint8_t *p, uint8_t x, __m256 v[4]) { /* lows 0..15, highs 16..31 */
    __m128i b = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_set1_epi8((char)x));
    __m128i m = _mm_set1_epi8(15);
    widen_u8(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m)), v);
}

static inline void dec_simd(int kind, const mm_args *A, int64_t r, int64_t b, __m256 v[4], float *D, float *M) {
    const uint8_t *row = A->w + r * A->rb;
    switch (kind) {
    case K_LOOM_Q4:
        nib16(A->w + (r * A->nb + b) * 16, 0x88, v); *D = A->aux[r * A->nb + b]; *M = -8.0f * *D; return;
    case K_Q4_0: nib16(row + b * 18 + 2, 0, v); *D = h2f(row + b * 18); *M = -8.0f * *D; return;
    case K_Q4_1: nib16(row + b * 20 + 4, 0, v); *D = h2f(row + b * 20); *M = h2f(row + b * 20 + 2); return;
    case K_Q8_0:
        widen_i8(_mm256_loadu_si256((const __m256i *)(row + b * 34 + 2)), v);
        *D = h2f(row + b * 34); *M = 0.0f; return;
    case K_Q4_K: {
        const uint8_t *p = row + (b / 8) * 144, *qs = p + 16 + 32 * ((b % 8) / 2);
        int sc, mn;
        k4_scale_min((int)(b % 8), p + 4, &sc, &mn);
        __m256i q = _mm256_loadu_si256((const __m256i *)qs);
        if (b & 1) q = _mm256_srli_epi16(q, 4);
        widen_u8(_mm256_and_si256(q, _mm256_set1_epi8(15)), v);
        *D = h2f(p) * (float)sc; *M = -h2f(p + 2) * (float)mn; return;
    }
    default: {
        float q[32];
        dec_scalar(kind, A, r, b, q, D, M);
        for (int l = 0; l < 4; l++) v[l] = _mm256_loadu_ps(q + 8 * l);
    }
    }
}
#endif

/* One output row: decode each block once, dot it with every input row. */
static inline __attribute__((always_inline)) void quant_row(int kind, const mm_args *A, int64_t r, int64_t n) {
    float acc[MAX_N], macc[MAX_N];
    for (int64_t i = 0; i < n; i++) acc[i] = macc[i] = 0.0f;
#if PK_SIMD
    __m256 vacc[MAX_N];
    for (int64_t i = 0; i < n; i++) vacc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < A->nb; b++) {
        __m256 v[4];
        float D, M;
        dec_simd(kind, A, r, b, v, &D, &M);
        const __m256 vd = _mm256_set1_ps(D);
        for (int64_t i = 0; i < n; i++) {
            const float *xb = A->x + i * A->k + b * 32;
            __m256 s = _mm256_mul_ps(v[0], _mm256_loadu_ps(xb));
            s = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), s);
            s = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xb + 16), s);
            s = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), s);
            vacc[i] = _mm256_fmadd_ps(vd, s, vacc[i]);
            macc[i] += M * A->xs[i * A->nb + b];
        }
    }
    for (int64_t i = 0; i < n; i++) acc[i] = hsum(vacc[i]);
#else
    for (int64_t b = 0; b < A->nb; b++) {
        float q[32], D, M;
        dec_scalar(kind, A, r, b, q, &D, &M);
        for (int64_t i = 0; i < n; i++) {
            const float *xb = A->x + i * A->k + b * 32;
            float s[8] = {0};
            for (int l = 0; l < 32; l++) s[l & 7] += q[l] * xb[l];
            acc[i] += D * (((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])));
            macc[i] += M * A->xs[i * A->nb + b];
        }
    }
#endif
    for (int64_t i = 0; i < n; i++) A->out[i * A->m + r] = acc[i] + macc[i];
}

#if PK_SIMD
/* q8 scheme: integer dot products of the stored codes with the int8 activation codes
 * (like llama.cpp's q8 activations, plus a residual code): exact int32 sums, * D * dx per block. */
static inline __m256i dot_u8s8(__m256i u, __m256i s) { /* 8 int32 sums of 4 u8*s8 products */
#ifdef __AVXVNNI__
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline __m256i dot_s8s8(__m256i q, __m256i s) {
    return dot_u8s8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(s, q));
}

static inline __m256i nib16_i(const uint8_t *p, uint8_t x) {
    __m128i b = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_set1_epi8((char)x));
    __m128i m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

static inline __attribute__((always_inline)) void quant_row_q8(int kind, const mm_args *A, int64_t r, int64_t n) {
    const uint8_t *row = A->w + r * A->rb;
    __m256 vacc[MAX_N];
    float macc[MAX_N];
    for (int64_t i = 0; i < n; i++) { vacc[i] = _mm256_setzero_ps(); macc[i] = 0.0f; }
    for (int64_t b = 0; b < A->nb; b++) {
        __m256i q;
        float D, M = 0.0f;
        int sgn = 0;
        __m256 lane = _mm256_set1_ps(1.0f);
        switch (kind) {
        case K_LOOM_Q4: q = nib16_i(A->w + (r * A->nb + b) * 16, 0x88); D = A->aux[r * A->nb + b]; M = -8.0f * D; break;
        case K_Q4_0: q = nib16_i(row + b * 18 + 2, 0); D = h2f(row + b * 18); M = -8.0f * D; break;
        case K_Q4_1: q = nib16_i(row + b * 20 + 4, 0); D = h2f(row + b * 20); M = h2f(row + b * 20 + 2); break;
        case K_Q8_0: q = _mm256_loadu_si256((const __m256i *)(row + b * 34 + 2)); D = h2f(row + b * 34); sgn = 1; break;
        case K_I8: q = _mm256_loadu_si256((const __m256i *)(A->w + r * A->k + b * 32)); D = A->aux[r]; sgn = 1; break;
        case K_Q4_K: {
            const uint8_t *p = row + (b / 8) * 144, *qs = p + 16 + 32 * ((b % 8) / 2);
            int sc, mn;
            k4_scale_min((int)(b % 8), p + 4, &sc, &mn);
            q = _mm256_loadu_si256((const __m256i *)qs);
            if (b & 1) q = _mm256_srli_epi16(q, 4);
            q = _mm256_and_si256(q, _mm256_set1_epi8(15));
            D = h2f(p) * (float)sc; M = -h2f(p + 2) * (float)mn;
            break;
        }
        default: { /* Q6_K: (6-bit code - 32) signed, two 16-element scale groups per lane half */
            const uint8_t *p = row + (b / 8) * 210;
            int j = (int)(b % 8), h = j / 4, t = j % 4;
            __m256i ql = _mm256_loadu_si256((const __m256i *)(p + h * 64 + (t & 1) * 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + h * 32));
            ql = _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (t >> 1)), _mm256_set1_epi8(15));
            qh = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), _mm256_set1_epi8(3));
            q = _mm256_sub_epi8(_mm256_or_si256(ql, _mm256_slli_epi16(qh, 4)), _mm256_set1_epi8(32));
            const int8_t *sc = (const int8_t *)(p + 192) + h * 8 + 2 * t;
            lane = _mm256_set_m128(_mm_set1_ps((float)sc[1]), _mm_set1_ps((float)sc[0]));
            D = h2f(p + 208); sgn = 1;
        }
        }
        for (int64_t i = 0; i < n; i++) {
            const int8_t *xb = A->xq + (i * A->nb + b) * 64; /* [32 high codes, 32 low codes] */
            __m256i xh = _mm256_loadu_si256((const __m256i *)xb), xl = _mm256_loadu_si256((const __m256i *)(xb + 32));
            __m256i ih = sgn ? dot_s8s8(q, xh) : dot_u8s8(q, xh), il = sgn ? dot_s8s8(q, xl) : dot_u8s8(q, xl);
            __m256 s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(il), _mm256_set1_ps(1.0f / XL_SCALE), _mm256_cvtepi32_ps(ih));
            if (kind == K_Q6_K) s = _mm256_mul_ps(s, lane);
            vacc[i] = _mm256_fmadd_ps(_mm256_set1_ps(D * A->dx[i * A->nb + b]), s, vacc[i]);
            macc[i] += M * A->xs[i * A->nb + b];
        }
    }
    for (int64_t i = 0; i < n; i++) A->out[i * A->m + r] = hsum(vacc[i]) + macc[i];
}
#define Q8ROW(KIND, n) quant_row_q8(KIND, A, r, n)
#else
#define Q8ROW(KIND, n) quant_row(KIND, A, r, n)
#endif

/* Rows are streamed once: ask for a row a few ahead so its cache-line misses overlap the
 * decoding of this one (the hardware prefetcher alone left the 4-bit kernels at ~4 GB/s). */
#ifndef PF_ROWS
#define PF_ROWS 4
#endif
static inline void prefetch_row(const mm_args *A, int64_t r) {
    if (r >= A->m) return;
    const char *p = (const char *)(A->w + r * A->rb);
    for (int64_t o = 0; o < A->rb; o += 64) __builtin_prefetch(p + o, 0, 0);
}

/* The row loop, instantiated per kind so the decoders inline with a constant `kind`. */
#define ROWS(NAME, BODY)                                                                     \
    static void NAME(const mm_args *A, int nt) {                                             \
        const int64_t m = A->m, n = A->n;                                                    \
        (void)n;                                                                             \
        _Pragma("omp parallel for schedule(static) num_threads(nt)")                         \
        for (int64_t r = 0; r < m; r++) {                                                    \
            prefetch_row(A, r + PF_ROWS);                                                    \
            BODY;                                                                            \
        }                                                                                    \
    }
#define DENSE(NAME, KIND) ROWS(NAME, dense_row(KIND, A, r))
#define QUANT(NAME, KIND) ROWS(NAME, if (n == 1) quant_row(KIND, A, r, 1); else quant_row(KIND, A, r, n))
#define QUANT8(NAME, KIND) ROWS(NAME, if (n == 1) Q8ROW(KIND, 1); else Q8ROW(KIND, n))

DENSE(mm_f32, K_F32)
DENSE(mm_f16, K_F16)
DENSE(mm_bf16, K_BF16)
DENSE(mm_i8, K_I8)
QUANT(mm_loom_q4, K_LOOM_Q4)
QUANT(mm_q4_0, K_Q4_0)
QUANT(mm_q4_1, K_Q4_1)
QUANT(mm_q8_0, K_Q8_0)
QUANT(mm_q4_k, K_Q4_K)
QUANT(mm_q6_k, K_Q6_K)
QUANT8(mm8_i8, K_I8)
QUANT8(mm8_loom_q4, K_LOOM_Q4)
QUANT8(mm8_q4_0, K_Q4_0)
QUANT8(mm8_q4_1, K_Q4_1)
QUANT8(mm8_q8_0, K_Q8_0)
QUANT8(mm8_q4_k, K_Q4_K)
QUANT8(mm8_q6_k, K_Q6_K)

typedef void (*mm_fn)(const mm_args *, int);
static const mm_fn FNS[K_COUNT] = {mm_f32, mm_f16, mm_bf16, mm_i8, mm_loom_q4,
                                   mm_q4_0, mm_q4_1, mm_q8_0, mm_q4_k, mm_q6_k};
/* bytes per 32-block (quantized kinds; block size 256 for K-quants) and element size (dense) */
static const int BLOCK_BYTES[K_COUNT] = {0, 0, 0, 0, 16, 18, 20, 34, 144, 210};
static const int BLOCK_ELEMS[K_COUNT] = {1, 1, 1, 1, 32, 32, 32, 32, 256, 256};
static const mm_fn FNS8[K_COUNT] = {NULL, NULL, NULL, mm8_i8, mm8_loom_q4,
                                    mm8_q4_0, mm8_q4_1, mm8_q8_0, mm8_q4_k, mm8_q6_k};
static const int ELEM_BYTES[K_COUNT] = {4, 2, 2, 1, 0, 0, 0, 0, 0, 0};

/* ---- dequantize rows [r0, r1) to float32 (prefill: a block of rows, then BLAS sgemm) ---------
 * Each value is computed with the same float32 operations, in the same order, as gguf-py's numpy
 * dequantizers (and poly's numpy decoders), so the result is bitwise equal: contraction into FMA
 * is switched off here, it would round d * q + m once instead of twice. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif

typedef struct {
    const uint8_t *w; /* stored rows, rb bytes each (Loom Q4: the packed nibbles) */
    const float *aux; /* int8 row scales / Loom Q4 block scales */
    float *out;       /* [r1 - r0, k] */
    int64_t k, rb, r0, r1;
} dq_args;

static void dq_row(int kind, const dq_args *A, int64_t r, float *dst) {
    const int64_t k = A->k;
    const uint8_t *row = A->w + r * A->rb;
    switch (kind) {
    case K_F32: memcpy(dst, row, (size_t)k * 4); return;
    case K_F16: {
        int64_t j = 0;
#if PK_SIMD
        for (; j + 8 <= k; j += 8) _mm256_storeu_ps(dst + j, load8(K_F16, row, j));
#endif
        for (; j < k; j++) dst[j] = h2f(row + 2 * j);
        return;
    }
    case K_BF16:
        for (int64_t j = 0; j < k; j++) {
            uint32_t u = (uint32_t)((const uint16_t *)row)[j] << 16;
            memcpy(dst + j, &u, 4);
        }
        return;
    case K_I8: {
        const int8_t *c = (const int8_t *)row;
        const float s = A->aux[r];
        for (int64_t j = 0; j < k; j++) dst[j] = (float)c[j] * s;
        return;
    }
    case K_LOOM_Q4: { /* blocks of the flat matrix may straddle rows: index elements */
        const int64_t e0 = r * k;
        for (int64_t j = 0; j < k; j++) {
            const int64_t e = e0 + j, b = e >> 5, l = e & 31;
            const uint8_t byte = A->w[b * 16 + (l >> 1)];
            const int c = (int)(((l & 1) ? byte >> 4 : byte & 15) ^ 8) - 8;
            dst[j] = (float)c * A->aux[b];
        }
        return;
    }
    case K_Q4_0:
        for (int64_t b = 0; b < k / 32; b++, dst += 32) {
            const uint8_t *p = row + b * 18 + 2;
            const float d = h2f(row + b * 18);
            for (int l = 0; l < 16; l++) {
                dst[l] = d * (float)((p[l] & 15) - 8);
                dst[l + 16] = d * (float)((p[l] >> 4) - 8);
            }
        }
        return;
    case K_Q4_1:
        for (int64_t b = 0; b < k / 32; b++, dst += 32) {
            const uint8_t *p = row + b * 20 + 4;
            const float d = h2f(row + b * 20), m = h2f(row + b * 20 + 2);
            for (int l = 0; l < 16; l++) {
                dst[l] = d * (float)(p[l] & 15) + m;
                dst[l + 16] = d * (float)(p[l] >> 4) + m;
            }
        }
        return;
    case K_Q8_0:
        for (int64_t b = 0; b < k / 32; b++, dst += 32) {
            const int8_t *c = (const int8_t *)(row + b * 34 + 2);
            const float d = h2f(row + b * 34);
            for (int l = 0; l < 32; l++) dst[l] = (float)c[l] * d;
        }
        return;
    case K_Q4_K:
        for (int64_t s = 0; s < k / 256; s++) {
            const uint8_t *p = row + s * 144;
            const float d = h2f(p), dmin = h2f(p + 2);
            for (int j = 0; j < 8; j++, dst += 32) {
                int sc, mn;
                k4_scale_min(j, p + 4, &sc, &mn);
                const float D = d * (float)sc, M = dmin * (float)mn;
                const uint8_t *qs = p + 16 + 32 * (j / 2);
                const int sh = 4 * (j & 1);
                for (int l = 0; l < 32; l++) dst[l] = D * (float)((qs[l] >> sh) & 15) - M;
            }
        }
        return;
    default: /* K_Q6_K */
        for (int64_t s = 0; s < k / 256; s++) {
            const uint8_t *p = row + s * 210;
            const float d = h2f(p + 208);
            for (int j = 0; j < 8; j++, dst += 32) {
                const int h = j / 4, t = j % 4;
                const uint8_t *ql = p + h * 64 + (t & 1) * 32, *qh = p + 128 + h * 32;
                const int8_t *sc = (const int8_t *)(p + 192) + 2 * j;
                const float D0 = d * (float)sc[0], D1 = d * (float)sc[1];
                for (int l = 0; l < 32; l++) {
                    const int c = ((ql[l] >> (4 * (t >> 1))) & 15) | (((qh[l] >> (2 * t)) & 3) << 4);
                    dst[l] = (l < 16 ? D0 : D1) * (float)(c - 32);
                }
            }
        }
    }
}

static void dq_rows(int kind, const dq_args *A, int nt) {
    const int64_t r0 = A->r0, r1 = A->r1, k = A->k;
    if ((r1 - r0) * k < SERIAL_WORK) nt = 1;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = r0; r < r1; r++) dq_row(kind, A, r, A->out + (r - r0) * k);
}
#pragma GCC pop_options

/* ---- Python glue -------------------------------------------------------------------------- */

static int want_len(Py_buffer *v, int64_t want, const char *what) {
    if (v->len != want) {
        PyErr_Format(PyExc_ValueError, "%s has %zd bytes, expected %lld", what, v->len, (long long)want);
        return -1;
    }
    return 0;
}

static int check_sizes(int kind, Py_buffer *bx, Py_buffer *bo, Py_buffer *bw, Py_buffer *ba, mm_args *A) {
    const int64_t n = A->n, k = A->k, m = A->m;
    if (want_len(bx, n * k * 4, "x") || want_len(bo, n * m * 4, "out")) return -1;
    if (kind <= K_I8) {
        A->rb = k * ELEM_BYTES[kind];
        if (want_len(bw, m * A->rb, "w")) return -1;
        return kind == K_I8 ? want_len(ba, m * 4, "row scales") : 0;
    }
    if (k % BLOCK_ELEMS[kind]) {
        PyErr_Format(PyExc_ValueError, "k=%lld is not a multiple of %d", (long long)k, BLOCK_ELEMS[kind]);
        return -1;
    }
    A->nb = k / 32;
    A->rb = k / BLOCK_ELEMS[kind] * BLOCK_BYTES[kind];
    if (want_len(bw, m * A->rb, "w")) return -1;
    return kind == K_LOOM_Q4 ? want_len(ba, m * A->nb * 4, "block scales") : 0;
}

/* x with every 32-block reordered [x0, x2, ..., x30, x1, x3, ..., x31] (Loom nibble order) */
static void loom_order(const float *x, float *dst, int64_t len) {
    for (int64_t b = 0; b + 32 <= len; b += 32)
        for (int l = 0; l < 16; l++) { dst[b + l] = x[b + 2 * l]; dst[b + 16 + l] = x[b + 2 * l + 1]; }
}

/* q8 scheme: x as two int8 codes per element, x ~= dx * (xh + xl / 254) with dx = max|x| / 127
 * per 32-block: xh = round(x / dx), xl = round((x / dx - xh) * 254). Two integer dot products
 * give ~15-bit activations (error <= dx / 508 per element) at integer speed. */
static void quantize_x(const float *x, int8_t *xq, float *dx, int64_t nblocks) {
    for (int64_t i = 0; i < nblocks; i++) {
        const float *xb = x + i * 32;
        int8_t *h = xq + i * 64, *lo = h + 32;
        float amax = 0.0f;
        for (int l = 0; l < 32; l++) amax = fmaxf(amax, fabsf(xb[l]));
        if (!isfinite(amax)) { dx[i] = NAN; memset(h, 0, 64); continue; }
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        dx[i] = d;
        for (int l = 0; l < 32; l++) {
            const float v = xb[l] * id, hv = fminf(fmaxf(rintf(v), -127.0f), 127.0f);
            h[l] = (int8_t)hv;
            lo[l] = (int8_t)fminf(fmaxf(rintf((v - hv) * XL_SCALE), -127.0f), 127.0f);
        }
    }
}

static int run(int kind, mm_args *A, int nt, int q8) {
    float *scratch = NULL;
    if (kind == K_I8 && q8 && PK_SIMD && A->k % 32 == 0) A->nb = A->k / 32;
    else if (kind <= K_I8) q8 = 0;
    if (!PK_SIMD) q8 = 0;
    if (kind > K_I8 || q8) {
        const int64_t nk = A->n * A->k, nbs = A->n * A->nb;
        scratch = malloc((size_t)(2 * nbs + nk) * 4 + 2 * nk + 64);
        if (!scratch) return -1;
        float *xs = scratch, *dx = scratch + nbs, *xp = scratch + 2 * nbs;
        for (int64_t i = 0; i < nbs; i++) {
            float t = 0.0f;
            for (int l = 0; l < 32; l++) t += A->x[i * 32 + l];
            xs[i] = t;
        }
        A->xs = xs;
        if (kind == K_LOOM_Q4) { loom_order(A->x, xp, nk); A->x = xp; }
        if (q8) {
            int8_t *xq = (int8_t *)(xp + nk);
            quantize_x(A->x, xq, dx, nbs);
            A->xq = xq; A->dx = dx;
        }
    }
    if (A->m * A->k < SERIAL_WORK) nt = 1;
    (q8 ? FNS8 : FNS)[kind](A, nt);
    free(scratch);
    return 0;
}

static PyObject *py_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 9) { PyErr_SetString(PyExc_TypeError, "matmul(kind, x, out, w, aux, n, k, m, q8)"); return NULL; }
    long kind = PyLong_AsLong(args[0]);
    mm_args A = {0};
    A.n = PyLong_AsLongLong(args[5]); A.k = PyLong_AsLongLong(args[6]); A.m = PyLong_AsLongLong(args[7]);
    int q8 = PyObject_IsTrue(args[8]);
    if (q8 < 0 || PyErr_Occurred()) return NULL;
    if (kind < 0 || kind >= K_COUNT || A.n < 1 || A.n > MAX_N || A.k < 1 || A.m < 0) {
        PyErr_SetString(PyExc_ValueError, "bad kind or shape");
        return NULL;
    }
    Py_buffer bx = {0}, bo = {0}, bw = {0}, ba = {0};
    PyObject *ret = NULL;
    int have_aux = args[4] != Py_None;
    if (PyObject_GetBuffer(args[1], &bx, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[2], &bo, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done_x;
    if (PyObject_GetBuffer(args[3], &bw, PyBUF_C_CONTIGUOUS) < 0) goto done_o;
    if (have_aux && PyObject_GetBuffer(args[4], &ba, PyBUF_C_CONTIGUOUS) < 0) goto done_w;
    if ((kind == K_I8 || kind == K_LOOM_Q4) && !have_aux) {
        PyErr_SetString(PyExc_ValueError, "this kind needs its scales");
        goto done_a;
    }
    if (check_sizes((int)kind, &bx, &bo, &bw, &ba, &A) < 0) goto done_a;
    A.x = bx.buf; A.out = bo.buf; A.w = bw.buf; A.aux = have_aux ? ba.buf : NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = run((int)kind, &A, g_threads, q8);
    Py_END_ALLOW_THREADS
    if (rc < 0) PyErr_NoMemory();
    else ret = Py_NewRef(Py_None);
done_a:
    if (have_aux) PyBuffer_Release(&ba);
done_w:
    PyBuffer_Release(&bw);
done_o:
    PyBuffer_Release(&bo);
done_x:
    PyBuffer_Release(&bx);
    return ret;
}

/* dequantize(kind, w, aux, m, k, r0, r1, out, threads): rows [r0, r1) of the [m, k] matrix into
 * out; threads 0 = the set_threads value (1 before a BLAS call: idle OpenMP threads spin and
 * starve OpenBLAS's threads on a small machine, measured 7 vs 200+ tok/s prefill) */
static PyObject *py_dequantize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 9) { PyErr_SetString(PyExc_TypeError, "dequantize(kind, w, aux, m, k, r0, r1, out, threads)"); return NULL; }
    long nt = PyLong_AsLong(args[8]);
    long kind = PyLong_AsLong(args[0]);
    int64_t m = PyLong_AsLongLong(args[3]), k = PyLong_AsLongLong(args[4]);
    dq_args A = {0};
    A.k = k; A.r0 = PyLong_AsLongLong(args[5]); A.r1 = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred()) return NULL;
    if (kind < 0 || kind >= K_COUNT || m < 0 || k < 1 || nt < 0 || A.r0 < 0 || A.r0 > A.r1 || A.r1 > m) {
        PyErr_SetString(PyExc_ValueError, "bad kind, shape or row range");
        return NULL;
    }
    if (kind > K_LOOM_Q4 && k % BLOCK_ELEMS[kind]) {
        PyErr_Format(PyExc_ValueError, "k=%lld is not a multiple of %d", (long long)k, BLOCK_ELEMS[kind]);
        return NULL;
    }
    const int have_aux = args[2] != Py_None;
    if ((kind == K_I8 || kind == K_LOOM_Q4) && !have_aux) {
        PyErr_SetString(PyExc_ValueError, "this kind needs its scales");
        return NULL;
    }
    Py_buffer bw = {0}, ba = {0}, bo = {0};
    PyObject *ret = NULL;
    if (PyObject_GetBuffer(args[1], &bw, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (have_aux && PyObject_GetBuffer(args[2], &ba, PyBUF_C_CONTIGUOUS) < 0) goto done_w;
    if (PyObject_GetBuffer(args[7], &bo, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done_a;
    const int64_t nb = (m * k + 31) / 32; /* Loom Q4 blocks of the flat matrix */
    A.rb = kind == K_LOOM_Q4 ? 0 : (kind <= K_I8 ? k * ELEM_BYTES[kind] : k / BLOCK_ELEMS[kind] * BLOCK_BYTES[kind]);
    if (want_len(&bo, (A.r1 - A.r0) * k * 4, "out")) goto done_o;
    if (want_len(&bw, kind == K_LOOM_Q4 ? nb * 16 : m * A.rb, "w")) goto done_o;
    if (kind == K_I8 && want_len(&ba, m * 4, "row scales")) goto done_o;
    if (kind == K_LOOM_Q4 && want_len(&ba, nb * 4, "block scales")) goto done_o;
    A.w = bw.buf; A.aux = have_aux ? ba.buf : NULL; A.out = bo.buf;
    Py_BEGIN_ALLOW_THREADS
    dq_rows((int)kind, &A, nt ? (int)nt : g_threads);
    Py_END_ALLOW_THREADS
    ret = Py_NewRef(Py_None);
done_o:
    PyBuffer_Release(&bo);
done_a:
    if (have_aux) PyBuffer_Release(&ba);
done_w:
    PyBuffer_Release(&bw);
    return ret;
}

static PyObject *py_set_threads(PyObject *self, PyObject *arg) {
    (void)self;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1) { PyErr_SetString(PyExc_ValueError, "threads must be >= 1"); return NULL; }
    g_threads = (int)n;
    return PyLong_FromLong(g_threads);
}

static PyObject *py_info(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
#ifdef _OPENMP
    int omp = 1;
#else
    int omp = 0;
#endif
    return Py_BuildValue("{s:i,s:i,s:i}", "simd", PK_SIMD, "openmp", omp, "threads", g_threads);
}

static PyMethodDef methods[] = {
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_FASTCALL, "out = x @ W.T (see poly.ckernels)"},
    {"dequantize", (PyCFunction)(void (*)(void))py_dequantize, METH_FASTCALL, "rows [r0, r1) as float32"},
    {"set_threads", py_set_threads, METH_O, "threads for the parallel row loop"},
    {"info", py_info, METH_NOARGS, "build facts: simd, openmp, threads"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_ckernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__ckernels(void) { return PyModule_Create(&moddef); }

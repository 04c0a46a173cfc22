/* Dequantizing rows of a stored matrix to float32 (bitwise like the numpy decoders), for the
 * prefill panels (csrc/gemm/gemm.h) and the Python `dequantize` entry. */
#ifndef POLY_GEMM_DEQUANT_H
#define POLY_GEMM_DEQUANT_H
#include "core/common.h"
#include "core/half.h"
#include "formats/pq_decode.h"
#include "rows/dense_dot.h"
#include "formats/block_decode.h"
#include "formats/interleave16.h"

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
    const uint8_t *rp; /* the rows repacked by 16 (csrc/formats/interleave16.h) to read instead of w, or NULL */
    int bf;            /* BF16 gemm panels on vdpbf16ps, x rounded to bf16 (csrc/formats/bf16_rows.h) */
    const void *hk;    /* float16/float32 rows by 16, k-major (csrc/formats/float_kmajor16.h) to read instead of w, or NULL */
    const uint8_t *rk; /* K-quant rows by 8 (record .kil8: csrc/formats/kquant_interleave8_panels.h): the int8 panels decode them, not w; or NULL */
} dq_args;

/* float32 and float16 rows laid out by 16, k-major (csrc/formats/float_kmajor16.h): the kinds as bits */
#define PK_KM16 PK_SIMD /* a gemm panel is one group (AVX2) or two (AVX-512) */
#define KM16_KINDS (PK_KM16 ? (1 << K_F32) | (1 << K_F16) : 0)

/* the bytes of an [m, k] matrix laid out by 16, or -1 where this build, kind or shape takes none */
static inline int64_t km16_bytes(int kind, int64_t m, int64_t k) {
    return kind >= 0 && kind < K_COUNT && (KM16_KINDS >> kind & 1) && m % 16 == 0 && k > 0 ? m * k * (kind == K_F32 ? 4 : 2) : -1;
}

/* the bytes of the copy an entry's `rp` argument holds (*hk: laid out by 16, else repacked by 16:
 * csrc/formats/interleave16.h), or -1 where neither applies */
static inline int64_t rp_bytes(int kind, int64_t m, int64_t k, int *hk) {
    const int64_t b = km16_bytes(kind, m, k);
    *hk = b > 0;
    return *hk ? b : il16_bytes(kind, m, k);
}

static void dq_row(int kind, const dq_args *A, int64_t r, float *dst) {
    const int64_t k = A->k;
    const uint8_t *row = A->w + r * A->rb;
    if (pq_kind(kind) && PK_SIMD) { pq_dq_row(kind, row, k, dst); return; }
    switch (kind) {
    case K_F32: memcpy(dst, row, (size_t)k * 4); return;
    case K_F16: case K_BF16: {
        int64_t j = 0;
#if PK_SIMD
        for (; j + 8 <= k; j += 8) _mm256_storeu_ps(dst + j, load8(kind, row, j));
#endif
        for (; j < k; j++) dst[j] = load1(kind, row, j);
        return;
    }
    case K_I8: {
        const int8_t *c = (const int8_t *)row;
        const float s = A->aux[r];
        for (int64_t j = 0; j < k; j++) dst[j] = (float)c[j] * s;
        return;
    }
    case K_LOOM_Q4: { /* blocks of the flat matrix may straddle rows: index elements */
        const int64_t e0 = r * k;
#if PK_SIMD
        if (k % 32 == 0) { /* whole blocks per row: nibbles (low = even element) on 8 lanes */
            const __m128i m15 = _mm_set1_epi8(15), m8 = _mm_set1_epi8(8);
            for (int64_t b = e0 >> 5; b < (e0 + k) >> 5; b++, dst += 32) {
                const __m128i p = _mm_loadu_si128((const __m128i *)(A->w + b * 16));
                const __m128i lo = _mm_and_si128(p, m15), hi = _mm_and_si128(_mm_srli_epi16(p, 4), m15);
                const __m128i c0 = _mm_sub_epi8(_mm_xor_si128(_mm_unpacklo_epi8(lo, hi), m8), m8);
                const __m128i c1 = _mm_sub_epi8(_mm_xor_si128(_mm_unpackhi_epi8(lo, hi), m8), m8);
                __m256 v[4];
                widen_i8(_mm256_set_m128i(c1, c0), v);
                for (int l = 0; l < 4; l++) _mm256_storeu_ps(dst + 8 * l, _mm256_mul_ps(v[l], _mm256_set1_ps(A->aux[b])));
            }
            return;
        }
#endif
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
#if PK_SIMD /* same operations as the scalar loop, 8 lanes: (q - 8) exactly, then one multiply */
            __m256 v[4];
            nib16(p, 0, v);
            for (int l = 0; l < 4; l++)
                _mm256_storeu_ps(dst + 8 * l, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_sub_ps(v[l], _mm256_set1_ps(8.0f))));
            continue;
#endif
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
#if PK_SIMD /* multiply, then add: rounded twice like numpy (contraction is off here) */
            __m256 v[4];
            nib16(p, 0, v);
            for (int l = 0; l < 4; l++)
                _mm256_storeu_ps(dst + 8 * l, _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(d), v[l]), _mm256_set1_ps(m)));
            continue;
#endif
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
#if PK_SIMD
            __m256 v[4];
            widen_i8(_mm256_loadu_si256((const __m256i *)c), v);
            for (int l = 0; l < 4; l++) _mm256_storeu_ps(dst + 8 * l, _mm256_mul_ps(v[l], _mm256_set1_ps(d)));
            continue;
#endif
            for (int l = 0; l < 32; l++) dst[l] = (float)c[l] * d;
        }
        return;
    default: pq_dq_row(kind, row, k, dst); /* the GGUF kinds (formats/pq_decode.h), Q4_K and Q6_K too */
    }
}

static void dq_rows(int kind, const dq_args *A, int nt) {
    const int64_t r0 = A->r0, r1 = A->r1, k = A->k;
    if ((r1 - r0) * k < SERIAL_WORK) nt = 1;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = r0; r < r1; r++) dq_row(kind, A, r, A->out + (r - r0) * k);
}
#pragma GCC pop_options

#endif /* POLY_GEMM_DEQUANT_H */

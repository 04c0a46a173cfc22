/* Dequantizing rows of a stored matrix to float32 (bitwise like the numpy decoders), for the
 * prefill panels (csrc/gemm/gemm.h) and the Python `dequantize` entry. */
#ifndef POLY_GEMM_DEQUANT_H
#define POLY_GEMM_DEQUANT_H
#include "core/common.h"
#include "core/half.h"
#include "formats/pq_decode.h"
#include "rows/dense_dot.h"
#include "formats/block_decode.h"
#include "formats/block32.h"
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
    int bf;            /* BF16 gemm panels on vdpbf16ps, x rounded to bf16 (csrc/formats/vdpbf16_rows.h) */
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
    if (kind == K_F16 || KINDS[kind]->bf16) { /* 16-bit floats (formats/bf16.h: bfloat16's loads) */
        int64_t j = 0;
#if PK_SIMD
        for (; j + 8 <= k; j += 8) _mm256_storeu_ps(dst + j, load8(kind, row, j));
#endif
        for (; j < k; j++) dst[j] = load1(kind, row, j);
        return;
    }
    switch (kind) {
    case K_F32: memcpy(dst, row, (size_t)k * 4); return;
    case K_I8: {
        const int8_t *c = (const int8_t *)row;
        const float s = A->aux[r];
        for (int64_t j = 0; j < k; j++) dst[j] = (float)c[j] * s;
        return;
    }
    default:
        if (b32_dq_row(kind, A->w, A->aux, row, r, k, dst)) return; /* formats/block32.h */
        pq_dq_row(kind, row, k, dst); /* the GGUF kinds (formats/pq_decode.h), Q4_K and Q6_K too */
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

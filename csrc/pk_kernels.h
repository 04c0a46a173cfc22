/* Shared by the C kernel sources: kind ids, the matmul argument record, and the per-row
 * decoders and dot products (static inline, so every translation unit gets its own copy
 * specialised for a constant kind). */
#ifndef PK_KERNELS_H
#define PK_KERNELS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
/* this thread's number and the team's size in an OpenMP region (0 and 1 without OpenMP) */
#ifdef _OPENMP
static inline int pk_tid(void) { return omp_get_thread_num(); }
static inline int pk_nth(void) { return omp_get_num_threads(); }
#else
static inline int pk_tid(void) { return 0; }
static inline int pk_nth(void) { return 1; }
#endif

/* A thread's scratch buffer, kept between calls (the OpenMP threads persist): a malloc and free
 * per call went through mmap, and page-faulting the fresh pages cost a 512-token prefill ~10 %
 * (pk_gemm.h's panels; pk_r16.h's input codes). Grown when more is asked; never shrunk; valid
 * until the thread's next call. */
static __thread float *tl_buf;
static __thread size_t tl_cap;

static float *thread_buffer(size_t floats) {
    if (floats > tl_cap) {
        free(tl_buf);
        tl_buf = NULL;
        tl_cap = 0;
        if (posix_memalign((void **)&tl_buf, 64, floats * 4)) return tl_buf = NULL;
        tl_cap = floats;
    }
    return tl_buf;
}
/* Every function is static: csrc/pk_unity.h compiles these sources once per instruction set
 * (csrc/pk_isa_*.c, flags in setup.py) and csrc/pk_module.c picks one at import (cpuid). */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PK_SIMD 1
#else
#define PK_SIMD 0
#endif

enum { K_F32, K_F16, K_BF16, K_I8, K_LOOM_Q4, K_Q4_0, K_Q4_1, K_Q8_0, K_Q4_K, K_Q6_K,
       K_Q5_0, K_Q5_1, K_Q2_K, K_Q3_K, K_Q5_K, K_IQ4_NL, K_IQ4_XS, K_COUNT };

/* bytes per 32-block (quantized kinds; block size 256 for K-quants) and element size (dense) */
static const int BLOCK_BYTES[K_COUNT] = {0, 0, 0, 0, 16, 18, 20, 34, 144, 210, 22, 24, 84, 110, 176, 18, 136};
static const int BLOCK_ELEMS[K_COUNT] = {1, 1, 1, 1, 32, 32, 32, 32, 256, 256, 32, 32, 256, 256, 256, 32, 256};
static const int ELEM_BYTES[K_COUNT] = {4, 2, 2, 1};
static int pk_threads; /* set_threads(); defined in poly_kernels.c (one unity build per ISA) */
#define MAX_N 16
/* from this many rows a product runs as gemm panels: below it the row kernels' register tiles.
 * AVX-512: the tiles win up to MAX_N for every kind (SmolLM2 shapes, x 64-byte aligned, 2
 * threads: Q4_1 [1536 x 576] 8 rows 42 vs 92 us, 16 rows 84 vs 115; f16 16 rows 89 vs 118).
 * 8 lanes: the 4-input tiles lose from ~9 rows (1B [8192 x 2048], 16 rows: f32 5.9 vs 3.8 ms,
 * f16 5.7 vs 3.0, Q5-style float rows 4.2 vs 3.1; SmolLM2 f32 12 rows 0.15 vs 0.14) */
#if PK_SIMD && !defined(__AVX512F__)
#define GEMM_ROWS 9
#else
#define GEMM_ROWS (MAX_N + 1)
#endif
/* 8-lane builds' auto mode: Loom Q4 rows on x's two int8 codes where rows are independent (decode,
 * batched decode; a prompt alone keeps the float paths). The float rows' nibble lookups ran
 * slower there: 1B entity q4 decode 34 -> 46 tok/s (AVX-512 the other way: 56 vs 50) */
#if PK_SIMD && !defined(__AVX512F__)
#define PK_LOOM8 1
#else
#define PK_LOOM8 0
#endif
#ifndef ROW_TILE
#if defined(__AVX512F__)
#define ROW_TILE 8 /* input rows per register tile of the quantized row kernels */
#else
#define ROW_TILE 4
#endif
#endif
/* TILE(c, nn) over the n input rows: tiles of ROW_TILE rows, then the rest as one tile (nn a
 * constant; 2 + 1 re-decoded every block for a lone last input: 3 rows cost 5.8 ms against 4.6
 * as one tile on SmolLM2 Q4_1, 7 rows 9.8 against 8.1) */
#define FOR_TILES(n, TILE)                                                                   \
    do {                                                                                     \
        int64_t c_ = 0;                                                                      \
        for (; c_ + ROW_TILE <= (n); c_ += ROW_TILE) TILE(c_, ROW_TILE);                     \
        switch ((n) - c_) {                                                                  \
        case 7: if (ROW_TILE > 7) TILE(c_, 7); break;                                        \
        case 6: if (ROW_TILE > 6) TILE(c_, 6); break;                                        \
        case 5: if (ROW_TILE > 5) TILE(c_, 5); break;                                        \
        case 4: if (ROW_TILE > 4) TILE(c_, 4); break;                                        \
        case 3: TILE(c_, 3); break;                                                          \
        case 2: TILE(c_, 2); break;                                                          \
        case 1: TILE(c_, 1); break;                                                          \
        default: break;                                                                      \
        }                                                                                    \
    } while (0)
#define XL_SCALE 254.0f /* q8 scheme: residual code step, dx / 254 */
#define XK_BYTES 288 /* the auto mode's K-quant x: 256 int8 codes + 16 int16 sums a group (pk_vec.h quantize_k) */
#define SERIAL_WORK 65536 /* below this many weights one thread is faster than waking others */

typedef struct {
    const float *x;   /* [n, k] (Loom Q4: each 32-block reordered evens then odds) */
    const float *xs;  /* [n, nb] block sums of x */
    float *out;       /* [n, m] */
    const uint8_t *w; /* kind-specific weight bytes */
    const float *aux; /* Loom Q4 block scales / int8 row scales */
    const int8_t *xq; /* q8 scheme: x as int8 per 32-block, [n, k] */
    const float *dx;  /* q8 scheme: block scales of xq, [n, nb] */
    const float *xs16; /* q8 scheme: sums of x per 16 elements, [n, 2 nb] (the K-quant offsets) */
    const int8_t *xk;  /* the auto mode's K-quant rows: x's codes per 256 (pk_vec.h quantize_k), [n, nb / 8] groups */
    const float *dk;   /* ... and their scales */
    const int32_t *xo; /* K-quant prompt panels (pk_k8i.h): x's code-offset sums, ocb int32 a block */
    int64_t cb, ocb;   /* ... and xq's bytes a block (64 in the fused step's buffers, 32 packed) */
    int64_t n, k, m, rb, nb; /* rb = bytes per stored row, nb = 32-blocks per row */
    int64_t ldo;             /* out row stride (floats): m, or wider when out is a slice */
    int x1; /* K-quant, Q5_0/Q5_1/IQ4 int8 rows (pk_k8.h, pk_q8.h): x's first code only (the q8 "auto" mode) */
    const uint16_t *xb; /* a prompt's BF16 rows (pk_bf16.h): x rounded to bf16 [n, k], or NULL */
    const uint8_t *rk;  /* Q4_K/Q6_K rows by 8 (pk_r8k_sb.h): the prompt panels decode them, not w; or NULL */
} mm_args;

#include "pk_half.h"

/* Rows are streamed once: ask for a row a few ahead so its cache-line misses overlap the
 * decoding of this one (the hardware prefetcher alone left the 4-bit kernels at ~4 GB/s). */
#ifndef PF_LOC
#define PF_LOC 3
#endif
#ifndef PF_BYTES
#define PF_BYTES 2048
#endif
/* gcc 12 deletes a loop whose body is only __builtin_prefetch (it has no side effects to
 * keep), so the x86 build issues the instruction with volatile asm. */
static inline void prefetch_line(const char *p) {
#if defined(__x86_64__) || defined(__i386__)
#if PF_LOC == 0
    __asm__ volatile("prefetchnta %0" : : "m"(*p));
#else
    __asm__ volatile("prefetcht0 %0" : : "m"(*p));
#endif
#else
    __builtin_prefetch(p, 0, PF_LOC);
#endif
}

/* a line into L2 only: bytes wanted a while ahead, which in L1 would evict the ones in use */
static inline void prefetch_l2(const char *p) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__ volatile("prefetcht1 %0" : : "m"(*p));
#else
    __builtin_prefetch(p, 0, 2);
#endif
}

#include "pk_quants.h"
#include "pk_avx512.h"

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

static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
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
#if PK_AVX512
    s = dense_dot512(kind, row, x, k, &j);
#endif
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; j + 32 <= k; j += 32) {
        a0 = _mm256_fmadd_ps(load8(kind, row, j), _mm256_loadu_ps(x + j), a0);
        a1 = _mm256_fmadd_ps(load8(kind, row, j + 8), _mm256_loadu_ps(x + j + 8), a1);
        a2 = _mm256_fmadd_ps(load8(kind, row, j + 16), _mm256_loadu_ps(x + j + 16), a2);
        a3 = _mm256_fmadd_ps(load8(kind, row, j + 24), _mm256_loadu_ps(x + j + 24), a3);
    }
    for (; j + 8 <= k; j += 8) a0 = _mm256_fmadd_ps(load8(kind, row, j), _mm256_loadu_ps(x + j), a0);
    s += hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
    float acc[8] = {0};
    for (; j + 8 <= k; j += 8)
        for (int l = 0; l < 8; l++) acc[l] += load1(kind, row, j + l) * x[j + l];
    for (int l = 0; l < 8; l++) s += acc[l];
#endif
    for (; j < k; j++) s += load1(kind, row, j) * x[j];
    return s;
}

#include "pk_dense.h"

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

static inline __attribute__((always_inline)) void dec_scalar(int kind, const mm_args *A, int64_t r, int64_t b, float *q, float *D, float *M,
                              pq_cache *pc) {
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
    case K_Q6_K: { /* 16-element scale groups, folded into q */
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
    default: pq_dec_scalar(kind, row, b, q, pc); *D = 1.0f; *M = 0.0f; return;
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

static inline __attribute__((always_inline)) void dec_simd(int kind, const mm_args *A, int64_t r, int64_t b, __m256 v[4], float *D, float *M,
                            pq_cache *pc) {
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
    default: pq_dec_simd(kind, row, b, v, D, M, pc); return;
    }
}
#endif

#include "pk_tiles.h"

/* input rows the row kernels take per pass over a matrix: each weight row is dotted with all of
 * them, so they should stay near L1 (a 16-row pass at k 1,536, 96 KB of x, ran 2x slower than
 * two 8-row passes; with weight rows in pairs, 8 rows of 48 KB in one pass beat two of 4 by ~4 %
 * on SmolLM2's 8-row step). Only for matrices that stay in the caches between passes: a 1B model's
 * matrices (tens of MB) come from memory, where a second pass over the weights costs far more
 * than x from L2 (its 16-token f32 prefill ran at 0.41x llama.cpp with 4-row pieces). */
static inline int64_t row_piece(const mm_args *A) {
    if (A->m * A->rb > ((int64_t)8 << 20)) return MAX_N;
    return A->k * 4 * ROW_TILE <= 65536 ? ROW_TILE : (ROW_TILE > 4 ? 4 : ROW_TILE);
}

#include "pk_k8.h"
#include "pk_q8.h"

/* Called once per row r: asks for the bytes PF_BYTES ahead of row r's, up to the matrix end. */
static inline void prefetch_row(const mm_args *A, int64_t r) {
    const int64_t end = A->m * A->rb, lo = r * A->rb + PF_BYTES;
    const int64_t hi = lo + A->rb < end ? lo + A->rb : end;
    for (int64_t o = lo & ~(int64_t)63; o < hi; o += 64) prefetch_line((const char *)A->w + o);
}


static inline int want_len(Py_buffer *v, int64_t want, const char *what) {
    if (v->len != want) {
        PyErr_Format(PyExc_ValueError, "%s has %zd bytes, expected %lld", what, v->len, (long long)want);
        return -1;
    }
    return 0;
}

/* Byte sizes of a stored [m, k] matrix (and its scales) against its kind; sets A->rb, A->nb. */
static inline int check_matrix(int kind, Py_buffer *bw, Py_buffer *ba, mm_args *A) {
    const int64_t k = A->k, m = A->m;
    if (kind <= K_I8) {
        A->rb = k * ELEM_BYTES[kind];
        A->nb = k / 32;
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


#include "pk_vec.h"
#include "pk_k8i.h"
#include "pk_bf16.h"

static PyObject *pk_py_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
static PyObject *pk_py_gemm(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
static PyObject *pk_py_softmax_causal(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
static PyObject *pk_py_silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
static PyObject *pk_py_rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif /* PK_KERNELS_H */

/* Shared by the C kernel sources: kind ids, the matmul argument record, and the per-row
 * decoders and dot products (static inline, so every translation unit gets its own copy
 * specialised for a constant kind). */
#ifndef POLY_CORE_COMMON_H
#define POLY_CORE_COMMON_H
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
 * (gemm/gemm.h's panels; formats/interleave16.h's input codes). Grown when more is asked; never shrunk; valid
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
/* Every function is static: csrc/isa/unit.h compiles these sources once per instruction set
 * (csrc/isa/unit_*.c, flags in setup.py) and csrc/module.c picks one at import (cpuid). */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PK_SIMD 1
#else
#define PK_SIMD 0
#endif
/* the avx512 build's 16-lane kernels (rows/avx512.h) */
#if PK_SIMD && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PK_AVX512 1
#else
#define PK_AVX512 0
#endif

enum { K_F32, K_F16, K_BF16, K_I8, K_LOOM_Q4, K_Q4_0, K_Q4_1, K_Q8_0, K_Q4_K, K_Q6_K,
       K_Q5_0, K_Q5_1, K_Q2_K, K_Q3_K, K_Q5_K, K_IQ4_NL, K_IQ4_XS, K_MXFP4, K_COUNT };

/* bytes per 32-block (quantized kinds; block size 256 for K-quants) and element size (dense) */
static const int BLOCK_BYTES[K_COUNT] = {0, 0, 0, 0, 16, 18, 20, 34, 144, 210, 22, 24, 84, 110, 176, 18, 136, 17};
static const int BLOCK_ELEMS[K_COUNT] = {1, 1, 1, 1, 32, 32, 32, 32, 256, 256, 32, 32, 256, 256, 256, 32, 256, 32};
static const int ELEM_BYTES[K_COUNT] = {4, 2, 2, 1};

/* A kind's record: what the generic kernels ask of a stored kind instead of naming it. A
 * format's own file defines its kinds' records; formats/kinds.h maps kind -> record (KINDS).
 * Read with a constant kind (the range functions are made per kind) every field folds away. */
enum { KQP_MIN16, KQP_MIN32, KQP_OFF32, KQP_OFF4, KQP_OFF128 }; /* formats/kquant_panels.h kqp_form */
enum { KIL8_NONE, KIL8_NIB, KIL8_SIX }; /* rows repacked by 8: nibbles + 6-bit scales, or 6-bit codes */
enum { IL16_NONE, IL16_SYM, IL16_MIN, IL16_Q8, IL16_I8 }; /* rows repacked by 16 (formats/interleave16.h): 4-bit codes
                                                          * with M = -8 D, with float16 M, 8-bit codes, int8 rows */
enum { AUX_NONE, AUX_ROWS, AUX_BLOCKS }; /* a matrix's float32 scales array (aux): none, one a row, one a 32-block */
typedef struct {
    uint8_t pq;        /* decoded by the 32-element sub-block decoder (formats/pq_decode.h) */
    uint8_t super;     /* its 8 sub-block scales unpacked together, a super-block at a time */
    uint8_t halves;    /* a scale per 16 elements (else one scale and offset per 32) */
    uint8_t sgn;       /* int8 rows: signed codes (the sign trick in the dot) */
    uint8_t k8;        /* int8 rows a 256-element super-block at a time (formats/kquant_rows.h) */
    uint8_t pq8;       /* auto mode: decode rows on x's first code (rows/int8_rows.h pq8_row) */
    uint8_t pq8_sb;    /* ... its 8 scales decoded once a super-block */
    uint8_t m32;       /* ... an offset a 32-block, on x's code sums */
    uint8_t m16;       /* int8 rows: an offset per 16 elements, on x's float sums */
    uint8_t kqp;       /* prompts on the int8 panels (formats/kquant_panels.h): 1, or 2 with KQP_IQ4 */
    uint8_t kqp_form;  /* ... how its offsets are taken (KQP_*) */
    uint8_t kqp_pairs; /* ... maddubs results its int16 lanes can sum before madd widens them */
    uint8_t kil8;      /* its rows repacked by 8 (formats/kquant_interleave8*.h): KIL8_* */
    uint8_t bf16;      /* bfloat16 elements (formats/bf16.h: the dense loaders) */
    uint8_t vdpbf;     /* a prompt's rows on vdpbf16ps when x is rounded too (formats/vdpbf16_rows.h) */
    uint8_t aux;       /* its float32 scales array: AUX_* */
    uint8_t flat;      /* one stream of 16-byte nibble blocks over the whole matrix (rb 0, k % 32 == 0), x's
                        * 32-blocks reordered evens then odds to meet them (core/activations.h loom_order) */
    uint8_t loom8;     /* 8-lane builds' auto mode: its decode rows on x's int8 codes (PK_LOOM8) */
    uint8_t nib4;      /* 4-bit codes: 16-lane rows look its 16 values up (rows/avx512.h deq512) */
    uint8_t il16;      /* its rows repacked by 16: IL16_* */
} kind_rec;
static int pk_threads = 1; /* set_threads() (isa/methods.h): threads of the parallel loops */
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
#define XK_BYTES 288 /* the auto mode's K-quant x: 256 int8 codes + 16 int16 sums a group (core/activations.h quantize_k) */
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
    const int8_t *xk;  /* the auto mode's K-quant rows: x's codes per 256 (core/activations.h quantize_k), [n, nb / 8] groups */
    const float *dk;   /* ... and their scales */
    const int32_t *xo; /* K-quant prompt panels (formats/kquant_panels.h): x's code-offset sums, ocb int32 a block */
    int64_t cb, ocb;   /* ... and xq's bytes a block (64 in the fused step's buffers, 32 packed) */
    int64_t n, k, m, rb, nb; /* rb = bytes per stored row, nb = 32-blocks per row */
    int64_t ldo;             /* out row stride (floats): m, or wider when out is a slice */
    int x1; /* K-quant, Q5_0/Q5_1/IQ4 int8 rows (formats/kquant_rows.h, rows/int8_rows.h): x's first code only (the q8 "auto" mode) */
    const uint16_t *xb; /* a prompt's BF16 rows (formats/vdpbf16_rows.h): x rounded to bf16 [n, k], or NULL */
    const uint8_t *rk;  /* Q4_K/Q6_K rows by 8 (formats/kquant_interleave8_panels.h): the prompt panels decode them, not w; or NULL */
} mm_args;

#endif /* POLY_CORE_COMMON_H */

/* K-quant prompts on int8 codes (the q8 scheme's "auto" mode, KQP_MIN or more input rows; this
 * file's tiles are AVX-512's, csrc/formats/kquant_panels_avx2.h has AVX2's). Why: a prompt's products are compute-bound, and vpdpbusd does 64 multiply-adds per
 * instruction where the float gemm's FMA does 16 and the int16 panels' vpdpwssd 32.
 *
 * A panel of 16 weight rows is decoded once (k8_scales / k8_codes2) into one weight row per
 * 32-bit vector lane: per super-block, 64 vectors of codes (vector q holds k = 4q..4q+3 of the 16
 * rows: byte 4r + i = row r's code at 4q + i), then 16 vectors of S = D * s and 16 of the offsets o
 * (per 16 weights, 16 rows), KQP_SB bytes. x takes one int8 code per element with one scale per
 * 32 (x ~= dx * c, dx = max|x| / 127, Q8_0's activations; llama.cpp's Q8_K has one per 256) and the
 * sums dx * sum(c) per 16. An input's 4 codes at a time are broadcast and meet 4 codes of 16 rows
 * in one vpdpbusd; per 16 weights the int32 sums take S (cvt, mul), per 32 dx (fma) and the offsets
 * (o * the code sums), so every output row is a lane and no horizontal sum is left.
 * The result is exact for x's codes (the dot product of the stored weights with dx * c): the error
 * is x's rounding, <= dx / 2 per element. */
#ifndef POLY_FORMATS_KQUANT_PANELS_H
#define POLY_FORMATS_KQUANT_PANELS_H
#include "core/common.h"
#include "formats/kinds.h"
#include "rows/avx512.h"
#include "formats/kquant_rows.h"

/* auto mode: K-quant products of KQP_MIN input rows or more (below, the int8 rows of formats/kquant_rows.h),
 * on every SIMD build (AVX2: csrc/formats/kquant_panels_avx2.h, 1.4-1.9x its float path). Against the
 * float gemm (1B Q4_K [8192 x 2048], 2 threads): 16 rows 2.8x, 128 rows 2.6x, 512 rows 2.2x;
 * Q6_K [2048 x 8192] 1.6-2.8x; the int16 panels it replaced ran level with the float gemm. */
#define KQP_MIN 4
#define KQP_MAX (PK_SIMD ? ((int64_t)1 << 40) : 0)
#define KQP_SB (4096 + 2 * 1024) /* a decoded super-block of 16 rows: codes, S, o */
/* the fused step's prepared inputs (px_t) interleave x's codes and slots: 64 bytes a 32-block,
 * the 32 codes then room for 8 int32 slots (KQP_SLOTS used), so the slots' stride is 16 words
 * (quantize_x's layout: the buffers and px_view serve both schemes) */
#define KQP_PX_CB 64
#define KQP_PX_OCB 16
#define KQP_PX_XO(xq) ((int32_t *)((xq) + 32))
#define KQP_ROWS 16              /* weight rows per panel: one per 32-bit lane */
/* IQ4_NL/IQ4_XS prompts on the panels too (1B IQ4_XS 128-token prompt: 0.59x llama.cpp on the
 * float gemm): on AVX-512 VNNI their table codes + 128 (1..241) as vpdpbusd's unsigned side,
 * offset 128 on x's code sums; on AVX2 (maddubs would saturate on them) the signed codes with
 * llama.cpp's sign trick (formats/kquant_panels_avx2.h) */
#define KQP_IQ4 PK_SIMD

/* the kinds whose prompts (auto mode) take the panels: the K-quants, IQ4 with KQP_IQ4 (rows of
 * whole 256-element super-blocks: IQ4_NL's 8 blocks a record) */
static inline int kqp_kind(int kind) {
    return KINDS[kind]->kqp == 1 || (KQP_IQ4 && KINDS[kind]->kqp == 2); /* record .kqp */
}

/* the int8 panels read rows of kind in runs of 256 elements */
static inline int kqp_fits(int kind, int64_t k) { return kqp_kind(kind) && k % 256 == 0; }

/* bytes of 256 elements of a row of kind (IQ4_NL: 8 blocks of 18) */
static inline int64_t kqp_sbb(int kind) { return (int64_t)BLOCK_BYTES[kind] * (256 / BLOCK_ELEMS[kind]); }
#if PK_AVX512
#define KQP_T 8 /* inputs per register tile: 8 int32 + 8 float accumulators */
#else
#define KQP_T 4 /* AVX2: 4 + 4 of the 16 registers */
#endif

/* inputs per pass over a thread's panels (packed codes, k bytes each): 1 MB of them stay in L2
 * while each panel is decoded and meets them (1B Q6_K [2048 x 8192], 512 rows: 512 KB 42, 1 MB
 * 48, 2 MB 41 multiply-adds per cycle) */
static inline int64_t kqp_block(int64_t k) {
    const int64_t t = (((int64_t)1 << 20) / k) & ~(int64_t)7;
    return t < 16 ? 16 : t;
}

/* A for the inputs [t, ...) */
static inline mm_args kqp_from(const mm_args *A, int64_t t) {
    mm_args V = *A;
    V.xq = A->xq + t * A->nb * A->cb;
    V.xo = A->xo + t * A->nb * A->ocb;
    V.dx = A->dx + t * A->nb;
    V.xs16 = A->xs16 + t * 2 * A->nb;
    return V;
}

/* how a kind's offsets are taken: KQP_MIN16 dmin * min per 16 (Q2_K), KQP_MIN32 per 32 with one
 * scale per 32 (Q4_K, Q5_K: one int32 sum per 32), KQP_OFF32 / KQP_OFF4 the code offsets 32 / 4
 * (Q6_K, Q3_K: folded into the integer sums, quantize_xi's -32 / -4 code sums start them),
 * KQP_OFF128 the IQ4 codes' 128, one scale and one int32 sum per 32 */
/* (the enum is core/common.h's: a kind's record holds its form) */

#define KQP_SLOTS 6 /* x's int32 slots a block (quantize_xi) */

/* where form F's values sit in a block's slots: all slots written (fused step) or F's only */
static inline int kqp_slot(int F, int all) {
    return !all ? 0 : F == KQP_OFF4 ? 2 : F == KQP_MIN32 ? 4 : F == KQP_OFF128 ? 5 : 0;
}

static inline int kqp_form(int kind) { return KINDS[kind]->kqp_form; }

/* where block b0 of input row 0 keeps its codes (xb), offset slots (ob) and the rows' strides:
 * the AVX-512 and AVX2 tiles read x the same way */
typedef struct {
    const int8_t *xb;
    const int32_t *ob;
    int64_t b0, xr, orr;
} kqp_at;

static inline kqp_at kqp_block_at(const mm_args *A, int64_t sb, int j, int F) {
    const int64_t b0 = sb * 8 + j;
    const kqp_at X = {A->xq + b0 * A->cb, A->xo + b0 * A->ocb + kqp_slot(F, A->ocb >= KQP_SLOTS), b0, A->nb * A->cb,
                      A->nb * A->ocb};
    return X;
}

/* input t's 4 codes at k = 16 h + 4 q of the block, as one int32 (broadcast to every row lane) */
static inline int32_t kqp_c4(const kqp_at *X, int64_t t, int h, int q) {
    int32_t c4;
    memcpy(&c4, X->xb + t * X->xr + 16 * h + 4 * q, 4);
    return c4;
}

/* the panel decoders read 16 rows' streams at once, more than the hardware prefetcher follows:
 * ask for each row's super-block KQP_PF ahead (1B Q5_K_M 128-token prompt 352 -> 382 tok/s;
 * 4 ahead 368) */
#define KQP_PF 2

#endif /* POLY_FORMATS_KQUANT_PANELS_H */

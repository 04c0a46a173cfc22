/* The dispatch table: every kind's record (core/common.h kind_rec), defined in the format's own
 * file, by kind id; and the quantized kinds in id order for the per-kind range functions
 * (rows/ranges.h). The generic kernels read KINDS[kind] instead of naming kinds; with a
 * constant kind (every range function is made for one) the record's fields fold away. */
#ifndef POLY_FORMATS_KINDS_H
#define POLY_FORMATS_KINDS_H
#include "core/common.h"
#include "formats/bf16.h"
#include "formats/block32.h"
#include "formats/kquant_blocks.h"
#include "formats/gguf_blocks.h"

static const kind_rec REC_NONE = {0}; /* float32, float16: nothing a generic kernel asks of them */
static const kind_rec REC_I8 = {.aux = AUX_ROWS, .il16 = IL16_I8}; /* int8 rows, a scale each */

static const kind_rec *const KINDS[K_COUNT] = {
    [K_F32] = &REC_NONE, [K_F16] = &REC_NONE, [K_BF16] = &REC_BF16, [K_I8] = &REC_I8,
    [K_LOOM_Q4] = &REC_LOOM_Q4, [K_Q4_0] = &REC_Q4_0, [K_Q4_1] = &REC_Q4_1, [K_Q8_0] = &REC_Q8_0,
    [K_Q4_K] = &REC_Q4_K, [K_Q6_K] = &REC_Q6_K, [K_Q5_0] = &REC_Q5_0, [K_Q5_1] = &REC_Q5_1,
    [K_Q2_K] = &REC_Q2_K, [K_Q3_K] = &REC_Q3_K, [K_Q5_K] = &REC_Q5_K, [K_IQ4_NL] = &REC_IQ4_NL,
    [K_IQ4_XS] = &REC_IQ4_XS, [K_MXFP4] = &REC_MXFP4,
};

/* X(name, kind) for the dense kinds and the quantized ones */
#define DENSE_KINDS(X) X(f32, K_F32) X(f16, K_F16) X(bf16, K_BF16) X(i8, K_I8)
#define QUANT_KINDS(X)                                                                       \
    X(loom, K_LOOM_Q4) X(q4_0, K_Q4_0) X(q4_1, K_Q4_1) X(q8_0, K_Q8_0) X(q4_k, K_Q4_K)        \
    X(q6_k, K_Q6_K) X(q5_0, K_Q5_0) X(q5_1, K_Q5_1) X(q2_k, K_Q2_K) X(q3_k, K_Q3_K)           \
    X(q5_k, K_Q5_K) X(iq4_nl, K_IQ4_NL) X(iq4_xs, K_IQ4_XS) X(mxfp4, K_MXFP4)

/* CASES(K) with a constant K per layout of rows repacked by 16 (formats/interleave16*.h: the
 * tiles' code is made per layout; Loom Q4 takes Q4_0's, the same record) */
#define IL16_KIND_SWITCH(kind, CASES)                                                         \
    if ((kind) == K_Q8_0) CASES(K_Q8_0)                                                      \
    else if ((kind) == K_I8) CASES(K_I8)                                                     \
    else if ((kind) == K_Q4_1) CASES(K_Q4_1)                                                 \
    else CASES(K_Q4_0)

/* CASE(K) with a constant K for the float kinds' packing (gemm/gemm.h) */
#define DENSE_FLOAT_SWITCH(kind, CASE)                                                        \
    if ((kind) == K_F16) CASE(K_F16)                                                         \
    else if ((kind) == K_BF16) CASE(K_BF16)                                                  \
    else CASE(K_F32)

#endif /* POLY_FORMATS_KINDS_H */

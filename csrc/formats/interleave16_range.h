/* The rows interleaved by 16: the portable build's stub and the prompt rule over the ISA's record kernels. */
#ifndef POLY_FORMATS_INTERLEAVE16_RANGE_H
#define POLY_FORMATS_INTERLEAVE16_RANGE_H
#include "core/common.h"
#include "formats/interleave16.h"
#include "formats/interleave16_avx2.h" /* PK_IL16P where the 8-lane kernels define it */
#if !PK_SIMD
#define PK_IL16 0
static inline int il16_range(int kind, const mm_args *A, const uint8_t *rp, int64_t r0, int64_t r1) { (void)kind; (void)A; (void)rp; (void)r0; (void)r1; return -1; }
#endif

#ifndef PK_IL16P /* il16_range takes prompts past MAX_N too (AVX-512 above, 8-lane builds formats/interleave16_avx2.h) */
#define PK_IL16P 0
#endif
/* the kinds whose prompts past MAX_N rows take the repacked rows: all of them on SIMD builds
 * (8 lanes: Q8_0 and int8 on int16 codes, il16w_sums) */
static inline int il16p_kind(int kind) { return PK_IL16P && il16_bytes(kind, 16, 32) > 0; }

#endif /* POLY_FORMATS_INTERLEAVE16_RANGE_H */

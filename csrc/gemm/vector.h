/* gvec: the vector of the gemm tiles (gemm/gemm.h) and its five operations, per ISA: __m512,
 * __m256, or four plain floats in the portable build. */
#ifndef POLY_GEMM_VECTOR_H
#define POLY_GEMM_VECTOR_H
#include "core/common.h"
#include "rows/avx512.h"

#if PK_AVX512
typedef __m512 gvec;
#define GL 16
#define GVEC_ZERO() _mm512_setzero_ps()
#define GVEC_LOAD(p) _mm512_loadu_ps(p)
#define GVEC_BCAST(p) _mm512_set1_ps(*(p))
#define GVEC_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define GVEC_STORE(p, v) _mm512_storeu_ps(p, v)
#elif PK_SIMD
typedef __m256 gvec;
#define GL 8
#define GVEC_ZERO() _mm256_setzero_ps()
#define GVEC_LOAD(p) _mm256_loadu_ps(p)
#define GVEC_BCAST(p) _mm256_broadcast_ss(p)
#define GVEC_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define GVEC_STORE(p, v) _mm256_storeu_ps(p, v)
#else
typedef struct { float v[4]; } gvec; /* portable build: plain loops over 4 lanes */
#define GL 4
static inline gvec gvec_zero(void) { gvec r = {{0}}; return r; }
static inline gvec gvec_load(const float *p) { gvec r; for (int l = 0; l < 4; l++) r.v[l] = p[l]; return r; }
static inline gvec gvec_bcast(const float *p) { gvec r; for (int l = 0; l < 4; l++) r.v[l] = *p; return r; }
static inline gvec gvec_fma(gvec a, gvec b, gvec c) { for (int l = 0; l < 4; l++) c.v[l] += a.v[l] * b.v[l]; return c; }
static inline void gvec_store(float *p, gvec v) { for (int l = 0; l < 4; l++) p[l] = v.v[l]; }
#define GVEC_ZERO() gvec_zero()
#define GVEC_LOAD(p) gvec_load(p)
#define GVEC_BCAST(p) gvec_bcast(p)
#define GVEC_FMA(a, b, c) gvec_fma(a, b, c)
#define GVEC_STORE(p, v) gvec_store(p, v)
#endif

#endif /* POLY_GEMM_VECTOR_H */

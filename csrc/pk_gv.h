/* gv: the vector of the gemm tiles (pk_gemm.h) and its five operations, per ISA: __m512,
 * __m256, or four plain floats in the portable build. Included by pk_gemm.h. */
#ifndef PK_GV_H
#define PK_GV_H

#if PK_AVX512
typedef __m512 gv;
#define GL 16
#define GV_ZERO() _mm512_setzero_ps()
#define GV_LOAD(p) _mm512_loadu_ps(p)
#define GV_BCAST(p) _mm512_set1_ps(*(p))
#define GV_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define GV_STORE(p, v) _mm512_storeu_ps(p, v)
#elif PK_SIMD
typedef __m256 gv;
#define GL 8
#define GV_ZERO() _mm256_setzero_ps()
#define GV_LOAD(p) _mm256_loadu_ps(p)
#define GV_BCAST(p) _mm256_broadcast_ss(p)
#define GV_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define GV_STORE(p, v) _mm256_storeu_ps(p, v)
#else
typedef struct { float v[4]; } gv; /* portable build: plain loops over 4 lanes */
#define GL 4
static inline gv gv_zero(void) { gv r = {{0}}; return r; }
static inline gv gv_load(const float *p) { gv r; for (int l = 0; l < 4; l++) r.v[l] = p[l]; return r; }
static inline gv gv_bcast(const float *p) { gv r; for (int l = 0; l < 4; l++) r.v[l] = *p; return r; }
static inline gv gv_fma(gv a, gv b, gv c) { for (int l = 0; l < 4; l++) c.v[l] += a.v[l] * b.v[l]; return c; }
static inline void gv_store(float *p, gv v) { for (int l = 0; l < 4; l++) p[l] = v.v[l]; }
#define GV_ZERO() gv_zero()
#define GV_LOAD(p) gv_load(p)
#define GV_BCAST(p) gv_bcast(p)
#define GV_FMA(a, b, c) gv_fma(a, b, c)
#define GV_STORE(p, v) gv_store(p, v)
#endif

#endif /* PK_GV_H */

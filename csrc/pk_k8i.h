/* K-quant prompts on int8 codes (the q8 scheme's "auto" mode, K8I_MIN or more input rows; this
 * file's tiles are AVX-512's, csrc/pk_k8i_avx2.h has AVX2's). Why: a prompt's products are compute-bound, and vpdpbusd does 64 multiply-adds per
 * instruction where the float gemm's FMA does 16 and the int16 panels' vpdpwssd 32.
 *
 * A panel of 16 weight rows is decoded once (k8_scales / k8_codes2) into one weight row per
 * 32-bit vector lane: per super-block, 64 vectors of codes (vector q holds k = 4q..4q+3 of the 16
 * rows: byte 4r + i = row r's code at 4q + i), then 16 vectors of S = D * s and 16 of the offsets o
 * (per 16 weights, 16 rows), K8I_SB bytes. x takes one int8 code per element with one scale per
 * 32 (x ~= dx * c, dx = max|x| / 127, Q8_0's activations; llama.cpp's Q8_K has one per 256) and the
 * sums dx * sum(c) per 16. An input's 4 codes at a time are broadcast and meet 4 codes of 16 rows
 * in one vpdpbusd; per 16 weights the int32 sums take S (cvt, mul), per 32 dx (fma) and the offsets
 * (o * the code sums), so every output row is a lane and no horizontal sum is left.
 * The result is exact for x's codes (the dot product of the stored weights with dx * c): the error
 * is x's rounding, <= dx / 2 per element. Included by pk_kernels.h after pk_k8.h. */
#ifndef PK_K8I_H
#define PK_K8I_H

/* auto mode: K-quant products of K8I_MIN input rows or more (below, the int8 rows of pk_k8.h),
 * on every SIMD build (AVX2: csrc/pk_k8i_avx2.h, 1.4-1.9x its float path). Against the
 * float gemm (1B Q4_K [8192 x 2048], 2 threads): 16 rows 2.8x, 128 rows 2.6x, 512 rows 2.2x;
 * Q6_K [2048 x 8192] 1.6-2.8x; the int16 panels it replaced ran level with the float gemm. */
#define K8I_MIN 4
#define K8I_MAX (PK_SIMD ? ((int64_t)1 << 40) : 0)
#define K8I_SB (4096 + 2 * 1024) /* a decoded super-block of 16 rows: codes, S, o */
/* the fused step's prepared inputs (px_t) interleave x's codes and slots: 64 bytes a 32-block,
 * the 32 codes then room for 8 int32 slots (K8I_SLOTS used), so the slots' stride is 16 words
 * (quantize_x's layout: the buffers and px_view serve both schemes) */
#define K8I_PX_CB 64
#define K8I_PX_OCB 16
#define K8I_PX_XO(xq) ((int32_t *)((xq) + 32))
#define K8I_ROWS 16              /* weight rows per panel: one per 32-bit lane */
/* IQ4_NL/IQ4_XS prompts on the panels too (1B IQ4_XS 128-token prompt: 0.59x llama.cpp on the
 * float gemm): on AVX-512 VNNI their table codes + 128 (1..241) as vpdpbusd's unsigned side,
 * offset 128 on x's code sums; on AVX2 (maddubs would saturate on them) the signed codes with
 * llama.cpp's sign trick (pk_k8i_avx2.h) */
#define K8I_IQ4 PK_SIMD

/* the kinds whose prompts (auto mode) take the panels: the K-quants, IQ4 with K8I_IQ4 (rows of
 * whole 256-element super-blocks: IQ4_NL's 8 blocks a record) */
static inline int k8i_kind(int kind) {
    return k8_kind(kind) || (K8I_IQ4 && (kind == K_IQ4_NL || kind == K_IQ4_XS));
}

/* the int8 panels read rows of kind in runs of 256 elements */
static inline int k8i_fits(int kind, int64_t k) { return k8i_kind(kind) && k % 256 == 0; }

/* bytes of 256 elements of a row of kind (IQ4_NL: 8 blocks of 18) */
static inline int64_t k8i_sbb(int kind) { return (int64_t)BLOCK_BYTES[kind] * (256 / BLOCK_ELEMS[kind]); }
#if PK_AVX512
#define K8I_T 8 /* inputs per register tile: 8 int32 + 8 float accumulators */
#else
#define K8I_T 4 /* AVX2: 4 + 4 of the 16 registers */
#endif

/* inputs per pass over a thread's panels (packed codes, k bytes each): 1 MB of them stay in L2
 * while each panel is decoded and meets them (1B Q6_K [2048 x 8192], 512 rows: 512 KB 42, 1 MB
 * 48, 2 MB 41 multiply-adds per cycle) */
static inline int64_t k8i_block(int64_t k) {
    const int64_t t = (((int64_t)1 << 20) / k) & ~(int64_t)7;
    return t < 16 ? 16 : t;
}

/* A for the inputs [t, ...) */
static inline mm_args k8i_from(const mm_args *A, int64_t t) {
    mm_args V = *A;
    V.xq = A->xq + t * A->nb * A->cb;
    V.xo = A->xo + t * A->nb * A->ocb;
    V.dx = A->dx + t * A->nb;
    V.xs16 = A->xs16 + t * 2 * A->nb;
    return V;
}

/* how a kind's offsets are taken: K8I_MIN16 dmin * min per 16 (Q2_K), K8I_MIN32 per 32 with one
 * scale per 32 (Q4_K, Q5_K: one int32 sum per 32), K8I_OFF32 / K8I_OFF4 the code offsets 32 / 4
 * (Q6_K, Q3_K: folded into the integer sums, quantize_xi's -32 / -4 code sums start them),
 * K8I_OFF128 the IQ4 codes' 128, one scale and one int32 sum per 32 */
enum { K8I_MIN16, K8I_MIN32, K8I_OFF32, K8I_OFF4, K8I_OFF128 };

#define K8I_SLOTS 6 /* x's int32 slots a block (quantize_xi) */

/* where form F's values sit in a block's slots: all slots written (fused step) or F's only */
static inline int k8i_slot(int F, int all) {
    return !all ? 0 : F == K8I_OFF4 ? 2 : F == K8I_MIN32 ? 4 : F == K8I_OFF128 ? 5 : 0;
}

static inline int k8i_form(int kind) {
    switch (kind) {
    case K_Q4_K: case K_Q5_K: return K8I_MIN32;
    case K_Q6_K: return K8I_OFF32;
    case K_Q3_K: return K8I_OFF4;
    case K_IQ4_NL: case K_IQ4_XS: return K8I_OFF128;
    default: return K8I_MIN16;
    }
}

/* where block b0 of input row 0 keeps its codes (xb), offset slots (ob) and the rows' strides:
 * the AVX-512 and AVX2 tiles read x the same way */
typedef struct {
    const int8_t *xb;
    const int32_t *ob;
    int64_t b0, xr, orr;
} k8i_at;

static inline k8i_at k8i_block_at(const mm_args *A, int64_t sb, int j, int F) {
    const int64_t b0 = sb * 8 + j;
    const k8i_at X = {A->xq + b0 * A->cb, A->xo + b0 * A->ocb + k8i_slot(F, A->ocb >= K8I_SLOTS), b0, A->nb * A->cb,
                      A->nb * A->ocb};
    return X;
}

/* input t's 4 codes at k = 16 h + 4 q of the block, as one int32 (broadcast to every row lane) */
static inline int32_t k8i_c4(const k8i_at *X, int64_t t, int h, int q) {
    int32_t c4;
    memcpy(&c4, X->xb + t * X->xr + 16 * h + 4 * q, 4);
    return c4;
}

/* the panel decoders read 16 rows' streams at once, more than the hardware prefetcher follows:
 * ask for each row's super-block K8I_PF ahead (1B Q5_K_M 128-token prompt 352 -> 382 tok/s;
 * 4 ahead 368) */
#define K8I_PF 2
#include "pk_r8k_sb.h" /* the panels of the rows by 8 */
static inline void k8i_prefetch(int kind, const uint8_t *w, int64_t rb, const uint8_t *rk, int64_t nsb, int64_t r0,
                                int64_t rows, int64_t sb) {
    if (sb + K8I_PF >= nsb) return;
    if (rk) { r8k_prefetch(kind, rk, nsb, r0, rows, sb + K8I_PF); return; }
    const int64_t sbb = k8i_sbb(kind);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t l = 0; l < sbb; l += 64) prefetch_line((const char *)w + (r0 + r) * rb + (sb + K8I_PF) * sbb + l);
}

/* x's codes for the 32-blocks [b0, b1): the 32 codes c at xq + cb b; at xo + ocb b int32 -32 and
 * -4 times their sums per 16 (the Q6_K / Q3_K code offsets, folded into the integer sums), then
 * float dx * sum(c) per 32 (K8I_SLOTS, form -1: the fused step's buffers, cb 64, xo at xq + 32,
 * where any kind may read an input), or just the slots of `form` (gemm: packed, ocb 2); dx per
 * block; dx * sum(c) per 16 in xs16 (the other kinds' offsets meet x's codes, not x) */
static inline void quantize_xi(const float *x, int8_t *xq, int64_t cb, int32_t *xo, int64_t ocb, float *dx, float *xs16,
                               int64_t b0, int64_t b1, int form) {
    for (int64_t b = b0; b < b1; b++) {
        const float *xb = x + b * 32;
        int8_t *c = xq + b * cb;
        const float amax = absmax(xb, 32);
        if (!isfinite(amax)) {
            dx[b] = NAN; xs16[2 * b] = xs16[2 * b + 1] = NAN;
            memset(c, 0, 32); memset(xo + b * ocb, 0, (size_t)ocb * 4);
            continue;
        }
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int32_t s[2] = {0, 0};
#if PK_AVX512 /* |x * id| <= 127 already: rounding needs no clamp */
        for (int h = 0; h < 2; h++) {
            const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * h), _mm512_set1_ps(id)));
            _mm_storeu_si128((__m128i *)(c + 16 * h), _mm512_cvtepi32_epi8(v));
            s[h] = _mm512_reduce_add_epi32(v);
        }
#elif PK_SIMD /* the same codes on 8 lanes (rint = the default rounding of cvtps) */
        __m256i v[4];
        for (int q = 0; q < 4; q++) v[q] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * q), _mm256_set1_ps(id)));
        _mm256_storeu_si256((__m256i *)c, pack32i(v[0], v[1], v[2], v[3]));
        for (int h = 0; h < 2; h++) s[h] = hsum_i32(_mm256_add_epi32(v[2 * h], v[2 * h + 1]));
#else
        for (int l = 0; l < 32; l++) {
            const int v = (int)fminf(fmaxf(rintf(xb[l] * id), -127.0f), 127.0f);
            c[l] = (int8_t)v;
            s[l >> 4] += v;
        }
#endif
        const float s32 = d * (float)(s[0] + s[1]); /* Q4_K/Q5_K: one min per 32 */
        int32_t o[K8I_SLOTS + 2] = {-32 * s[0], -32 * s[1], -4 * s[0], -4 * s[1], 0, -128 * (s[0] + s[1])}; /* ocb 2: room */
        memcpy(o + 4, &s32, 4);
        if (form < 0) memcpy(xo + b * ocb, o, K8I_SLOTS * 4);
        else memcpy(xo + b * ocb, o + k8i_slot(form, 1), (size_t)ocb * 4);
        dx[b] = d;
        xs16[2 * b] = d * (float)s[0];
        xs16[2 * b + 1] = d * (float)s[1];
    }
}

#if PK_AVX512
#ifdef __AVX512VNNI__
#define K8I_DP(acc, u, x) _mm512_dpbusd_epi32(acc, u, x)
#else
#define K8I_DP(acc, u, x) _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), _mm512_set1_epi16(1)))
#endif

/* 16 x 16 32-bit transpose in place: v[r] lane l -> v[l] lane r */
static inline void k8i_transpose(__m512i v[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        v[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        v[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        v[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        v[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) { /* 128-bit lanes: rows 0-3 with 4-7, 8-11 with 12-15 */
        t[i] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        v[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        v[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* rows [r0, r0 + rows) (rows <= 16; missing rows decode as zeros) into the panel: nsb records */
/* IQ4 super-block p's scale per 16 (two of each: one per 32) */
static inline __m512 k8i_iq4_scales(int kind, const uint8_t *p) {
    float s[16];
    for (int j = 0; j < 8; j++) s[2 * j] = s[2 * j + 1] = pq_iq4_d(kind, p, j);
    return _mm512_loadu_ps(s);
}

static void k8i_decode(int kind, const uint8_t *w, int64_t rb, const uint8_t *rk, int64_t nsb, int64_t r0, int64_t rows,
                       uint8_t *panel) {
    uint8_t tmp[16][256];
    if (k8i_decode_rk(kind, rk, nsb, r0, rows, panel)) return;
    for (int64_t sb = 0; sb < nsb; sb++) {
        uint8_t *d = panel + sb * K8I_SB;
        __m512i v[16], o[16];
        const uint8_t *p[16];
        k8i_prefetch(kind, w, rb, rk, nsb, r0, rows, sb);
        for (int r = 0; r < 16; r++) p[r] = r < rows ? k8i_sbp(kind, w, rb, rk, nsb, r0 + r, sb, tmp[r]) : NULL;
        for (int c = 0; c < 4; c++) { /* 64 weights of each row: 16 lanes of 4 codes */
            for (int r = 0; r < 16; r++)
                v[r] = r < rows ? k8_codes2(kind, p[r], c) : _mm512_setzero_si512();
            k8i_transpose(v);
            for (int q = 0; q < 16; q++) _mm512_storeu_si512((void *)(d + (16 * c + q) * 64), v[q]);
        }
        for (int r = 0; r < 16; r++) { /* row r's 16 S and o, then lanes: S[j][r], o[j][r] */
            if (k8i_form(kind) == K8I_OFF128) { /* no o: the offset is in the integer sums */
                v[r] = r < rows ? _mm512_castps_si512(k8i_iq4_scales(kind, p[r])) : _mm512_setzero_si512();
                o[r] = _mm512_setzero_si512();
                continue;
            }
            k8_sb B = {0};
            if (r < rows) k8_scales(kind, p[r], &B);
            const __m512 s = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)B.s)));
            v[r] = _mm512_castps_si512(_mm512_mul_ps(s, _mm512_set1_ps(B.D)));
            const __m512 ov = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)B.o)));
            o[r] = _mm512_castps_si512(_mm512_mul_ps(ov, _mm512_set1_ps(B.om)));
        }
        k8i_transpose(v);
        k8i_transpose(o);
        for (int j = 0; j < 16; j++) {
            _mm512_storeu_si512((void *)(d + 4096 + 64 * j), v[j]);
            _mm512_storeu_si512((void *)(d + 5120 + 64 * j), o[j]);
        }
    }
}

/* the panel's 16 rows x inputs t0.. (T of them): out[t][col .. col + rows) */
static inline __attribute__((always_inline)) void k8i_tile(const mm_args *A, const uint8_t *panel, int64_t nsb, int64_t t0,
                                                           float *out, int64_t ldo, int64_t col, int64_t rows,
                                                           const int F, const int T) {
    const int off = F == K8I_OFF32 || F == K8I_OFF4 || F == K8I_OFF128;
    const int sub = F == K8I_MIN32 || F == K8I_OFF128 ? 1 : 2; /* int sums per 32 */
    __m512 f[K8I_T];
#pragma GCC unroll 8
    for (int t = 0; t < T; t++) f[t] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *d = panel + sb * K8I_SB;
        const float *S = (const float *)(d + 4096), *O = S + 256;
#pragma GCC unroll 2
        for (int j = 0; j < 8; j++) { /* 32 weights: one dx */
            const k8i_at X = k8i_block_at(A, sb, j, F);
            __m512 g[K8I_T];
#pragma GCC unroll 2
            for (int h = 0; h < sub; h++) { /* 32 / sub weights: one S (and o) */
                __m512i acc[K8I_T];
#pragma GCC unroll 8
                for (int t = 0; t < T; t++) acc[t] = off ? _mm512_set1_epi32(X.ob[(t0 + t) * X.orr + h]) : _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int q = 0; q < 8 / sub; q++) {
                    const __m512i u = _mm512_loadu_si512((const void *)(d + (8 * j + 4 * h + q) * 64));
#pragma GCC unroll 8
                    for (int t = 0; t < T; t++) acc[t] = K8I_DP(acc[t], u, _mm512_set1_epi32(k8i_c4(&X, t0 + t, h, q)));
                }
                const __m512 sv = _mm512_loadu_ps(S + 16 * (2 * j + h));
#pragma GCC unroll 8
                for (int t = 0; t < T; t++)
                    g[t] = h ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t]), sv, g[t]) : _mm512_mul_ps(_mm512_cvtepi32_ps(acc[t]), sv);
            }
#pragma GCC unroll 8
            for (int t = 0; t < T; t++) {
                const int64_t b = (t0 + t) * A->nb + X.b0;
                f[t] = _mm512_fmadd_ps(g[t], _mm512_set1_ps(A->dx[b]), f[t]);
                if (F == K8I_MIN32) { /* one min per 32: o[2j] times the codes' sum over 32 */
                    float s32;
                    memcpy(&s32, X.ob + (t0 + t) * X.orr, 4);
                    f[t] = _mm512_fnmadd_ps(_mm512_loadu_ps(O + 32 * j), _mm512_set1_ps(s32), f[t]);
                }
                if (F == K8I_MIN16) { /* o per 16 */
                    f[t] = _mm512_fnmadd_ps(_mm512_loadu_ps(O + 32 * j), _mm512_set1_ps(A->xs16[2 * b]), f[t]);
                    f[t] = _mm512_fnmadd_ps(_mm512_loadu_ps(O + 32 * j + 16), _mm512_set1_ps(A->xs16[2 * b + 1]), f[t]);
                }
            }
        }
    }
    const __mmask16 mk = rows >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << rows) - 1);
#pragma GCC unroll 8
    for (int t = 0; t < T; t++) _mm512_mask_storeu_ps(out + (t0 + t) * ldo + col, mk, f[t]);
}

#elif PK_SIMD
#include "pk_k8i_avx2.h"
#endif

#if PK_SIMD
#if PK_AVX512
#define K8I_TILE(F, T) k8i_tile(A, panel, nsb, t, out, ldo, r0, rows, F, T)
#else /* AVX2: the int16 sums per kind (k8i_pairs), a constant in each instance */
#define K8I_TILE(F, T)                                                                       \
    do {                                                                                     \
        switch (k8i_pairs(kind)) {                                                           \
        case 8: k8i_tile(A, panel, nsb, t, out, ldo, r0, rows, F, 8, T); break;              \
        case 1: k8i_tile(A, panel, nsb, t, out, ldo, r0, rows, F, 1, T); break;              \
        case 2: k8i_tile(A, panel, nsb, t, out, ldo, r0, rows, F, 2, T); break;              \
        default: k8i_tile(A, panel, nsb, t, out, ldo, r0, rows, F, 4, T); break;             \
        }                                                                                    \
    } while (0)
#endif
#define K8I_TAIL(F)                                                                          \
    switch (n - t) {                                                                         \
    case 7: K8I_TILE(F, K8I_T > 7 ? 7 : 1); break;     \
    case 6: K8I_TILE(F, K8I_T > 6 ? 6 : 1); break;     \
    case 5: K8I_TILE(F, K8I_T > 5 ? 5 : 1); break;     \
    case 4: K8I_TILE(F, K8I_T > 4 ? 4 : 1); break;     \
    case 3: K8I_TILE(F, 3); break;                     \
    case 2: K8I_TILE(F, 2); break;                     \
    case 1: K8I_TILE(F, 1); break;                     \
    default: break;                                                                          \
    }
#define K8I_TILES(F)                                                                                  \
    {                                                                                                 \
        for (; t + K8I_T <= n; t += K8I_T) {                                                          \
            K8I_TILE(F, K8I_T);                                                                       \
            k8i_pf_next(kind, A, next, t, n);                                                         \
        }                                                                                             \
        K8I_TAIL(F)                                                                                   \
    }

/* the stored rows of the panel this thread takes next ([next, next + 16), next < 0: none) asked
 * into L2 a slice after each register tile, while this panel's tiles compute: its decode found
 * them in DRAM, its first loads stalled (11.6 % of a 1B Q5_K_M 128-token prompt in k8i_decode) */
static inline void k8i_pf_next(int kind, const mm_args *A, int64_t next, int64_t t, int64_t n) {
    if (next < 0 || next >= A->m) return;
    const int64_t rows = A->m - next < K8I_ROWS ? A->m - next : K8I_ROWS, tiles = n / K8I_T;
    const int64_t rec = r8k_rec(kind), g0 = next / 8; /* rows by 8: the records of its groups, one run */
    const int64_t bytes = A->rk ? ((next + rows - 1) / 8 - g0 + 1) * (A->nb / 8) * rec : rows * A->rb;
    const int64_t lo = bytes * (t / K8I_T) / tiles, hi = bytes * (t / K8I_T + 1) / tiles;
    const char *w = A->rk ? (const char *)A->rk + g0 * (A->nb / 8) * rec : (const char *)A->w + next * A->rb; /* one run */
    for (int64_t o = lo & ~(int64_t)63; o < hi; o += 64) prefetch_l2(w + o);
}

/* out[t][r0 + r] for the n inputs prepared in A (quantize_xi) and rows [r0, r0 + rows) of A's
 * matrix (rows <= 16); panel: nsb * K8I_SB bytes; next: the first row of the panel this thread
 * likely takes next (k8i_pf_next), or -1 */
static void k8i_rows(int kind, const mm_args *A, int64_t n, float *out, int64_t ldo, int64_t r0, int64_t rows,
                     uint8_t *panel, int64_t next) {
    const int64_t nsb = A->nb / 8;
    k8i_decode(kind, A->w, A->rb, A->rk, nsb, r0, rows, panel);
    int64_t t = 0;
    switch (k8i_form(kind)) {
    case K8I_MIN32: K8I_TILES(K8I_MIN32) break;
    case K8I_OFF32: K8I_TILES(K8I_OFF32) break;
    case K8I_OFF4: K8I_TILES(K8I_OFF4) break;
#if K8I_IQ4
    case K8I_OFF128: K8I_TILES(K8I_OFF128) break;
#endif
    default: K8I_TILES(K8I_MIN16) break;
    }
}

/* rows [r0, r1) in panels of 16 (one thread); after the last, the guess for this thread's next
 * piece of rows is the one the other threads' pieces leave (pieces handed out in turn, pk_mat.h) */
static void k8i_range(int kind, const mm_args *A, int64_t n, float *out, int64_t ldo, int64_t r0, int64_t r1,
                      uint8_t *panel) {
    const int64_t after = r1 + (pk_nth() - 1) * (r1 - r0);
    for (int64_t rp = r0; rp < r1; rp += K8I_ROWS)
        k8i_rows(kind, A, n, out, ldo, rp, r1 - rp < K8I_ROWS ? r1 - rp : K8I_ROWS, panel, rp + K8I_ROWS < r1 ? rp + K8I_ROWS : after);
}
#endif

#endif /* PK_K8I_H */

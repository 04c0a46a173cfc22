/* gemm: prompt products on packed panels, any stored form the dequantizer reads (gemm/panels.h has the why). */
#ifndef POLY_GEMM_GEMM_H
#define POLY_GEMM_GEMM_H
#include "core/common.h"
#include "core/step_buffer.h"
#include "rows/avx512.h"
#include "formats/kquant_panels.h"
#include "formats/kquant_panels_prep.h"
#include "formats/kquant_panels_run.h"
#include "formats/vdpbf16_rows.h"
#include "formats/interleave16.h"
#include "formats/interleave16_range.h"
#include "gemm/dequant.h"
#include "matmul/entry.h"
#include "gemm/panels.h"
#include "formats/interleave16_panels.h"
#include "formats/float_kmajor16.h"
#include "gemm/prefetch.h"
#include "formats/vdpbf16_panels.h"

/* x's row stride for the tiles: k, or k + 16 when rows k floats apart fall in the same L1 sets (k a
 * multiple of 256: a tile's 12 broadcasts at one column thrashed an 8-way set; one thread, F32 rows
 * of k 2048, 42 tokens 62 -> 96 GFLOP/s) */
static inline int64_t gemm_ldx(int64_t k) { return k % 256 ? k : k + 16; }

/* rows [r0, r0 + rows) of W (rows <= GR) dequantized into tmp [rows, k], then chunk by chunk
 * packed k-major (zero rows past the end) and multiplied into out[:, r0..]; next: the first row
 * of the panel this thread takes next (-1: none), asked for meanwhile */
static void gemm_panel(int kind, const dq_args *D, const float *x, int64_t ldx, int64_t n, float *out, int64_t m,
                       int64_t r0, int64_t rows, float *tmp, float *P, int64_t next) {
    const int64_t k = D->k;
#if PK_AVX512
    if (KINDS[kind]->vdpbf && D->bf) { bf16_panel(kind, D, x, ldx, n, out, m, r0, rows, P, next); return; }
#endif
    if (PK_KM16 && D->hk) { /* laid out by 16 at load: no packing (csrc/formats/float_kmajor16.h) */
        if (r0 % 16) km16_range(kind, D->hk, k, x, ldx, n, out, m, r0, r0 + rows);
        else km16_group(kind, D->hk, k, r0 + rows, x, ldx, n, out + r0, m, r0, rows, next);
        return;
    }
    if (kind == K_F16 || kind == K_F32 || KINDS[kind]->bf16) { /* packed straight from the stored rows (1B
                                            * [8192 x 2048], 17 / 42 rows: 1.4x / 1.17x), the next chunk asked for meanwhile */
        const int esz = kind == K_F32 ? 4 : 2;
        const uint8_t *w = D->w + r0 * D->rb;
        for (int64_t c0 = 0; c0 < k; c0 += KC) {
            const int64_t kc = k - c0 < KC ? k - c0 : KC;
            pf_cur pf = pf_chunk(kind, D, r0, rows, next, c0 + kc, esz);
#define PACK_(K) gemm_pack_any(w + ELEM_BYTES[K] * c0, k, rows, kc, P, K);
            DENSE_FLOAT_SWITCH(kind, PACK_)
#undef PACK_
            gemm_chunk(P, x + c0, n, ldx, kc, out + r0, m, rows, c0 > 0, &pf);
        }
        return;
    }
    for (int64_t r = 0; r < rows; r++) {
        if (D->rp) dq_row_il16(kind, D, r0 + r, tmp + r * k);
        else dq_row(kind, D, r0 + r, tmp + r * k);
    }
    pf_cur pf = pf_panel(kind, D, next, GR); /* the next panel's rows, over this one's products */
    for (int64_t c0 = 0; c0 < k; c0 += KC) {
        const int64_t kc = k - c0 < KC ? k - c0 : KC;
        gemm_pack(tmp + c0, k, rows, kc, P);
        gemm_chunk(P, x + c0, n, ldx, kc, out + r0, m, rows, c0 > 0, &pf);
    }
}

/* a thread's packed chunk P: after its GR x k dequantized rows in buf, on a 64-byte boundary */
static inline float *gemm_p(float *buf, int64_t k) { return (float *)(((uintptr_t)(buf + GR * k) + 63) & ~(uintptr_t)63); }

/* rows [i0, i1) of x (row stride k) to xp at row stride ldx */
static inline void gemm_copy_x(const float *x, int64_t k, int64_t ldx, float *xp, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) memcpy(xp + i * ldx, x + i * k, (size_t)k * 4);
}

/* the piece after p: p + 1, or the next one nobody took from the counter ctr the threads share */
static inline int64_t next_piece(int64_t *ctr, int64_t p) {
    return ctr ? __atomic_fetch_add(ctr, 1, __ATOMIC_RELAXED) : p + 1;
}

/* out[i, r0..r1) += bias[r0..r1) for i < n (no bias: NULL) */
static inline void add_bias(const float *bias, float *out, int64_t ldo, int64_t n, int64_t r0, int64_t r1) {
    if (bias)
        for (int64_t i = 0; i < n; i++)
            for (int64_t r = r0; r < r1; r++) out[i * ldo + r] += bias[r];
}

/* rows [r0, r1) against n inputs x (row stride k) on this thread, panel by panel, bias (or NULL)
 * added; ctr (not NULL): the panels are taken from this counter shared by the threads; buf: the
 * thread's panel buffer (gemm_buf_floats), whose tail takes x at gemm_ldx's stride when n <= gpad */
static void gemm_rows(int kind, const dq_args *D, const float *x, int64_t n, float *out, int64_t ldo, int64_t r0,
                      int64_t r1, float *buf, int64_t gpad, const float *bias, int64_t *ctr) {
    const int64_t k = D->k, ldx = n <= gpad ? gemm_ldx(k) : k, panels = (r1 - r0 + GR - 1) / GR;
    const int64_t step = ctr ? pk_nth() : 1; /* the panel this thread likely takes next: p + step */
    float *P = gemm_p(buf, k);
    if (ldx != k) {
        float *xp = (float *)(((uintptr_t)(P + GR * KC) + 63) & ~(uintptr_t)63);
        gemm_copy_x(x, k, ldx, xp, 0, n);
        x = xp;
    }
    if (PK_KM16 && D->hk && !ctr) { /* whole groups of 16 rows: the ends of an even split cut through two */
        km16_range(kind, D->hk, k, x, ldx, n, out, ldo, r0, r1);
        add_bias(bias, out, ldo, n, r0, r1);
        return;
    }
    for (int64_t p = next_piece(ctr, -1); p < panels; p = next_piece(ctr, p)) {
        const int64_t rp = r0 + p * GR, rows = r1 - rp < GR ? r1 - rp : GR;
        gemm_panel(kind, D, x, ldx, n, out, ldo, rp, rows, buf, P, p + step < panels ? rp + step * GR : -1);
        add_bias(bias, out, ldo, n, rp, rp + rows);
    }
}

#ifndef GEMM_XB
#define GEMM_XB (4 << 20)
#endif
/* inputs a block: all n, or when x passes 2 GEMM_XB bytes, even blocks of at most GEMM_XB (whole
 * tiles), so each panel re-reads a block from cache instead of streaming all of x again (the
 * reference path's prompts: 512 tokens of k 8192 are 16 MB; [2048 x 8192] on two threads, f16
 * 86-111 -> 117-133 GFLOP/s median, x1.12-1.38, f32 x1.06-1.21; blocking an x of 4 MB lost 3 %:
 * each block re-reads the weights) */
static inline int64_t gemm_tblock(int64_t n, int64_t ldx) {
    const int64_t bytes = 4 * n * ldx, nb = (bytes + GEMM_XB - 1) / GEMM_XB;
    return bytes <= 2 * (int64_t)GEMM_XB ? n : ((n + nb - 1) / nb + GT - 1) / GT * GT;
}

/* floats of a gemm_rows buffer for k columns and gpad inputs copied */
static inline int64_t gemm_buf_floats(int64_t k, int64_t gpad) { return GR * k + GR * KC + 160 + gpad * (k + 16); }

/* the whole product on nt threads; -1 when a buffer cannot be allocated. x8 (not NULL): buffers
 * for the inputs' int8 codes, scales and code sums, filled here, for the K-quant panels of the
 * auto mode (csrc/formats/kquant_panels.h) */
static int gemm_run(int kind, const dq_args *D, const float *x, int64_t n, float *out, int64_t m, int nt,
                    mm_args *x8) {
    const int64_t k = D->k, panels = (m + GR - 1) / GR, ldx = x8 ? k : gemm_ldx(k);
    if (panels < nt) nt = (int)(panels > 0 ? panels : 1);
    float *xp = NULL; /* x at row stride ldx, in the calling thread's kept buffer */
    if (ldx != k && !(xp = kept_buffer(KEPT_GEMM_X, (size_t)(n * ldx) * 4))) return -1;
    int failed = 0;
#pragma omp parallel num_threads(nt) reduction(| : failed)
    {
        if (xp) {
#pragma omp for
            for (int64_t i = 0; i < n; i++) gemm_copy_x(x, k, ldx, xp, i, i + 1);
        }
        float *tmp = thread_buffer((size_t)(GR * k + GR * KC + 16));
        if (!tmp) failed = 1;
        float *P = tmp ? gemm_p(tmp, k) : NULL;
#if PK_SIMD
        if (x8) {
#pragma omp for
            for (int64_t i = 0; i < n; i++) /* int8 codes, one scale per 32 */
                quantize_xi(x + i * k, (int8_t *)x8->xq + i * k, 32, (int32_t *)x8->xo + i * 2 * x8->nb, 2, (float *)x8->dx + i * x8->nb,
                            (float *)x8->xs16 + i * 2 * x8->nb, 0, x8->nb, kqp_form(kind));
            const int64_t np = (m + KQP_ROWS - 1) / KQP_ROWS, tb = kqp_block(k);
            for (int64_t t = 0; t < n; t += tb) {
                const mm_args V = kqp_from(x8, t);
#pragma omp for schedule(dynamic, 1)
                for (int64_t p = 0; p < np; p++) {
                    const int64_t r0 = p * KQP_ROWS, rows = m - r0 < KQP_ROWS ? m - r0 : KQP_ROWS;
                    if (tmp) kqp_rows(kind, &V, n - t < tb ? n - t : tb, out + t * m, m, r0, rows, (uint8_t *)tmp, r0 + pk_nth() * KQP_ROWS);
                }
            }
        } else
#endif
/* panels handed out as threads free up: round robin left the faster core waiting (libgomp's
 * spin 8 % of an AVX2 1B f16 128-token prompt under perf, 3 % this way); the next panel asked
 * for is a guess, p + threads, right while they take turns */
        for (int64_t t = 0, tb = gemm_tblock(n, ldx); t < n; t += tb) {
            const float *xt = (xp ? xp : x) + t * ldx;
#pragma omp for schedule(dynamic, 1)
            for (int64_t p = 0; p < panels; p++) {
                if (!tmp) continue;
                const int64_t r0 = p * GR, rows = m - r0 < GR ? m - r0 : GR;
                gemm_panel(kind, D, xt, ldx, n - t < tb ? n - t : tb, out + t * m, m, r0, rows, tmp, P,
                           p + pk_nth() < panels ? r0 + pk_nth() * GR : -1);
            }
        }
    }
    return failed ? -1 : 0;
}

/* gemm_run, K-quants of KQP_MIN rows or more in the auto mode on int8 panels (SIMD builds) */
static int gemm_any(int kind, const dq_args *D, const float *x, int64_t n, float *out, int64_t m, int nt, int q8) {
    const int bf = bf16_rows(kind, q8, D->k); /* q8 with Q8_EXACT_BFLOAT16 is not 2 */
    q8 &= 3;
    if (q8 && D->rp && n >= IL16P_MIN && il16p_kind(kind)) { /* 8-lane prompts: the repacked rows (formats/interleave16_avx2.h), as matmul */
        mm_args A = {0};
        A.x = x; A.out = out; A.n = n; A.k = D->k; A.m = m; A.ldo = m; A.nb = D->k / 32;
        A.aux = D->aux; /* int8 rows: the row scales */
        A.x1 = q8 == 2; /* the auto mode's Q4 rows on x's first code, as the fused step */
        return run(kind, &A, nt, 1, D->rp);
    }
    if (!(q8 == 2 && kqp_fits(kind, D->k) && n >= KQP_MIN && n <= KQP_MAX)) { /* KQP_MAX 0: no SIMD */
        dq_args T = *D;
        T.bf = bf;
        return gemm_run(kind, &T, x, n, out, m, nt, NULL);
    }
    mm_args A = {0};
    A.w = D->w; A.k = D->k; A.m = m; A.rb = D->rb; A.nb = D->k / 32; A.rk = D->rk;
    void *buf = malloc((size_t)(n * D->k + 5 * n * A.nb * 4) + 64); /* codes, offsets, dx, sums per 16 */
    if (!buf) return -1;
    A.xq = (const int8_t *)buf;
    A.xo = (const int32_t *)((char *)buf + n * D->k); A.cb = 32; A.ocb = 2;
    A.dx = (const float *)(A.xo + 2 * n * A.nb);
    A.xs16 = A.dx + n * A.nb;
    const int rc = gemm_run(kind, D, x, n, out, m, nt, &A);
    free(buf);
    return rc;
}

#endif /* POLY_GEMM_GEMM_H */

/* gemm(kind, x, out, w, aux, n, k, m, threads): out [n, m] = x [n, k] @ W.T for any number of
 * input rows and any stored form the dequantizer reads (prefill). Included by pk_unity.h after
 * poly_kernels.c (it uses dq_row).
 *
 * Why not dequantize + BLAS sgemm: on a 2-core machine the OpenMP threads of the C kernels spin
 * after each region while OpenBLAS's threads run (and the other way round), measured as up to
 * 40 % of an MoE prefill; and the dequantized tile makes a round trip through memory. Here one
 * OpenMP region does everything: each thread takes panels of GR weight rows, dequantizes them
 * (bitwise like the numpy decoders), packs them k-major in chunks of KC (P[kk][GR], in L2),
 * and a register tile of GT tokens x GR rows accumulates with FMA over the chunk. */
#ifndef PK_GEMM_H
#define PK_GEMM_H

#include "pk_gv.h"

#define GR (2 * GL) /* weight rows per panel: two vectors */
#if PK_AVX512
#define GT 12 /* tokens per register tile: 24 of the 32 vector registers accumulate */
#else
#define GT 6 /* 12 of the 16 */
#endif
/* TILE(nt) for a count nt of tokens 1..GT, each case a tile of constant size (the tiles' loops
 * and registers unrolled per size); other counts: nothing */
#if GT > 6
#define GT_WIDE(TILE) case 12: TILE(12); break; case 11: TILE(11); break; case 10: TILE(10); break; \
    case 9: TILE(9); break; case 8: TILE(8); break; case 7: TILE(7); break;
#else
#define GT_WIDE(TILE)
#endif
#define GT_SWITCH(nt, TILE)                                                                                 \
    switch (nt) {                                                                                           \
    GT_WIDE(TILE)                                                                                           \
    case 6: TILE(6); break; case 5: TILE(5); break; case 4: TILE(4); break; case 3: TILE(3); break;        \
    case 2: TILE(2); break; case 1: TILE(1); break; default: break;                                        \
    }
#ifndef KC
#define KC 512 /* k per packed chunk: GR * KC floats (64 KiB on AVX-512, in L2; 256 or 384: the same speed) */
#endif

/* The bytes a panel reads next (the next chunk of its F16 rows, or the next panel's stored rows),
 * asked for a cache line an iteration of the tiles' loops: the packing otherwise waited on
 * memory (a third of a 1B f16 42-token prompt) */
typedef struct {
    const char *p;        /* the current row's bytes */
    int64_t stride, bytes; /* between rows, a row's bytes to ask for */
    int64_t rows, at;      /* rows left, offset in the current row */
} pf_cur;

static inline __attribute__((always_inline)) void pf_step(pf_cur *c) {
    if (c->rows <= 0) return;
#if PK_AVX512
    prefetch_line(c->p + c->at);
#else /* into L2: AVX2's chunk P (32 KB) fills L1 (one thread, f32 42 rows 58-79 -> 84-88 GFLOP/s) */
    prefetch_l2(c->p + c->at);
#endif
    if ((c->at += 64) >= c->bytes) { c->at = 0; c->p += c->stride; c->rows--; }
}

/* one token's two accumulators to out[0..rows) (+)= */
static inline void gemm_store(float *o, gv c0, gv c1, int64_t rows, int add) {
    float t[GR];
    GV_STORE(t, c0);
    GV_STORE(t + GL, c1);
    if (add)
        for (int64_t r = 0; r < rows; r++) o[r] += t[r];
    else
        for (int64_t r = 0; r < rows; r++) o[r] = t[r];
}

/* Named accumulators, not arrays: with arrays gcc kept a stack copy of every accumulator in
 * the AVX2 build (a store per FMA, 110 instead of ~250 GFLOP/s). */
#define T_ACC(i) gv c0_##i = GV_ZERO(), c1_##i = GV_ZERO();
#define T_FMA(i)                                                                             \
    if (NT > i) {                                                                            \
        const gv b = GV_BCAST(x + i * ldx + kk);                                             \
        c0_##i = GV_FMA(b, w0, c0_##i);                                                      \
        c1_##i = GV_FMA(b, w1, c1_##i);                                                      \
    }
#define T_OUT(i) \
    if (NT > i) gemm_store(out + i * ldo, c0_##i, c1_##i, rows, add);
#define T_ALL(M) M(0) M(1) M(2) M(3) M(4) M(5) T_HI(M)
#if GT > 6
#define T_HI(M) M(6) M(7) M(8) M(9) M(10) M(11)
#else
#define T_HI(M)
#endif

/* out[i, 0..rows) (+)= sum over kk < kc of x[i, kk] * P[kk][r] for i < NT (a constant) */
static inline __attribute__((always_inline)) void gemm_tile(const float *P, const float *x, int64_t ldx, int64_t kc,
                                                            float *out, int64_t ldo, int64_t rows, int add, const int NT,
                                                            pf_cur *pf) {
    T_ALL(T_ACC)
    for (int64_t kk = 0; kk < kc; kk++) {
        pf_step(pf);
        const gv w0 = GV_LOAD(P + kk * GR), w1 = GV_LOAD(P + kk * GR + GL);
        T_ALL(T_FMA)
    }
    T_ALL(T_OUT)
}

/* every token of x against one packed chunk, GT tokens at a time (the rest with a smaller tile) */
static void gemm_chunk(const float *P, const float *x, int64_t n, int64_t ldx, int64_t kc, float *out, int64_t ldo,
                       int64_t rows, int add, pf_cur *pf) {
    int64_t i = 0;
#define G_TILE(NT) gemm_tile(P, x + i * ldx, ldx, kc, out + i * ldo, ldo, rows, add, NT, pf)
    for (; i + GT <= n; i += GT) G_TILE(GT);
    GT_SWITCH(n - i, G_TILE)
#undef G_TILE
}


/* P[kk][r] = src[r * lds + kk] for kk < kc, r < rows (rows past them zero): k-major panel; src
 * float32, float16 or bfloat16 (kind K_F32/K_F16/K_BF16: the stored rows packed straight, no
 * dequantized copy) */
static inline __attribute__((always_inline)) void gemm_pack_any(const void *src, int64_t lds, int64_t rows, int64_t kc,
                                                                float *P, const int kind) {
    int64_t kk = 0;
    const int64_t esz = kind == K_F32 ? 4 : 2;
    const uint8_t *s = (const uint8_t *)src;
#if PK_SIMD
    if (rows == GR) { /* whole 8 x 8 blocks on 8 lanes: ~0.4 instructions an element, not 2; eight rows
                       * at a time (at k 2048 all GR rows' lines at one column share an L1 set:
                       * a column of blocks at a time re-read each line from L2, 42 tokens 0.7x) */
        for (int64_t r = 0; r < GR; r += 8)
            for (int64_t c = 0; c + 8 <= kc; c += 8)
                transpose8(s + esz * (r * lds + c), lds, P + c * GR + r, GR, kind);
        kk = kc & ~(int64_t)7;
    }
#endif
    if (rows < GR) memset(P, 0, (size_t)(kc * GR) * 4);
    for (; kk < kc; kk++)
        for (int64_t r = 0; r < rows; r++) P[kk * GR + r] = load1(kind, s + esz * r * lds, kk);
}

static void gemm_pack(const float *src, int64_t lds, int64_t rows, int64_t kc, float *P) {
    gemm_pack_any(src, lds, rows, kc, P, K_F32);
}

#include "pk_gemm_r16.h"
#include "pk_k16.h"

/* where panel r0's stored bytes start, their stride and a row's length (rows repacked by 16: the
 * groups' records, one run) */
static inline pf_cur pf_panel(int kind, const dq_args *D, int64_t r0, int64_t rows) {
    pf_cur c = {0};
    if (r0 < 0) return c;
    if (D->rp) {
        const int64_t g = r16_rec(kind) * (D->k / 32);
        c.p = (const char *)D->rp + (r0 / 16) * g; c.bytes = (rows + 15) / 16 * g; c.rows = 1;
    } else {
        c.p = (const char *)D->w + r0 * D->rb; c.stride = D->rb; c.bytes = D->rb; c.rows = rows;
    }
    return c;
}

/* the chunk of float rows from column c1 on (past the last: the next panel's first chunk) */
static inline pf_cur pf_chunk(int kind, const dq_args *D, int64_t r0, int64_t rows, int64_t next, int64_t c1, int esz) {
    const int last = c1 >= D->k;
    const int64_t from = last ? 0 : c1;
    pf_cur c = pf_panel(kind, D, last ? next : r0, last ? GR : rows);
    if (c.rows) { c.p += esz * from; c.bytes = esz * (D->k - from < KC ? D->k - from : KC); }
    return c;
}

#include "pk_bf16g.h"

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
    if (kind == K_BF16 && D->bf) { bf16_panel(D, x, ldx, n, out, m, r0, rows, P, next); return; }
#endif
    if (PK_K16 && D->hk) { /* laid out by 16 at load: no packing (csrc/pk_k16.h) */
        if (r0 % 16) k16_range(kind, D->hk, k, x, ldx, n, out, m, r0, r0 + rows);
        else k16_group(kind, D->hk, k, r0 + rows, x, ldx, n, out + r0, m, r0, rows, next);
        return;
    }
    if (kind == K_F16 || kind == K_BF16 || kind == K_F32) { /* packed straight from the stored rows (1B
                                            * [8192 x 2048], 17 / 42 rows: 1.4x / 1.17x), the next chunk asked for meanwhile */
        const int esz = kind == K_F32 ? 4 : 2;
        const uint8_t *w = D->w + r0 * D->rb;
        for (int64_t c0 = 0; c0 < k; c0 += KC) {
            const int64_t kc = k - c0 < KC ? k - c0 : KC;
            pf_cur pf = pf_chunk(kind, D, r0, rows, next, c0 + kc, esz);
            if (kind == K_F16) gemm_pack_any(w + 2 * c0, k, rows, kc, P, K_F16);
            else if (kind == K_BF16) gemm_pack_any(w + 2 * c0, k, rows, kc, P, K_BF16);
            else gemm_pack_any(w + 4 * c0, k, rows, kc, P, K_F32);
            gemm_chunk(P, x + c0, n, ldx, kc, out + r0, m, rows, c0 > 0, &pf);
        }
        return;
    }
    for (int64_t r = 0; r < rows; r++) {
        if (D->rp) dq_row_r16(kind, D, r0 + r, tmp + r * k);
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
    if (PK_K16 && D->hk && !ctr) { /* whole groups of 16 rows: the ends of an even split cut through two */
        k16_range(kind, D->hk, k, x, ldx, n, out, ldo, r0, r1);
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
 * auto mode (csrc/pk_k8i.h) */
static int gemm_run(int kind, const dq_args *D, const float *x, int64_t n, float *out, int64_t m, int nt,
                    mm_args *x8) {
    const int64_t k = D->k, panels = (m + GR - 1) / GR, ldx = x8 ? k : gemm_ldx(k);
    if (panels < nt) nt = (int)(panels > 0 ? panels : 1);
    float *xp = NULL; /* x at row stride ldx */
    if (ldx != k && posix_memalign((void **)&xp, 64, (size_t)(n * ldx) * 4)) return -1;
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
                            (float *)x8->xs16 + i * 2 * x8->nb, 0, x8->nb, k8i_form(kind));
            const int64_t np = (m + K8I_ROWS - 1) / K8I_ROWS, tb = k8i_block(k);
            for (int64_t t = 0; t < n; t += tb) {
                const mm_args V = k8i_from(x8, t);
#pragma omp for schedule(dynamic, 1)
                for (int64_t p = 0; p < np; p++) {
                    const int64_t r0 = p * K8I_ROWS, rows = m - r0 < K8I_ROWS ? m - r0 : K8I_ROWS;
                    if (tmp) k8i_rows(kind, &V, n - t < tb ? n - t : tb, out + t * m, m, r0, rows, (uint8_t *)tmp, r0 + pk_nth() * K8I_ROWS);
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
    free(xp);
    return failed ? -1 : 0;
}

/* gemm_run, K-quants of K8I_MIN rows or more in the auto mode on int8 panels (SIMD builds) */
static int gemm_any(int kind, const dq_args *D, const float *x, int64_t n, float *out, int64_t m, int nt, int q8) {
    const int bf = bf16_rows(kind, q8, D->k); /* q8 with Q8_EXACT_BF16 is not 2 */
    q8 &= 3;
    if (q8 && D->rp && n >= R16P_MIN && r16p_kind(kind)) { /* 8-lane prompts: the repacked rows (pk_r16_avx2.h), as matmul */
        mm_args A = {0};
        A.x = x; A.out = out; A.n = n; A.k = D->k; A.m = m; A.ldo = m; A.nb = D->k / 32;
        A.aux = D->aux; /* int8 rows: the row scales */
        A.x1 = q8 == 2; /* the auto mode's Q4 rows on x's first code, as the fused step */
        return run(kind, &A, nt, 1, D->rp);
    }
    if (!(q8 == 2 && k8i_fits(kind, D->k) && n >= K8I_MIN && n <= K8I_MAX)) { /* K8I_MAX 0: no SIMD */
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

#include "pk_gemm_py.h"

#endif /* PK_GEMM_H */

/* poly.runtime.native.ckernels.decode: one whole decode step (every pre-norm block, final norm, LM head) for
 * one new token, in one OpenMP parallel region.
 *
 * Why: per token the Python path makes ~15 kernel calls per block (each a parallel region and a
 * round trip through numpy), which costs more than the 4-bit matrix reads themselves. Here the
 * threads stay inside one region; row-parallel matrix-vector phases are separated by barriers
 * and the small serial work (norms, RoPE, the KV append) runs on one thread.
 *
 * decode(layers, caches, head, x, logits, pos, q8[, threads[, paged]]) for n <= 16 rows (independent sequences, each
 * one new token: batched decode reads every weight row once for all of them)
 *   layers: tuple of per-block tuples
 *     (heads, kv_heads, head_dim, eps, attn_gamma, q_gamma|None, k_gamma|None, qkv_mats,
 *      cos, sin, o_mat, mlp_gamma, gate_up_mats, down_mat)
 *     a mat is (kind, w, aux|None, m, k, bias|None); qkv_mats is (wqkv,) or (wq, wk, wv);
 *     gate_up_mats is (w_gate_up,) with 2I rows or (w_gate, w_up).
 *   caches: float32 [T, kv_heads, head_dim] arrays, (k, v) per block per row, block-major:
 *     index 2 * (block * n + row) (+ 1 for v)
 *   head: (final_gamma, eps, lm_mat)
 *   x: float32 [n, d] embeddings of the tokens (overwritten: the residual streams)
 *   logits: float32 [n, V] output, or [1, V]: the last row's only (a prompt's rows sharing one
 *     cache, pos start..start+n-1: each row writes its k/v before any row attends), or
 *     (logits [k, V], rows): the logits of those k ascending rows only (prompts' last rows), or
 *     None: no logits, the last block only caches its k and v (a long prompt's calls but its last);
 *   pos: tuple of n positions written (each < its T);
 *   q8: int8 activations; threads (optional): OpenMP threads for this call, 0 = set_threads().
 *   reduce (optional, 10th, tensor parallel): (red, fn), red float32 [n, d]: the O and down
 *     projections write their partial sums to red, fn() is called (it must sum red over the
 *     ranks in place), then red is added to the residual streams. A row-parallel bias belongs
 *     to one rank only.
 *   paged (optional, None = off): (page_size, tables), tables a tuple of n int32 arrays. Then each
 *     row's caches are the block's page pools [pages * page_size, kv_heads, head_dim] and position
 *     t of row i lives at slot tables[i][t / page_size] * page_size + t % page_size.
 * Every buffer's size is checked against the dims before anything runs (ValueError).
 */
#ifndef POLY_DECODE_STEP_H
#define POLY_DECODE_STEP_H
#include "core/common.h"
/* The fused decode step (csrc/decode/step.h computes, csrc/decode/args.h parses its
 * Python arguments): records shared by the two. */

#define MAX_LAYERS 4096
#define STEP_MAX 64 /* rows of one step: sequences, or a prompt's tokens (products of more than
                     * MAX_N rows run as gemm panels, or in MAX_N-row pieces) */

typedef struct {
    mm_args A; /* w, aux, m, k, rb, nb set; x/out filled per use */
    int kind;
    const float *bias;
    const uint8_t *rp; /* Q4_0/Q4_1 rows repacked by 16 (csrc/formats/interleave16.h), or NULL */
    const uint8_t *rk; /* Q4_K/Q6_K rows repacked by 8 (csrc/formats/kquant_interleave8.h: the auto mode's decode rows), or NULL */
    const void *hk; /* float16/float32 rows laid out by 16, k-major (csrc/formats/float_kmajor16.h), or NULL */
} mat_t;

typedef struct { /* one SwiGLU expert: gate/up as (w_gate_up,) or (w_gate, w_up), then down */
    int ngu; int64_t I; mat_t gu[2], down;
} expert_t;

enum { MOE_SOFTMAX, MOE_SIGMOID, MOE_SOFTMAX_TOPK }; /* moe_t.gating */
typedef struct { /* an MoE FFN (csrc/decode/moe.h): router [E, d] float32, experts, optional shared */
    int E, k, sig, norm, nex;  /* nex = E, + 1 with a shared expert (index E) */
    int gating;                /* MOE_SOFTMAX, MOE_SIGMOID, MOE_SOFTMAX_TOPK (the tuple: decode/moe_args.h) */
    int clamp; float alpha, limit; /* GPT-OSS's experts: (up + 1) * g sigmoid(alpha g), clamped */
    mat_t router; const float *sgate; /* shared expert's gate [d] or NULL */
    expert_t *ex; int32_t *chosen;    /* chosen: [n, k] expert ids written per call, or NULL */
} moe_t;

typedef struct {
    int heads, kvh, hd, nqkv, ngu;
    float eps;
    const float *g_attn, *g_q, *g_k, *g_mlp, *cos, *sin;
    void *kc[STEP_MAX], *vc[STEP_MAX]; /* [T, kvh, hd] float32, float16 when kv16, q8_0 rows when kv8 */
    int kv16; /* every cache of the layer holds float16 (half the bytes a position) */
    int kv8;  /* every cache holds q8_0 rows (decode/kv_q8.h: 17/32 of float16's bytes) */
    mat_t qkv[3], o, gu[2], down;
    moe_t *moe; /* NULL: the dense FFN gu/down */
    /* the block recipe's options (decode/recipe_args.h; zero or NULL: llama's block) */
    int ln;                                   /* LayerNorm (centred, + beta) for every norm */
    const float *b_attn, *b_mlp;              /* the pre-norms' betas */
    const float *g_apost, *b_apost, *g_mpost, *b_mpost; /* post-norms of each branch */
    int no_pre;                               /* the sub-layers read x unnormed (OLMo 2) */
    int par;                                  /* 1: x + attn(n1(x)) + ffn(n2(x)); 2: ffn(n1(x)) */
    float rmult;                              /* each branch times this before its add */
    int act;                                  /* 0 silu gated, 1 gelu_tanh gated, 2 gelu_erf, 3 gelu_tanh MLP */
    float scale, softcap;                     /* logit scale (1/sqrt(hd) by default), tanh cap (0: off) */
    int64_t window;                           /* keys a query sees, itself included (0: all) */
    const float *sinks;                       /* a logit per head in the softmax denominator, or NULL */
    int rot, ileave, qk_all;                  /* rotated dims (0: NoPE), GPT-J pairs, q/k norm over all heads */
    int qk_ln, qk_heads;                      /* q/k norm: LayerNorm (betas b_q, b_k); a weight row per head */
    const float *b_q, *b_k;
    int64_t kbase[STEP_MAX];                  /* position of row 0 of row i's cache (a window's moved rows) */
} layer_t;

typedef struct { int e; int64_t row0, cnt, goff, hoff; } slot_t; /* expert e's gathered rows */

typedef struct { /* one input vector prepared for every kernel kind */
    const float *x; float *xs, *xp, *dx, *xs16, *dk; int8_t *xq, *xqp, *xk; int64_t k;
    float *gbuf; int64_t gstride; /* per-thread gemm panels (GEMM_ROWS rows and more) */
    int64_t gpad; /* inputs a panel buffer's copy of x at gemm_ldx's stride holds */
    int grp; /* the codes prep wrote (q8_group): 0 none, 1 two int8 codes per element (the int8
              * rows, repacked rows), 3 those and one code per element with a scale per 256 (xk,
              * dk: the auto mode's K-quant rows, core/activations.h quantize_k), 8 one (the K-quant prompt
              * panels, formats/kquant_panels.h) */
    int x1; /* the auto mode: Q5_0/Q5_1/IQ4 rows take x's first code, K-quant rows xk */
    int bf; /* a prompt's BF16 products on vdpbf16ps (KQP_MIN rows and more, csrc/formats/vdpbf16_rows.h) */
    int64_t gemm_from; /* rows from which a product runs as gemm panels: GEMM_ROWS for a prompt,
                        * else MAX_N + 1 (the row kernels: a row's sums alone and in company) */
} px_t;

typedef struct {
    layer_t *L; int nl, n; int64_t d, inter, maxpos, maxq, maxw; int loom;
    int maxh; /* the most query heads of a layer (the attention's score rows a thread) */
    int q8; /* 0 float, 1 int8 codes for every 4/8-bit kind, 2 auto (K-quants), 3 repacked rows only */
    int seq1; /* the n rows are one sequence's tokens (a prompt): they share every cache */
    int bf;   /* the auto mode on a CPU with AVX512_BF16: BF16 prompts on vdpbf16ps (formats/vdpbf16_rows.h) */
    int indep; /* no two rows share a cache (and page table): each row attends only its own keys */
    int64_t mrows, mE; /* MoE: most gathered rows (n * (k + shared)), most experts; 0 without */
    int64_t pos[STEP_MAX];
    const int32_t *tab[STEP_MAX]; int64_t ntab[STEP_MAX], ps; /* paged KV: page tables (NULL: contiguous) */
    const float *g_final, *b_final; float eps_final; mat_t lm; float *x, *logits; /* b_final: LayerNorm */
    int nsel; int32_t sel[STEP_MAX]; /* logits of these rows only (ascending), nsel <= n */
    /* tensor parallel (optional): each row-parallel projection's partial sums [n, d] go to
     * `red`, then `red_fn()` (Python, e.g. an MPI all-reduce of `red` in place) runs on the
     * calling thread with the GIL, before they are added to x; the first error stops the calls */
    float *red; PyObject *red_fn; int red_err; PyObject *et, *ev, *etb;
} step_t;

typedef struct {
    float *h, *qkv, *att, *tmp, *gu, *hid, *sc, *par; px_t P; /* par: a parallel block's attention output */
    /* MoE: router logits [n, E], gathered rows [R, d], their weights and source rows, the
     * experts' gate|up [R, 2I], hidden [R, I] and outputs [R, d], slots by expert id */
    float *rl, *mx, *aw, *mgu, *mhid, *my, *prob; int32_t *arow; slot_t *slots; int nslots;
    int64_t *ctr; /* a prompt's hand-out counters (decode/matrix.h), HAND_SLOTS a block; NULL: even splits */
} bufs_t;

#endif /* POLY_DECODE_STEP_H */

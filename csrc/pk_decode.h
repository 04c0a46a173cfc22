/* The fused decode step (csrc/pk_decode.c computes, csrc/pk_decode_args.c parses its
 * Python arguments): records shared by the two. */
#ifndef PK_DECODE_H
#define PK_DECODE_H
#include "pk_kernels.h"

#define MAX_LAYERS 4096
#define STEP_MAX 64 /* rows of one step: sequences, or a prompt's tokens (products of more than
                     * MAX_N rows run as gemm panels, or in MAX_N-row pieces) */

typedef struct {
    mm_args A; /* w, aux, m, k, rb, nb set; x/out filled per use */
    int kind;
    const float *bias;
    const uint8_t *rp; /* Q4_0/Q4_1 rows repacked by 16 (csrc/pk_r16.h), or NULL */
    const uint8_t *rk; /* Q4_K/Q6_K rows repacked by 8 (csrc/pk_r8k.h: the auto mode's decode rows), or NULL */
    const void *hk; /* float16/float32 rows laid out by 16, k-major (csrc/pk_k16.h), or NULL */
} mat_t;

typedef struct { /* one SwiGLU expert: gate/up as (w_gate_up,) or (w_gate, w_up), then down */
    int ngu; int64_t I; mat_t gu[2], down;
} expert_t;

typedef struct { /* an MoE FFN (csrc/pk_moe.h): router [E, d] float32, experts, optional shared */
    int E, k, sig, norm, nex;  /* nex = E, + 1 with a shared expert (index E) */
    mat_t router; const float *sgate; /* shared expert's gate [d] or NULL */
    expert_t *ex; int32_t *chosen;    /* chosen: [n, k] expert ids written per call, or NULL */
} moe_t;

typedef struct {
    int heads, kvh, hd, nqkv, ngu;
    float eps;
    const float *g_attn, *g_q, *g_k, *g_mlp, *cos, *sin;
    void *kc[STEP_MAX], *vc[STEP_MAX]; /* [T, kvh, hd] float32, or float16 when kv16 */
    int kv16; /* every cache of the layer holds float16 (half the bytes a position) */
    mat_t qkv[3], o, gu[2], down;
    moe_t *moe; /* NULL: the dense FFN gu/down */
} layer_t;

typedef struct { int e; int64_t row0, cnt, goff, hoff; } slot_t; /* expert e's gathered rows */

typedef struct { /* one input vector prepared for every kernel kind */
    const float *x; float *xs, *xp, *dx, *xs16, *dk; int8_t *xq, *xqp, *xk; int64_t k;
    float *gbuf; int64_t gstride; /* per-thread gemm panels (GEMM_ROWS rows and more) */
    int64_t gpad; /* inputs a panel buffer's copy of x at gemm_ldx's stride holds */
    int grp; /* the codes prep wrote (q8_group): 0 none, 1 two int8 codes per element (the int8
              * rows, repacked rows), 3 those and one code per element with a scale per 256 (xk,
              * dk: the auto mode's K-quant rows, pk_vec.h quantize_k), 8 one (the K-quant prompt
              * panels, pk_k8i.h) */
    int x1; /* the auto mode: Q5_0/Q5_1/IQ4 rows take x's first code, K-quant rows xk */
    int bf; /* a prompt's BF16 products on vdpbf16ps (K8I_MIN rows and more, csrc/pk_bf16.h) */
    int64_t gemm_from; /* rows from which a product runs as gemm panels: GEMM_ROWS for a prompt,
                        * else MAX_N + 1 (the row kernels: a row's sums alone and in company) */
} px_t;

typedef struct {
    layer_t *L; int nl, n; int64_t d, inter, maxpos, maxq, maxw; int loom;
    int maxh; /* the most query heads of a layer (the attention's score rows a thread) */
    int q8; /* 0 float, 1 int8 codes for every 4/8-bit kind, 2 auto (K-quants), 3 repacked rows only */
    int seq1; /* the n rows are one sequence's tokens (a prompt): they share every cache */
    int bf;   /* the auto mode on a CPU with AVX512_BF16: BF16 prompts on vdpbf16ps (pk_bf16.h) */
    int indep; /* no two rows share a cache (and page table): each row attends only its own keys */
    int64_t mrows, mE; /* MoE: most gathered rows (n * (k + shared)), most experts; 0 without */
    int64_t pos[STEP_MAX];
    const int32_t *tab[STEP_MAX]; int64_t ntab[STEP_MAX], ps; /* paged KV: page tables (NULL: contiguous) */
    const float *g_final; float eps_final; mat_t lm; float *x, *logits;
    int nsel; int32_t sel[STEP_MAX]; /* logits of these rows only (ascending), nsel <= n */
    /* tensor parallel (optional): each row-parallel projection's partial sums [n, d] go to
     * `red`, then `red_fn()` (Python, e.g. an MPI all-reduce of `red` in place) runs on the
     * calling thread with the GIL, before they are added to x; the first error stops the calls */
    float *red; PyObject *red_fn; int red_err; PyObject *et, *ev, *etb;
} step_t;

typedef struct {
    float *h, *qkv, *att, *tmp, *gu, *hid, *sc; px_t P;
    /* MoE: router logits [n, E], gathered rows [R, d], their weights and source rows, the
     * experts' gate|up [R, 2I], hidden [R, I] and outputs [R, d], slots by expert id */
    float *rl, *mx, *aw, *mgu, *mhid, *my, *prob; int32_t *arow; slot_t *slots; int nslots;
    int64_t *ctr; /* a prompt's hand-out counters (pk_mat.h), HAND_SLOTS a block; NULL: even splits */
} bufs_t;

static void pk_rmsnorm(const float *x, const float *g, float eps, float *out, int64_t n); /* one row */
static size_t pk_scratch_floats(const step_t *S, int nt); /* floats of scratch for pk_run_step */
static void pk_run_step(const step_t *S, float *scratch, int nt); /* GIL released by the caller */
static void pk_row_sharing(step_t *S); /* sets seq1 and indep from the rows' caches */

#endif /* PK_DECODE_H */

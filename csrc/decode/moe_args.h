/* Argument parsing of an MoE layer of the fused decode step (csrc/decode/moe.h computes it).
 *
 *
 * A layer tuple's 15th item, when not None, replaces its gate/up and down (items 12, 13: None):
 *   (E, top_k, gating, norm_topk_prob, router_mat, shared_gate|None, experts, chosen|None
 *    [, (alpha, limit)])
 *   gating: 0 softmax over E, 1 sigmoid, 2 softmax over the chosen k logits (GPT-OSS, GraniteMoE;
 *   norm_topk_prob ignored); router_mat: float32 [E, d] (kind 0), its bias the router bias;
 *   (alpha, limit): GPT-OSS's clamped SwiGLU instead of SiLU (poly/nn/moe.py clamped_swiglu);
 *   the experts' mats may carry biases. shared_gate: float32 [d]; experts: E tuples
 *   (gate_up_mats, down_mat), + 1 for the shared expert when shared_gate is given;
 *   chosen: writable int32 [>= n, top_k], each row's experts in rank order, written per call. */
#ifndef POLY_DECODE_MOE_ARGS_H
#define POLY_DECODE_MOE_ARGS_H
#include "core/common.h"
#include "formats/kinds.h"
#include "decode/step.h"
#include "decode/args_buffers.h"

#define MOE_MAX_K 64

/* buffers an MoE layer may hold (10 per expert, router, gates, chosen) for holds_t's capacity */
static Py_ssize_t moe_holds(PyObject *layers, Py_ssize_t nl) {
    Py_ssize_t c = 0;
    for (Py_ssize_t l = 0; l < nl; l++) {
        PyObject *t = PyTuple_GET_ITEM(layers, l);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 15) continue; /* 16: with recipe options (GPT-OSS) */
        PyObject *m = PyTuple_GET_ITEM(t, 14);
        if (!PyTuple_Check(m) || PyTuple_GET_SIZE(m) < 8 || !PyTuple_Check(PyTuple_GET_ITEM(m, 6))) continue;
        c += 10 * PyTuple_GET_SIZE(PyTuple_GET_ITEM(m, 6)) + 8;
    }
    return c;
}

static int moe_loom(const moe_t *M) {
    int loom = 0;
    for (int e = 0; e < M->nex; e++) {
        loom |= KINDS[M->ex[e].down.kind]->flat;
        for (int i = 0; i < M->ex[e].ngu; i++) loom |= KINDS[M->ex[e].gu[i].kind]->flat;
    }
    return loom;
}

static int moe_ints(PyObject *m, moe_t *M) {
    M->E = (int)PyLong_AsLong(PyTuple_GET_ITEM(m, 0));
    M->k = (int)PyLong_AsLong(PyTuple_GET_ITEM(m, 1));
    M->gating = (int)PyLong_AsLong(PyTuple_GET_ITEM(m, 2));
    M->sig = M->gating == MOE_SIGMOID;
    M->norm = PyObject_IsTrue(PyTuple_GET_ITEM(m, 3));
    if (PyErr_Occurred() || M->norm < 0) return -1;
    if (M->gating < MOE_SOFTMAX || M->gating > MOE_SOFTMAX_TOPK) {
        PyErr_Format(PyExc_ValueError, "MoE gating %d (0 softmax, 1 sigmoid, 2 softmax over the top k)", M->gating);
        return -1;
    }
    if (M->E < 1 || M->E > 4096 || M->k < 1 || M->k > M->E || M->k > MOE_MAX_K) {
        PyErr_Format(PyExc_ValueError, "MoE with %d experts and top_k %d (1 <= top_k <= min(E, %d))", M->E,
                     M->k, MOE_MAX_K);
        return -1;
    }
    return 0;
}

/* the optional 9th item: (alpha, limit) of the clamped SwiGLU */
static int moe_clamp(PyObject *m, moe_t *M) {
    if (PyTuple_GET_SIZE(m) < 9 || PyTuple_GET_ITEM(m, 8) == Py_None) return 0;
    PyObject *c = PyTuple_GET_ITEM(m, 8);
    if (as_tuple(c, 2, "the clamped SwiGLU (alpha, limit)")) return -1;
    M->alpha = (float)PyFloat_AsDouble(PyTuple_GET_ITEM(c, 0));
    M->limit = (float)PyFloat_AsDouble(PyTuple_GET_ITEM(c, 1));
    if (PyErr_Occurred()) return -1;
    if (!(M->alpha > 0.0f) || !(M->limit > 0.0f) || !isfinite(M->alpha) || !isfinite(M->limit)) {
        PyErr_SetString(PyExc_ValueError, "the clamped SwiGLU needs positive finite alpha and limit");
        return -1;
    }
    M->clamp = 1;
    return 0;
}

static int parse_moe(holds_t *H, PyObject *m, step_t *S, layer_t *L, int64_t d, int64_t *inter) {
    if (!PyTuple_Check(m) || PyTuple_GET_SIZE(m) != 9) {
        if (as_tuple(m, 8, "an MoE layer")) return -1;
    }
    moe_t *M = L->moe = calloc(1, sizeof(moe_t));
    if (!M) { PyErr_NoMemory(); return -1; }
    if (moe_ints(m, M) || moe_clamp(m, M)) return -1;
    if (parse_mat(H, PyTuple_GET_ITEM(m, 4), &M->router, M->E, d)) return -1;
    if (M->router.kind != K_F32) {
        PyErr_SetString(PyExc_ValueError, "the router must be float32");
        return -1;
    }
    PyObject *og = PyTuple_GET_ITEM(m, 5), *ox = PyTuple_GET_ITEM(m, 6), *oc = PyTuple_GET_ITEM(m, 7);
    if (og != Py_None && !(M->sgate = hold(H, og, 0, d * 4, "shared gate"))) return -1;
    M->nex = M->E + (og != Py_None);
    if (as_tuple(ox, M->nex, "experts")) return -1;
    if (!(M->ex = calloc((size_t)(unsigned)M->nex, sizeof(expert_t)))) { PyErr_NoMemory(); return -1; }
    for (int e = 0; e < M->nex; e++) {
        PyObject *t = PyTuple_GET_ITEM(ox, e);
        if (as_tuple(t, 2, "an expert")) return -1;
        expert_t *X = &M->ex[e];
        if (parse_ffn(H, PyTuple_GET_ITEM(t, 0), PyTuple_GET_ITEM(t, 1), &X->ngu, X->gu, &X->down, d, inter)) return -1;
        X->I = X->down.A.k;
    }
    if (oc != Py_None && !(M->chosen = (int32_t *)hold(H, oc, 1, -1, "chosen"))) return -1;
    if (M->chosen && H->bufs[H->n - 1].len < (Py_ssize_t)S->n * M->k * 4) {
        PyErr_SetString(PyExc_ValueError, "chosen must hold n * top_k int32");
        return -1;
    }
    const int64_t rows = (int64_t)S->n * (M->k + (og != Py_None));
    if (rows > S->mrows) S->mrows = rows;
    if (M->E > S->mE) S->mE = M->E;
    return 0;
}

#endif /* POLY_DECODE_MOE_ARGS_H */

"""The argument tuples of the fused decode step (poly/runtime/fused.py): one record per matrix,
norm, FFN or MoE layer and block, built from a model's layers as csrc/decode/args.h reads them;
None wherever no C kernel reads a form."""

from __future__ import annotations

import numpy as np

from poly.layer import Activation, LayerType
from poly.model.block import slots
from poly.nn import gelu_mlp, layernorm, mha, moe, rmsnorm, swiglu
from poly.rope import rope_tables
from poly.runtime import ckernels, fused_rope, repack

_F32 = np.dtype(np.float32)


def mat(w, bias=None, by16: bool = True, copy: bool = True) -> tuple | None:
    """(kind, w, aux, m, k, bias[, rp]) for the C side, None when no C kernel reads `w`.
    ``copy=False``: no repacked copy (paged experts are read from their file pages)."""
    if bias is not None and not is_f32(bias):
        return None
    if isinstance(w, np.ndarray):  # float32 / float16 / bfloat16 arrays are read as they are
        kind = ckernels.DENSE_KINDS.get(w.dtype.name)
        if kind is None or w.ndim != 2 or not w.flags.c_contiguous:
            return None
        hk = (
            repack.float_kmajor16(kind, w, w, *w.shape) if by16 else None
        )  # rows by 16 (float_kmajor16.h)
        return (kind, w, None, w.shape[0], w.shape[1], bias) + (() if hk is None else (hk,))
    ops = (ckernels.laid(w) or ckernels.operands(w)) if ckernels.AVAILABLE else None
    if ops is None:
        return None
    kind, data, aux = ops
    m, k = int(w.shape[0]), int(w.shape[1])
    rp = repack.copy_for(w, kind, data, m, k, aux, by16) if copy else None  # by 16, made once
    return (kind, data, aux, m, k, bias) + (() if rp is None else (rp,))


def mats(pairs, by16: bool = True, copy: bool = True) -> tuple | None:
    out = tuple(mat(w, b, by16, copy) for w, b in pairs)
    return None if any(m is None for m in out) else out


def ffn_args(mlp, by16: bool = True, copy: bool = True) -> tuple | None:
    """(gate_up_mats, down_mat) of a SwiGLU for the C side, or None."""
    if mlp.is_disabled or mlp.use_tiling:
        return None
    fp = swiglu.plan(mlp)
    if not fp.silu:
        return None
    c = fp.comps
    pairs = [(c["w_gate"], c["b_gate"]), (c["w_up"], c["b_up"])]
    gu = mats([(fp.w_gu, fp.b_gu)] if fp.w_gu is not None else pairs, by16, copy)
    down = mat(c["w_down"], c["b_down"], by16, copy)
    return None if gu is None or down is None else (gu, down)


def moe_args(mlp) -> tuple | None:
    """The C record of an MoE layer (csrc/decode/moe_args.h), or None: (E, top_k, gating,
    norm_topk_prob, router (+ its bias), shared_gate, experts (+ their biases), chosen
    [STEP_ROWS, top_k] int32, (alpha, limit) of GPT-OSS's clamped SwiGLU or None)."""
    cfg = mlp.moe
    gating = _GATINGS.get(cfg.gating)
    if gating is None or cfg.activation not in ("silu", "swiglu_oai"):
        return None
    v = moe.views(mlp)
    bias = None if v.router_bias is None else np.ascontiguousarray(v.router_bias)
    router = mat(np.ascontiguousarray(v.router, dtype=np.float32), bias)
    # the experts' float rows stay as stored: a pager drops and reads them from the file;
    # paged experts get no repacked copy either (it would hold every expert in memory)
    copy = getattr(mlp, "expert_cache", None) is None
    experts = tuple(ffn_args(sub, by16=False, copy=copy) for sub in mlp.sequential_layers)
    if cfg.top_k > 64 or router is None or any(a is None for a in experts):
        return None
    gate = None if v.shared_gate is None else v.shared_gate.reshape(-1)  # [1, d] -> [d]
    chosen = np.zeros((ckernels.STEP_ROWS, cfg.top_k), dtype=np.int32)
    clamp = None
    if cfg.activation == "swiglu_oai":
        clamp = (float(cfg.swiglu_alpha), float(cfg.swiglu_limit))
    norm = cfg.norm_topk_prob
    return (cfg.num_experts, cfg.top_k, gating, norm, router, gate, experts, chosen, clamp)


_GATINGS = {"softmax": 0, "sigmoid": 1, "softmax_topk": 2}  # csrc/decode/step.h MOE_*


# the C side's FFN activations (csrc/decode/step.h layer_t.act): 0 silu and 1 gelu_tanh gated,
# 2 exact and 3 tanh GELU of a plain MLP
_GATED_ACT = {Activation.SILU: 0, Activation.LINEAR: 0, Activation.GELU: 1}
_PLAIN_ACT = {Activation.GELU_ERF: 2, Activation.GELU: 3}


def dense_ffn(mlp) -> tuple | None:
    """(act, gate_up_mats, down_mat) of a dense FFN (SwiGLU, GeGLU, plain GELU MLP), or None."""
    if mlp.is_disabled or mlp.use_tiling:
        return None
    if mlp.type == LayerType.SWIGLU and mlp.activation in _GATED_ACT:
        fp = swiglu.plan(mlp)
        c = fp.comps
        pairs = [(c["w_gate"], c["b_gate"]), (c["w_up"], c["b_up"])]
        gu = mats([(fp.w_gu, fp.b_gu)] if fp.w_gu is not None else pairs)
        down = mat(c["w_down"], c["b_down"])
        act = _GATED_ACT[mlp.activation]
    elif mlp.type == LayerType.GELU_MLP and mlp.activation in _PLAIN_ACT:
        c = mlp.weights.plan("gelu_mlp", lambda: gelu_mlp.components(mlp))
        gu, down = mats([(c["w_up"], c["b_up"])]), mat(c["w_down"], c["b_down"])
        act = _PLAIN_ACT[mlp.activation]
    else:
        return None
    return None if gu is None or down is None else (act, gu, down)


def norm_args(layer) -> tuple | None:
    """(gamma, beta | None) of a norm sub-layer (beta: a LayerNorm's), or None."""
    if layer.type == LayerType.RMSNORM:
        return rmsnorm.gamma(layer), None
    if layer.type == LayerType.LAYERNORM:
        return layernorm.params(layer)
    return None


def attn_ok(attn) -> bool:
    """Whether the C step implements the layer's attention options (not: mha.has_options, and
    a tensor-parallel shard's all-head q/k norm, whose sums span the ranks)."""
    if mha.has_options(attn):
        return False
    return not (attn.qk_norm_all and getattr(attn, "qk_norm_share", None) is not None)


def layer_args(blk, cfg) -> tuple | None:
    """The C tuple of one block built from `cfg.block`, or None when some part has no C kernel:
    llama's block in 14 items (15: an MoE FFN), any other recipe or attention option with a
    16th, its options (csrc/decode/recipe_args.h)."""
    at, subs = slots(cfg.block), blk.sequential_layers
    attn, mlp = subs[at["attn"]], subs[at["mlp"]]
    if not attn_ok(attn):
        return None
    ap = mha.plan(attn)
    c = ap.comps
    qkv = mats([(ap.w_qkv, ap.b_qkv)]) if ap.w_qkv is not None else mats(ap.parts)
    sparse = mlp.type == LayerType.MOE
    ffn = moe_args(mlp) if sparse else dense_ffn(mlp)
    o = mat(c["w_o"], c["b_o"])
    if qkv is None or ffn is None or o is None:
        return None
    eps = float(attn.rms_norm_eps)
    norms = {r: subs[i] for r, i in at.items() if r.endswith("norm")}
    if any(float(n.rms_norm_eps) != eps for n in norms.values()):
        return None  # one eps per block on the C side
    got = {r: norm_args(n) for r, n in norms.items()}
    if any(v is None for v in got.values()) or len({n.type for n in norms.values()}) > 1:
        return None
    vecs = [v for pair in got.values() for v in pair if v is not None]
    qn, kn = (c["q_norm"], c["k_norm"]) if attn.qk_norm else (None, None)
    qb, kb = (c.get("q_norm_bias"), c.get("k_norm_bias")) if attn.qk_norm else (None, None)
    sinks = c["sinks"] if attn.attn_sinks else None
    if not all(is_f32(v) for v in (*vecs, qn, kn, qb, kb, sinks) if v is not None):
        return None  # the C side reads vectors as contiguous float32
    rot = mha.rotary_dim(attn)
    cos, sin = (None, None)
    if rot and fused_rope.is_length_dependent(attn):  # rows written per call (fused_rope.fill)
        cos, sin = fused_rope.own_tables(attn)
    elif rot:
        base = float(attn.rope_freq_base)
        cos, sin = rope_tables(rot, base, attn.rope_scaling, attn.max_seq_len)
    g1, g2 = got.get("attn_norm", (None, None)), got.get("mlp_norm", (None, None))
    heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim, eps)
    if sparse:  # gate/up and down are the 15th item's experts
        items = (*heads, g1[0], qn, kn, qkv, cos, sin, o, g2[0], None, None, ffn)
    else:
        items = (*heads, g1[0], qn, kn, qkv, cos, sin, o, g2[0], ffn[1], ffn[2])
    opts = recipe_args(cfg, attn, got, 0 if sparse else ffn[0], rot, sinks, (qb, kb))
    if opts is None:
        return items
    if sparse and not cfg.block.plain:
        return None  # the MoE FFN (csrc/decode/moe.h) adds its output as llama's pre-norm block
    return (*items[:14], items[14] if sparse else None, opts)


def recipe_args(cfg, attn, norms: dict, act: int, rot: int, sinks, qk_betas) -> tuple | None:
    """The 16th item of a layer's C tuple (csrc/decode/recipe_args.h), None for llama's block
    with plain attention."""
    r = cfg.block
    form = mha.qk_form(attn)
    plain_attn = rot == attn.head_dim and not (
        attn.sliding_window or attn.rope_interleaved or attn.attn_scale or attn.attn_softcap
        or sinks is not None or (attn.qk_norm and attn.qk_norm_all) or form
    )  # fmt: skip
    if r.plain and plain_attn and cfg.residual_multiplier == 1 and act == 0:
        return None
    none = (None, None)
    ln = int(any(b is not None for _, b in norms.values()))
    post_a, post_m = norms.get("attn_post_norm", none), norms.get("mlp_post_norm", none)
    par = (2 if r.shared_norm else 1) if r.parallel else 0
    return (ln, norms.get("attn_norm", none)[1], norms.get("mlp_norm", none)[1],
            *post_a, *post_m, int(not r.pre_norms), par, float(cfg.residual_multiplier), act,
            float(attn.attn_scale), float(attn.attn_softcap), int(attn.sliding_window), sinks,
            rot, int(attn.rope_interleaved), int(bool(attn.qk_norm and attn.qk_norm_all)), form,
            *qk_betas)  # fmt: skip


def is_f32(a) -> bool:
    return isinstance(a, np.ndarray) and a.dtype == _F32 and a.flags.c_contiguous

"""Mixture of experts: a float32 router picks top-k SwiGLU experts per token (the MoE layer kind).

Layer record: ``type=LayerType.MOE``, ``input_height`` = model dim d, ``moe`` = a
``poly.config.MoEConfig`` (E experts, top_k, gating, norm_topk_prob, shared expert width).

Master (float32, offsets in values; docs/architecture.md "MoE"):

    router       [E x d]   at 0
    shared_gate  [1 x d]   at E*d          (only with a shared expert)
    router_bias  [E]       after those     (only with ``router_bias``: GPT-OSS)

The experts are sub-layers (``sequential_layers``): E SwiGLU layers ``[I x d]`` (index e is
expert e), then the shared expert (a SwiGLU of width ``shared_intermediate_size``) when there is
one. Each expert therefore has the SwiGLU offset layout and its own weight store: it morphs,
quantizes and saves like any SwiGLU, and a reader can map one expert without the others. The
router stays float32 (morph skips it).

Forward, per token: logits = x @ router.T [+ router_bias] (float32), weights = softmax(logits)
or sigmoid(logits), the top_k largest taken by a stable descending sort (on exact ties the lower
expert id wins), renormalised over the k when ``norm_topk_prob`` (gating "softmax_topk": the
top_k logits, then softmax over those k); out = sum_k w_k * expert_k(x)
[+ sigmoid(shared_gate . x) * shared(x)]. Experts apply silu(gate) * up, or with activation
"swiglu_oai" GPT-OSS's clamped form (poly.config.EXPERT_ACTIVATIONS), biases included.
Tokens are grouped by expert: one matrix product per used expert (a decode step touches only
its k experts). An expert cache set on the layer
(``layer.expert_cache``, a `poly.runtime.expert_cache.ExpertHandle` when experts are paged
under a memory budget) is told about every expert used, before it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from poly.config import MoEConfig
from poly.errors import LayerConfigError
from poly.layer import LayerKind, LayerType, VolumetricLayer
from poly.nn import swiglu
from poly.nn.spec import Spec, carve
from poly.ops import HOOKS, dense_matmul, linear


@dataclass
class MoEViews:
    """An MoE layer's router (and its bias, and the shared expert's gate) as named views into
    its master."""

    router: np.ndarray  # [E, d]
    shared_gate: np.ndarray | None = None  # [1, d]
    router_bias: np.ndarray | None = None  # [E]

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _make_experts(layer) -> list:
    cfg, d = layer.moe, layer.input_height
    widths = [cfg.expert_intermediate_size] * cfg.num_experts
    if cfg.shared_intermediate_size:
        widths.append(cfg.shared_intermediate_size)
    return [
        VolumetricLayer(
            type=LayerType.SWIGLU, input_height=d, output_height=w, allocate=layer.allocate
        )
        for w in widths
    ]


def complete_dims(layer) -> None:
    """Check the MoE record; build the expert sub-layers when none were given."""
    layer.moe = MoEConfig.coerce(layer.moe)
    cfg = layer.moe
    if cfg is None:
        raise LayerConfigError("MoE needs a moe config (num_experts, top_k, ...)")
    if layer.input_height <= 0:
        raise LayerConfigError("MoE needs input_height (model dim)")
    layer.output_height = layer.input_height
    if not layer.sequential_layers:
        layer.sequential_layers = _make_experts(layer)
    want = cfg.num_experts + (1 if cfg.shared_intermediate_size else 0)
    subs = layer.sequential_layers
    if len(subs) != want:
        raise LayerConfigError(f"MoE with {cfg.num_experts} experts has {len(subs)} sub-layers")
    for e, sub in enumerate(subs):
        width = (
            cfg.expert_intermediate_size if e < cfg.num_experts else cfg.shared_intermediate_size
        )
        if sub.type != LayerType.SWIGLU or (sub.input_height, sub.output_height) != (
            layer.input_height,
            width,
        ):
            raise LayerConfigError(
                f"MoE expert {e} must be a SwiGLU [{width} x {layer.input_height}]"
            )


def spec(layer) -> Spec:
    """[(role, shape)] of the MoE master: the router, then the shared expert's gate."""
    cfg, d = layer.moe, layer.input_height
    table = [("router", (cfg.num_experts, d))]
    if cfg.shared_intermediate_size:
        table.append(("shared_gate", (1, d)))
    if cfg.router_bias:
        table.append(("router_bias", (cfg.num_experts,)))
    return table


def views(layer) -> MoEViews:
    return MoEViews(**carve(layer.weights.master, spec(layer)))


def experts(layer) -> list:
    """The routed experts (SwiGLU layers), index = expert id."""
    return layer.sequential_layers[: layer.moe.num_experts]


def shared_expert(layer):
    cfg = layer.moe
    return layer.sequential_layers[cfg.num_experts] if cfg.shared_intermediate_size else None


# --- routing ----------------------------------------------------------------------------------


def gate_weights(logits: np.ndarray, gating: str) -> np.ndarray:
    """Router logits [n, E] -> float32 scores [n, E] (softmax over E, or sigmoid; the logits
    themselves for "softmax_topk", whose softmax comes after the choice)."""
    z = np.asarray(logits, np.float32)
    if gating == "sigmoid":
        return (1.0 / (1.0 + np.exp(-z))).astype(np.float32)
    if gating == "softmax_topk":
        return z
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def route(
    logits: np.ndarray, top_k: int, gating: str = "softmax", norm_topk_prob: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """(expert ids [n, k] int64, weights [n, k] float32). Descending by score with a stable sort,
    so of exactly tied experts the lower id comes first (torch.topk leaves that unspecified)."""
    probs = gate_weights(logits, gating)  # [n, E]
    if not 1 <= top_k <= probs.shape[-1]:
        raise LayerConfigError(f"top_k {top_k} is outside [1, {probs.shape[-1]}]")
    idx = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]  # [n, k]
    w = np.take_along_axis(probs, idx, axis=-1)  # [n, k]
    if gating == "softmax_topk":
        w = gate_weights(w, "softmax")  # over the chosen k only
    elif norm_topk_prob:
        w = w / w.sum(axis=-1, keepdims=True)
    return idx.astype(np.int64), w.astype(np.float32)


def router_logits(layer, x2: np.ndarray) -> np.ndarray:
    """x2 [n, d] -> float32 logits [n, E]."""
    v = views(layer)
    logits = dense_matmul(np.ascontiguousarray(x2, dtype=np.float32), v.router)  # [n, E]
    if v.router_bias is not None:
        logits += v.router_bias
    return logits


def clamped_swiglu(gate: np.ndarray, up: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    """GPT-OSS's expert activation (transformers' GptOssExperts._apply_gate), float32 [n, I]."""
    gate = np.minimum(gate, np.float32(limit))
    up = np.clip(up, np.float32(-limit), np.float32(limit))
    with np.errstate(over="ignore"):  # exp(-a*gate) of a very negative gate: inf, sigmoid 0
        glu = gate * (np.float32(1.0) / (np.float32(1.0) + np.exp(-np.float32(alpha) * gate)))
    return ((up + np.float32(1.0)) * glu).astype(np.float32, copy=False)


def run_expert(sub, x2: np.ndarray, cfg: MoEConfig) -> np.ndarray:
    """One expert on its rows x2 [m, d] -> [m, d]; the clamped form needs gate and up apart."""
    if cfg.activation == "silu":
        return sub.forward(x2)
    c = swiglu.components(sub)
    gate = linear(x2, c["w_gate"], c["b_gate"])  # [m, I]
    up = linear(x2, c["w_up"], c["b_up"])  # [m, I]
    hidden = clamped_swiglu(gate, up, cfg.swiglu_alpha, cfg.swiglu_limit)
    return linear(np.ascontiguousarray(hidden), c["w_down"], c["b_down"])  # [m, d]


# --- forward ----------------------------------------------------------------------------------


def forward(layer, x: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
    squeeze = x.ndim == 1
    d = layer.input_height
    x2 = np.ascontiguousarray(x.reshape(-1, d), dtype=np.float32)  # [n, d]
    cfg = layer.moe
    idx, w = route(router_logits(layer, x2), cfg.top_k, cfg.gating, cfg.norm_topk_prob)
    out = np.zeros_like(x2)  # [n, d]
    k = cfg.top_k
    flat = idx.ravel()
    order = np.argsort(flat, kind="stable")  # (token, slot) pairs grouped by expert
    counts = np.bincount(flat, minlength=cfg.num_experts)
    cache = getattr(layer, "expert_cache", None)
    subs = layer.sequential_layers
    # the C backend's per-expert path (poly/runtime/experts.py) knows SiLU experts only
    fast = HOOKS["expert"] if cfg.activation == "silu" else None
    start = 0
    for e in np.flatnonzero(counts):  # ascending expert id, like transformers' index_add_
        pairs = order[start : start + counts[e]]
        start += counts[e]
        rows, slots = pairs // k, pairs % k  # a token picks an expert at most once
        if cache is not None:
            cache.use(int(e))
        xe = x2[rows] if len(rows) < len(x2) else x2  # [m, d]
        y = None if fast is None else fast(subs[e], xe)
        if y is None:
            y = run_expert(subs[e], xe, cfg)  # [m, d]
        out[rows] += y * w[rows, slots][:, None]
    shared = shared_expert(layer)
    if shared is not None:
        g = x2 @ views(layer).shared_gate.T  # [n, 1]
        out += (1.0 / (1.0 + np.exp(-g))) * shared.forward(x2)
    return out.reshape(-1) if squeeze else out


# The router is not in `matrices`: morph and the bakes keep it float32.
KIND = LayerKind(LayerType.MOE, forward, complete_dims, spec, views)

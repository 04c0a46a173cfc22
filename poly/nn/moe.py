"""Mixture of experts: a float32 router picks top-k SwiGLU experts per token (the MoE layer kind).

Layer record: ``type=LayerType.MOE``, ``input_height`` = model dim d, ``moe`` = a
``poly.config.MoEConfig`` (E experts, top_k, gating, norm_topk_prob, shared expert width).

Master (float32, offsets in values; docs/architecture.md "MoE"):

    router       [E x d]   at 0
    shared_gate  [1 x d]   at E*d          (only with a shared expert)

The experts are sub-layers (``sequential_layers``): E SwiGLU layers ``[I x d]`` (index e is
expert e), then the shared expert (a SwiGLU of width ``shared_intermediate_size``) when there is
one. Each expert therefore has the SwiGLU offset layout and its own weight store: it morphs,
quantizes and saves like any SwiGLU, and a reader can map one expert without the others. The
router stays float32 (morph skips it).

Forward, per token: logits = x @ router.T (float32), weights = softmax(logits) or
sigmoid(logits), the top_k largest taken by a stable descending sort (on exact ties the lower
expert id wins), renormalised over the k when ``norm_topk_prob``; out = sum_k w_k * expert_k(x)
[+ sigmoid(shared_gate . x) * shared(x)]. Tokens are grouped by expert: one matrix product per
used expert (a decode step touches only its k experts). An expert cache set on the layer
(``layer.expert_cache``, a `poly.runtime.expert_cache.ExpertHandle` when experts are paged
under a memory budget) is told about every expert used, before it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from poly.config import MoEConfig
from poly.errors import LayerConfigError
from poly.layer import LayerKind, LayerType, VolumetricLayer
from poly.nn.spec import Spec, carve
from poly.ops import HOOKS, dense_matmul


@dataclass
class MoEViews:
    router: np.ndarray  # [E, d]
    shared_gate: np.ndarray | None = None  # [1, d]

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
    """Router logits [n, E] -> float32 scores [n, E] (softmax over E, or sigmoid)."""
    z = np.asarray(logits, np.float32)
    if gating == "sigmoid":
        return (1.0 / (1.0 + np.exp(-z))).astype(np.float32)
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
    if norm_topk_prob:
        w = w / w.sum(axis=-1, keepdims=True)
    return idx.astype(np.int64), w.astype(np.float32)


def router_logits(layer, x2: np.ndarray) -> np.ndarray:
    """x2 [n, d] -> float32 logits [n, E]."""
    router = views(layer).router  # [E, d]
    return dense_matmul(np.ascontiguousarray(x2, dtype=np.float32), router)  # [n, E]


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
    fast = HOOKS["expert"]  # the C backend's per-expert path (poly/runtime/experts.py)
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
            y = subs[e].forward(xe)  # [m, d]
        out[rows] += y * w[rows, slots][:, None]
    shared = shared_expert(layer)
    if shared is not None:
        g = x2 @ views(layer).shared_gate.T  # [n, 1]
        out += (1.0 / (1.0 + np.exp(-g))) * shared.forward(x2)
    return out.reshape(-1) if squeeze else out


# The router is not in `matrices`: morph and the bakes keep it float32.
KIND = LayerKind(LayerType.MOE, forward, complete_dims, spec, views)

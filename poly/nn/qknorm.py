"""The q/k norms of attention (poly.nn.mha): RMSNorm per head (Qwen3, OLMo-2's over all heads
at once) or LayerNorm per head with or without a bias (Phi's qk_layernorm, Cohere's
use_qk_norm), one weight shared by the heads or one row per head."""

from __future__ import annotations

import numpy as np

from poly.nn.layernorm import layer_norm
from poly.ops import rms_norm


def qk_norm(layer, comps: dict, q, k):
    """q [n, q_dim], k [n, kv_dim] -> q [n, H, hd], k [n, kvh, hd], RMS-normed if asked."""
    n, hd = q.shape[0], layer.head_dim
    if layer.qk_norm and layer.qk_norm_all:  # one norm over every head's values at once
        q, k = _norm_all(layer, comps, q, k)
    q = q.reshape(n, layer.num_heads, hd)  # [n, H, hd]
    k = k.reshape(n, layer.num_kv_heads, hd)  # [n, kvh, hd]
    if layer.qk_norm and not layer.qk_norm_all:
        q, k = _head_norm(layer, comps, q, "q"), _head_norm(layer, comps, k, "k")
    return q, k


def _head_norm(layer, comps: dict, x: np.ndarray, which: str) -> np.ndarray:
    """x [n, heads, hd] normed over each head: RMSNorm or LayerNorm, its weight shared by the
    heads or (qk_norm_heads) one row per head."""
    w, eps = comps[f"{which}_norm"], layer.rms_norm_eps
    if layer.qk_norm_heads:
        w = w.reshape(x.shape[1], -1)  # [heads, hd]
    if layer.qk_norm_kind == "rms":
        return rms_norm(x, w, eps)
    bias = comps.get(f"{which}_norm_bias")
    if bias is not None and layer.qk_norm_heads:
        bias = bias.reshape(x.shape[1], -1)
    return layer_norm(x, w, bias, eps)


def _norm_all(layer, comps: dict, q, k):
    """RMSNorm of q [n, q_dim] and k [n, kv_dim] over every head. A tensor-parallel shard holds
    some of the heads: its `qk_norm_share` (poly.runtime.tp) turns the local sums of squares
    [n, 2] into the mean squares over all heads (one small all-reduce)."""
    share, eps = getattr(layer, "qk_norm_share", None), layer.rms_norm_eps
    if share is None:
        return rms_norm(q, comps["q_norm"], eps), rms_norm(k, comps["k_norm"], eps)
    dt = np.float64 if q.dtype == np.float64 else np.float32
    q, k = np.asarray(q, dtype=dt), np.asarray(k, dtype=dt)
    sums = np.stack([np.einsum("ni,ni->n", q, q), np.einsum("ni,ni->n", k, k)], axis=1)
    inv = dt(1.0) / np.sqrt(share(np.ascontiguousarray(sums)) + dt(eps))  # [n, 2]
    return q * inv[:, :1] * comps["q_norm"], k * inv[:, 1:] * comps["k_norm"]

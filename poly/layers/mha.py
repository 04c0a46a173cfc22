"""Multi-head attention: GQA/MQA, HF half-split RoPE, optional q/k RMSNorm, biases, causal,
with a preallocated KV cache that continues across calls."""

from __future__ import annotations

import numpy as np

from poly import layout
from poly.errors import ContextOverflowError, LayerConfigError
from poly.ops import linear, rms_norm
from poly.rope import apply_rope, rope_tables


class KVCache:
    """Keys/values for positions [0, length), preallocated to max_seq_len (no ring wrap)."""

    def __init__(self, max_len: int, kv_heads: int, head_dim: int):
        self.k = np.zeros((max_len, kv_heads, head_dim), dtype=np.float32)  # [T, kvh, hd]
        self.v = np.zeros((max_len, kv_heads, head_dim), dtype=np.float32)  # [T, kvh, hd]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[0]

    def reset(self) -> None:
        self.length = 0

    def truncate(self, n: int) -> None:
        self.length = max(0, min(self.length, n))


def _cache(layer) -> KVCache:
    if layer.state is None or layer.state.capacity != layer.max_seq_len:
        layer.state = KVCache(layer.max_seq_len, layer.num_kv_heads, layer.head_dim)
    return layer.state


def _project_qkv(layer, x: np.ndarray, comps: dict, block_rows: int):
    q_dim, kv_dim = layer.query_dim, layer.num_kv_heads * layer.head_dim
    master = layer.weights.master
    if layer.weights.active is None and not block_rows:
        # W_Q, W_K, W_V sit back to back in the master: one fused [q+2kv, d] projection.
        w_qkv = master[: (q_dim + 2 * kv_dim) * layer.d_model].reshape(-1, layer.d_model)
        qkv = x @ w_qkv.T  # [n, q+2kv]
        qkv += _fused_bias(layer, comps)
        return qkv[:, :q_dim], qkv[:, q_dim : q_dim + kv_dim], qkv[:, q_dim + kv_dim :]
    q = linear(x, comps["w_q"], comps["b_q"], block_rows)
    k = linear(x, comps["w_k"], comps["b_k"], block_rows)
    v = linear(x, comps["w_v"], comps["b_v"], block_rows)
    return q, k, v


def _fused_bias(layer, comps: dict) -> np.ndarray:
    # b_Q, b_K, b_V are contiguous in the master too.
    q_dim, kv_dim, d = layer.query_dim, layer.num_kv_heads * layer.head_dim, layer.d_model
    start = 2 * q_dim * d + 2 * kv_dim * d
    return layer.weights.master[start : start + q_dim + 2 * kv_dim]


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, groups: int) -> np.ndarray:
    """q [n, H, hd] at positions start..start+n-1 over k/v [T, kvh, hd] -> [n, H, hd]."""
    n, heads, hd = q.shape
    kvh, t = k.shape[1], k.shape[0]
    qg = q.reshape(n, kvh, groups, hd).transpose(1, 2, 0, 3)  # [kvh, g, n, hd]
    scores = qg @ k.transpose(1, 2, 0)[:, None]  # [kvh, g, n, T]
    scores *= np.float32(1.0 / np.sqrt(hd))
    if n > 1:
        qpos = np.arange(start, start + n)[:, None]
        scores[..., np.arange(t)[None, :] > qpos] = -np.inf  # causal
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = scores @ v.transpose(1, 0, 2)[:, None]  # [kvh, g, n, hd]
    return out.transpose(2, 0, 1, 3).reshape(n, heads, hd)  # [n, H, hd]


def _attend_tiled(q, k, v, start: int, groups: int, block: int) -> np.ndarray:
    """Flash-style attention over key blocks of `block` rows with an online softmax."""
    n, heads, hd = q.shape
    kvh, t = k.shape[1], k.shape[0]
    qg = q.reshape(n, kvh, groups, hd).transpose(1, 2, 0, 3)  # [kvh, g, n, hd]
    scale = np.float32(1.0 / np.sqrt(hd))
    m = np.full((kvh, groups, n, 1), -np.inf, dtype=np.float32)
    denom = np.zeros((kvh, groups, n, 1), dtype=np.float32)
    acc = np.zeros((kvh, groups, n, hd), dtype=np.float32)
    qpos = np.arange(start, start + n)[:, None]
    for k0 in range(0, t, block):
        kb = k[k0 : k0 + block].transpose(1, 2, 0)[:, None]  # [kvh, 1, hd, b]
        s = (qg @ kb) * scale  # [kvh, g, n, b]
        s[..., np.arange(k0, k0 + kb.shape[-1])[None, :] > qpos] = -np.inf
        m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
        alive = np.isfinite(m_new)  # rows with no visible key yet stay at zero
        p = np.exp(s - np.where(alive, m_new, 0))
        corr = np.where(alive, np.exp(np.where(alive, m - m_new, 0)), 1).astype(np.float32)
        denom = denom * corr + p.sum(axis=-1, keepdims=True)
        acc = acc * corr + p @ v[k0 : k0 + block].transpose(1, 0, 2)[:, None]
        m = m_new
    out = acc / denom
    return out.transpose(2, 0, 1, 3).reshape(n, heads, hd)  # [n, H, hd]


def forward(layer, x: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
    """x [n, d] (or [d]) -> [n, d]; appends the n positions to the layer's KV cache."""
    squeeze = x.ndim == 1
    x2 = x.reshape(-1, layer.d_model)  # [n, d]
    n = x2.shape[0]
    cache = _cache(layer)
    start = cache.length
    if start + n > cache.capacity:
        raise ContextOverflowError(
            f"context overflow: {start} cached + {n} new tokens > max_seq_len {cache.capacity}"
        )
    comps = layout.components(layer)
    tile = layer.tile_size if layer.use_tiling and layer.tile_size > 0 else 0
    hd, heads, kvh = layer.head_dim, layer.num_heads, layer.num_kv_heads
    q, k, v = _project_qkv(layer, x2, comps, tile)
    q = q.reshape(n, heads, hd)  # [n, H, hd]
    k = k.reshape(n, kvh, hd)  # [n, kvh, hd]
    if layer.qk_norm:
        q = rms_norm(q, comps["q_norm"], layer.rms_norm_eps)
        k = rms_norm(k, comps["k_norm"], layer.rms_norm_eps)
    cos, sin = rope_tables(hd, float(layer.rope_freq_base), layer.rope_scaling, cache.capacity)
    q = apply_rope(q, cos[start : start + n], sin[start : start + n])
    cache.k[start : start + n] = apply_rope(k, cos[start : start + n], sin[start : start + n])
    cache.v[start : start + n] = v.reshape(n, kvh, hd)
    end = start + n
    if tile:
        attn = _attend_tiled(q, cache.k[:end], cache.v[:end], start, heads // kvh, tile)
    else:
        attn = _attend(q, cache.k[:end], cache.v[:end], start, heads // kvh)
    cache.length = end
    out = linear(attn.reshape(n, heads * hd), comps["w_o"], comps["b_o"], tile)  # [n, d]
    return out.reshape(-1) if squeeze else out


def validate(layer) -> None:
    if layer.qk_norm and layer.head_dim <= 0:
        raise LayerConfigError("q/k norm needs head_dim")

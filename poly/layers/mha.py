"""Multi-head attention: GQA/MQA, HF half-split RoPE, optional q/k RMSNorm, biases, causal,
with a preallocated KV cache that continues across calls."""

from __future__ import annotations

import numpy as np

from poly import layout
from poly.errors import ContextOverflowError
from poly.kernels import dense_matmul
from poly.ops import linear, rms_norm
from poly.rope import rope_inplace, rope_tables


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


def cache_for(layer, cache: KVCache | None) -> KVCache:
    """`cache` if it fits `layer`, else a new empty one (first use, or max_seq_len changed)."""
    if cache is None or cache.capacity != layer.max_seq_len:
        return KVCache(layer.max_seq_len, layer.num_kv_heads, layer.head_dim)
    return cache


def _cache(layer) -> KVCache:
    layer.state = cache_for(layer, layer.state)
    return layer.state


class _Plan:
    """What one forward reads, derived once per weight version (not on every call)."""

    def __init__(self, layer):
        store = layer.weights
        self.key = _plan_key(layer)
        self.comps = layout.components(layer)
        q_dim, kv_dim, d = layer.query_dim, layer.num_kv_heads * layer.head_dim, layer.d_model
        self.splits = (q_dim, q_dim + kv_dim)
        self.w_qkv = self.b_qkv = None
        if store.active is None:
            # W_Q, W_K, W_V (and b_Q, b_K, b_V) sit back to back in the master: one projection.
            self.w_qkv = store.master[: (q_dim + 2 * kv_dim) * d].reshape(-1, d)  # [q+2kv, d]
            start = 2 * q_dim * d + 2 * kv_dim * d
            self.b_qkv = store.master[start : start + q_dim + 2 * kv_dim]
        self.parts = [(self.comps[w], self.comps[b]) for w, b in _QKV]
        self.width = q_dim + 2 * kv_dim


_QKV = (("w_q", "b_q"), ("w_k", "b_k"), ("w_v", "b_v"))


def _plan_key(layer) -> tuple:
    store = layer.weights
    if store.active is None:
        return (None, id(store.master))
    # a component swapped inside the version dict must invalidate too
    return (store.active, *map(id, store.versions[store.active].values()))


def plan(layer) -> _Plan:
    """The cached plan of `layer`, rebuilt when its active version or master object changes."""
    cached = getattr(layer, "_mha_plan", None)
    if cached is None or cached.key != _plan_key(layer):
        cached = _Plan(layer)
        layer._mha_plan = cached
    return cached


def _project_qkv(p: _Plan, x: np.ndarray, block_rows: int):
    """x [n, d] -> q [n, q], k [n, kv], v [n, kv] (views of one [n, q+2kv] buffer)."""
    if p.w_qkv is not None and not block_rows:
        qkv = dense_matmul(x, p.w_qkv)  # [n, q+2kv]
        if p.b_qkv.any():  # most checkpoints have no q/k/v bias: skip the pass
            qkv += p.b_qkv
    else:
        qkv = np.empty((x.shape[0], p.width), dtype=np.float32)  # [n, q+2kv]
        bounds = (0, *p.splits, p.width)
        for (w, bias), a, b in zip(p.parts, bounds[:-1], bounds[1:]):
            qkv[:, a:b] = linear(x, w, bias, block_rows)
    a, b = p.splits
    return qkv[:, :a], qkv[:, a:b], qkv[:, b:]


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, groups: int) -> np.ndarray:
    """q [n, H, hd] at positions start..start+n-1 over k/v [T, kvh, hd] -> [n, H, hd]."""
    n, heads, hd = q.shape
    kvh, t = k.shape[1], k.shape[0]
    # scaled q in one contiguous [kvh, g*n, hd] buffer: one GEMM per kv head, no stacked loops
    qg = np.empty((kvh, groups, n, hd), dtype=np.float32)  # [kvh, g, n, hd]
    np.multiply(
        q.reshape(n, kvh, groups, hd).transpose(1, 2, 0, 3), np.float32(1.0 / np.sqrt(hd)), out=qg
    )
    scores = qg.reshape(kvh, groups * n, hd) @ k.transpose(1, 2, 0)  # [kvh, g*n, T]
    scores = scores.reshape(kvh, groups, n, t)  # [kvh, g, n, T]
    if n > 1:  # causal: query i sees keys 0..start+i
        scores += np.triu(np.full((n, t), -np.inf, dtype=np.float32), k=start + 1)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = scores.reshape(kvh, groups * n, t) @ v.transpose(1, 0, 2)  # [kvh, g*n, hd]
    return out.reshape(kvh, groups, n, hd).transpose(2, 0, 1, 3).reshape(n, heads, hd)


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


def _append(layer, cache: KVCache, p: _Plan, q, k, v, tile: int) -> np.ndarray:
    """RoPE q/k at the cache position, append k/v, attend -> [n, H*hd]."""
    n, hd, heads, kvh = q.shape[0], layer.head_dim, layer.num_heads, layer.num_kv_heads
    start = cache.length
    if start + n > cache.capacity:
        raise ContextOverflowError(
            f"context overflow: {start} cached + {n} new tokens > max_seq_len {cache.capacity}"
        )
    q = q.reshape(n, heads, hd)  # [n, H, hd]
    k = k.reshape(n, kvh, hd)  # [n, kvh, hd]
    if layer.qk_norm:
        q = rms_norm(q, p.comps["q_norm"], layer.rms_norm_eps)
        k = rms_norm(k, p.comps["k_norm"], layer.rms_norm_eps)
    cos, sin = rope_tables(hd, float(layer.rope_freq_base), layer.rope_scaling, cache.capacity)
    end = start + n
    q = rope_inplace(np.array(q, dtype=np.float32, order="C"), cos, sin, start)  # own copy
    cache.k[start:end] = k
    rope_inplace(cache.k[start:end], cos, sin, start)  # the cache rows are contiguous
    cache.v[start:end] = v.reshape(n, kvh, hd)
    if tile:
        attn = _attend_tiled(q, cache.k[:end], cache.v[:end], start, heads // kvh, tile)
    else:
        attn = _attend(q, cache.k[:end], cache.v[:end], start, heads // kvh)
    cache.length = end
    return attn.reshape(n, heads * hd)  # [n, H*hd]


def forward(layer, x: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
    """x [n, d] (or [d]) -> [n, d]; appends the n positions to the layer's KV cache."""
    squeeze = x.ndim == 1
    x2 = x.reshape(-1, layer.d_model)  # [n, d]
    cache = _cache(layer)
    if cache.length + x2.shape[0] > cache.capacity:
        raise ContextOverflowError(
            f"context overflow: {cache.length} cached + {x2.shape[0]} new tokens > "
            f"max_seq_len {cache.capacity}"
        )
    p = plan(layer)
    tile = layer.tile_size if layer.use_tiling and layer.tile_size > 0 else 0
    q, k, v = _project_qkv(p, x2, tile)
    attn = _append(layer, cache, p, q, k, v, tile)
    out = linear(attn, p.comps["w_o"], p.comps["b_o"], tile)  # [n, d]
    return out.reshape(-1) if squeeze else out


def forward_rows(layer, x: np.ndarray, caches: list) -> np.ndarray:
    """One new token per row of x [B, d], row b continuing its own KVCache caches[b] -> [B, d].
    Projections run once for all rows; attention runs per row on its own cache."""
    p = plan(layer)
    caches[:] = [cache_for(layer, c) for c in caches]
    q, k, v = _project_qkv(p, x, 0)
    attn = np.empty_like(q)  # [B, H*hd]
    for b, cache in enumerate(caches):
        attn[b] = _append(layer, cache, p, q[b : b + 1], k[b : b + 1], v[b : b + 1], 0)[0]
    return linear(attn, p.comps["w_o"], p.comps["b_o"])  # [B, d]

"""Multi-head attention: GQA/MQA, HF half-split RoPE, optional q/k RMSNorm, biases, causal,
with a preallocated KV cache that continues across calls. Dimension rules, parameter spec,
named views, plan and reference forward of the MHA layer kind."""

from __future__ import annotations

import mmap
from dataclasses import dataclass, fields

import numpy as np

from poly.errors import ContextOverflowError, LayerConfigError
from poly.layer import LayerKind, LayerType
from poly.nn.spec import Spec, carve, span
from poly.ops import HOOKS, dense_matmul, linear, rms_norm
from poly.rope import rope_inplace, rope_tables

MATRICES = frozenset({"w_q", "w_k", "w_v", "w_o"})


@dataclass
class MHAViews:
    w_q: np.ndarray  # [q, d]
    w_k: np.ndarray  # [kv, d]
    w_v: np.ndarray  # [kv, d]
    w_o: np.ndarray  # [d, q]
    b_q: np.ndarray
    b_k: np.ndarray
    b_v: np.ndarray
    b_o: np.ndarray
    q_norm: np.ndarray | None = None  # [head_dim]
    k_norm: np.ndarray | None = None  # [head_dim]

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def complete_dims(layer) -> None:
    """Fill head_dim, num_kv_heads, query_dim; reject contradictory dimensions."""
    if layer.d_model <= 0 or layer.num_heads <= 0:
        raise LayerConfigError("MHA needs d_model > 0 and num_heads > 0")
    if layer.head_dim <= 0:
        if layer.d_model % layer.num_heads:
            raise LayerConfigError("d_model must be divisible by num_heads without head_dim")
        layer.head_dim = layer.d_model // layer.num_heads
    layer.num_kv_heads = layer.num_kv_heads or layer.num_heads
    if layer.num_heads % layer.num_kv_heads:
        raise LayerConfigError("num_heads must be a multiple of num_kv_heads")
    if layer.head_dim % 2:
        raise LayerConfigError("head_dim must be even for rotary embeddings")
    expected_q = layer.num_heads * layer.head_dim
    if layer.query_dim and layer.query_dim != expected_q:
        raise LayerConfigError(f"query_dim {layer.query_dim} != num_heads*head_dim {expected_q}")
    layer.query_dim = expected_q
    if layer.max_seq_len <= 0:
        raise LayerConfigError("max_seq_len must be > 0")
    layer.input_height = layer.output_height = layer.d_model


def spec(layer) -> Spec:
    """[(role, shape)] in master order: W_Q, W_K, W_V, W_O, the four biases, q/k norms."""
    d, q, kv = layer.d_model, layer.query_dim, layer.num_kv_heads * layer.head_dim
    table = [("w_q", (q, d)), ("w_k", (kv, d)), ("w_v", (kv, d)), ("w_o", (d, q))]
    table += [("b_q", (q,)), ("b_k", (kv,)), ("b_v", (kv,)), ("b_o", (d,))]
    if layer.qk_norm:
        table += [("q_norm", (layer.head_dim,)), ("k_norm", (layer.head_dim,))]
    return table


def views(layer) -> MHAViews:
    return MHAViews(**carve(layer.weights.master, spec(layer)))


def components(layer) -> dict:
    store = layer.weights
    return store.versions[store.active] if store.active is not None else views(layer).as_dict()


def lazy_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Zeros whose pages exist only once written: a private anonymous mapping. np.zeros may take
    heap memory that calloc clears page by page (glibc raises its mmap threshold after a large
    free), which made a 2048-position SmolLM2 cache cost ~20 MB of RSS before any token."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if nbytes < (1 << 16) or not flags:  # small: one page or so either way
        return np.zeros(shape, dtype=dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=dtype).reshape(shape)


def release_pages(a: np.ndarray) -> None:
    """Give the pages of a `lazy_zeros` array back (they read as zeros again); others: no-op."""
    base = a.base
    while base is not None and not isinstance(base, mmap.mmap):
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    if isinstance(base, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        base.madvise(mmap.MADV_DONTNEED)


class KVCache:
    """Keys/values for positions [0, length), reserved for max_seq_len (no ring wrap); a page
    of the reservation costs memory once a position on it is written (`lazy_zeros`)."""

    def __init__(self, max_len: int, kv_heads: int, head_dim: int, dtype=np.float32):
        self.k = lazy_zeros((max_len, kv_heads, head_dim), dtype)  # [T, kvh, hd]
        self.v = lazy_zeros((max_len, kv_heads, head_dim), dtype)  # [T, kvh, hd]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[0]

    def reset(self) -> None:
        self.length = 0

    def truncate(self, n: int) -> None:
        self.length = max(0, min(self.length, n))


def kv_dtype(layer, dtype=np.float32) -> np.dtype:
    """What `layer`'s KV cache stores for activations of `dtype`: the layer's `kv_dtype`
    (float16 halves the bytes attention reads a position, like llama.cpp's default cache) for
    float32 activations; float64 activations keep float64."""
    dtype = np.dtype(dtype)
    return np.dtype(getattr(layer, "kv_dtype", dtype)) if dtype == np.float32 else dtype


def cache_for(layer, cache: KVCache | None, dtype=np.float32) -> KVCache:
    """`cache` if it fits `layer` (and holds what it stores for activations of `dtype`), else a
    new empty one (first use, max_seq_len, activation or cache dtype changed)."""
    store = kv_dtype(layer, dtype)
    if cache is None or cache.capacity != layer.max_seq_len or cache.k.dtype != store:
        return KVCache(layer.max_seq_len, layer.num_kv_heads, layer.head_dim, store)
    return cache


def live_cache(layer, dtype=np.float32) -> KVCache:
    """The layer's own KV cache (`layer.state`), created or refitted as needed."""
    layer.state = cache_for(layer, layer.state, dtype)
    return layer.state


class Plan:
    """What one forward reads, derived once per weight generation (not on every call)."""

    def __init__(self, layer):
        store = layer.weights
        self.comps = components(layer)
        q_dim, kv_dim, d = layer.query_dim, layer.num_kv_heads * layer.head_dim, layer.d_model
        self.splits = (q_dim, q_dim + kv_dim)
        self.w_qkv = self.b_qkv = None
        if store.active is None:
            # W_Q, W_K, W_V (and b_Q, b_K, b_V) sit back to back in the master: one projection.
            table = spec(layer)
            self.w_qkv = span(store.master, table, "w_q", "w_v").reshape(-1, d)  # [q+2kv, d]
            self.b_qkv = span(store.master, table, "b_q", "b_v")
        self.parts = [(self.comps[w], self.comps[b]) for w, b in QKV]
        self.width = q_dim + 2 * kv_dim


QKV = (("w_q", "b_q"), ("w_k", "b_k"), ("w_v", "b_v"))


def plan(layer) -> Plan:
    """The plan of `layer`, cached on its weight store until the weights change."""
    return layer.weights.plan("mha", lambda: Plan(layer))


def _project_qkv(p: Plan, x: np.ndarray, block_rows: int):
    """x [n, d] -> q [n, q], k [n, kv], v [n, kv] (views of one [n, q+2kv] buffer)."""
    if p.w_qkv is not None and not block_rows:
        if x.dtype == np.float64:
            qkv = linear(x, p.w_qkv, p.b_qkv)  # [n, q+2kv], weights upcast
        else:
            qkv = dense_matmul(x, p.w_qkv)  # [n, q+2kv]
            if p.b_qkv.any():  # most checkpoints have no q/k/v bias: skip the pass
                qkv += p.b_qkv
    else:
        qkv = np.empty((x.shape[0], p.width), dtype=x.dtype)  # [n, q+2kv]
        bounds = (0, *p.splits, p.width)
        for (w, bias), a, b in zip(p.parts, bounds[:-1], bounds[1:]):
            qkv[:, a:b] = linear(x, w, bias, block_rows)
    a, b = p.splits
    return qkv[:, :a], qkv[:, a:b], qkv[:, b:]


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, groups: int) -> np.ndarray:
    """q [n, H, hd] at positions start..start+n-1 over k/v [T, kvh, hd] -> [n, H, hd]."""
    hook = HOOKS["attend"]
    got = None if hook is None else hook(q, k, v, start, groups)
    if got is not None:
        return got
    n, heads, hd = q.shape
    kvh, t = k.shape[1], k.shape[0]
    # scaled q in one contiguous [kvh, g*n, hd] buffer: one GEMM per kv head, no stacked loops
    dt = q.dtype.type
    qg = np.empty((kvh, groups, n, hd), dtype=dt)  # [kvh, g, n, hd]
    np.multiply(q.reshape(n, kvh, groups, hd).transpose(1, 2, 0, 3), dt(1.0 / np.sqrt(hd)), out=qg)
    scores = qg.reshape(kvh, groups * n, hd) @ k.transpose(1, 2, 0)  # [kvh, g*n, T]
    scores = scores.reshape(kvh, groups, n, t)  # [kvh, g, n, T]
    if n > 1:  # causal: query i sees keys 0..start+i
        scores += np.triu(np.full((n, t), -np.inf, dtype=dt), k=start + 1)
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
    dt = q.dtype.type
    scale = dt(1.0 / np.sqrt(hd))
    m = np.full((kvh, groups, n, 1), -np.inf, dtype=dt)
    denom = np.zeros((kvh, groups, n, 1), dtype=dt)
    acc = np.zeros((kvh, groups, n, hd), dtype=dt)
    qpos = np.arange(start, start + n)[:, None]
    for k0 in range(0, t, block):
        kb = k[k0 : k0 + block].transpose(1, 2, 0)[:, None]  # [kvh, 1, hd, b]
        s = (qg @ kb) * scale  # [kvh, g, n, b]
        s[..., np.arange(k0, k0 + kb.shape[-1])[None, :] > qpos] = -np.inf
        m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
        alive = np.isfinite(m_new)  # rows with no visible key yet stay at zero
        p = np.exp(s - np.where(alive, m_new, 0))
        corr = np.where(alive, np.exp(np.where(alive, m - m_new, 0)), 1).astype(dt)
        denom = denom * corr + p.sum(axis=-1, keepdims=True)
        acc = acc * corr + p @ v[k0 : k0 + block].transpose(1, 0, 2)[:, None]
        m = m_new
    out = acc / denom
    return out.transpose(2, 0, 1, 3).reshape(n, heads, hd)  # [n, H, hd]


def _append(layer, cache: KVCache, p: Plan, q, k, v, tile: int) -> np.ndarray:
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
    dt = np.dtype(np.float64 if q.dtype == np.float64 else np.float32)
    scaling = layer.rope_scaling
    cos, sin = rope_tables(hd, float(layer.rope_freq_base), scaling, cache.capacity, dt.type)
    end = start + n
    q = rope_inplace(np.array(q, dtype=dt, order="C"), cos, sin, start)  # own copy
    # RoPE in the activation dtype, then stored (rounded to float16 by a float16 cache)
    cache.k[start:end] = rope_inplace(np.array(k, dtype=dt, order="C"), cos, sin, start)
    cache.v[start:end] = v.reshape(n, kvh, hd)
    keys, values = cache.k[:end], cache.v[:end]  # [end, kvh, hd]
    if keys.dtype != dt:  # a float16 cache: attention sums in the activation dtype
        keys, values = keys.astype(dt), values.astype(dt)
    if tile:
        attn = _attend_tiled(q, keys, values, start, heads // kvh, tile)
    else:
        attn = _attend(q, keys, values, start, heads // kvh)
    cache.length = end
    return attn.reshape(n, heads * hd)  # [n, H*hd]


def forward(layer, x: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
    """x [n, d] (or [d]) -> [n, d]; appends the n positions to the layer's KV cache."""
    squeeze = x.ndim == 1
    x2 = x.reshape(-1, layer.d_model)  # [n, d]
    cache = live_cache(layer, np.float64 if x2.dtype == np.float64 else np.float32)
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


def forward_rows(layer, x: np.ndarray, caches: list, bounds=None) -> np.ndarray:
    """Rows of x [N, d] from several sequences, segment b = rows bounds[b] = (start, stop)
    continuing its own KVCache caches[b] (default: one row each) -> [N, d]. Projections run
    once for all rows; attention runs per segment on its own cache."""
    p = plan(layer)
    dt = np.float64 if x.dtype == np.float64 else np.float32
    caches[:] = [cache_for(layer, c, dt) for c in caches]
    if bounds is None:
        bounds = [(b, b + 1) for b in range(len(caches))]
    q, k, v = _project_qkv(p, x, 0)
    attn = np.empty_like(q)  # [N, H*hd]
    for (a, b), cache in zip(bounds, caches):
        attn[a:b] = _append(layer, cache, p, q[a:b], k[a:b], v[a:b], 0)
    return linear(attn, p.comps["w_o"], p.comps["b_o"])  # [N, d]


KIND = LayerKind(LayerType.MHA, forward, complete_dims, spec, views, matrices=MATRICES)

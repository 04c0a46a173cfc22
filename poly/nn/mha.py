"""Multi-head attention: GQA/MQA, causal, biases, with a KV cache that continues across calls
(poly.nn.kvcache). Options, each a field of the layer (docs/layers.md):
  sliding_window   keys a query sees, itself included (0: all); its cache keeps the window only
  rotary_dim       RoPE over the first rotary_dim values of each head (0: all), half-split pairs
                   or, with rope_interleaved, GPT-J pairs (2i, 2i+1); use_rope False: NoPE
  qk_norm          q/k RMSNorm per head ([head_dim] weights) or, with qk_norm_all, over all
                   heads at once ([q_dim] / [kv_dim] weights); qk_norm_kind "layernorm" /
                   "layernorm_nobias": a LayerNorm per head (with q/k_norm_bias or without);
                   qk_norm_heads: each head its own weights ([q_dim] / [kv_dim])
  attn_scale       the logit scale (0: head_dim ** -0.5); attn_softcap: cap * tanh(logit / cap)
  attn_sinks       a learned logit per head in the softmax denominator ("sinks" [num_heads])
Dimension rules, parameter spec, named views, plan and reference forward of the MHA kind."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from poly.errors import ContextOverflowError, LayerConfigError
from poly.layer import LayerKind, LayerType
from poly.nn.kvcache import (  # noqa: F401 (the cache's names, as callers import them from here)
    KVCache,
    attention_rows,
    cache_for,
    kv_dtype,
    lazy_zeros,
    live_cache,
    release_pages,
)
from poly.nn.qknorm import qk_norm
from poly.nn.spec import Spec, carve, span
from poly.ops import HOOKS, dense_matmul, linear
from poly.rope import LENGTH_DEPENDENT_ROPE, rope_inplace, rope_rows, rope_tables

MATRICES = frozenset({"w_q", "w_k", "w_v", "w_o"})


@dataclass
class MHAViews:
    """An attention layer's projections, biases, q/k norms and sinks as named views into its
    master."""

    w_q: np.ndarray  # [q, d]
    w_k: np.ndarray  # [kv, d]
    w_v: np.ndarray  # [kv, d]
    w_o: np.ndarray  # [d, q]
    b_q: np.ndarray
    b_k: np.ndarray
    b_v: np.ndarray
    b_o: np.ndarray
    q_norm: np.ndarray | None = None  # [head_dim], or [q] with qk_norm_all
    k_norm: np.ndarray | None = None  # [head_dim], or [kv] with qk_norm_all
    sinks: np.ndarray | None = None  # [num_heads] with attn_sinks
    q_norm_bias: np.ndarray | None = None  # as q_norm, with qk_norm_kind "layernorm"
    k_norm_bias: np.ndarray | None = None  # as k_norm

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
    _check_options(layer)
    expected_q = layer.num_heads * layer.head_dim
    if layer.query_dim and layer.query_dim != expected_q:
        raise LayerConfigError(f"query_dim {layer.query_dim} != num_heads*head_dim {expected_q}")
    layer.query_dim = expected_q
    if layer.max_seq_len <= 0:
        raise LayerConfigError("max_seq_len must be > 0")
    layer.input_height = layer.output_height = layer.d_model


def rotary_dim(layer) -> int:
    """Values of each head RoPE rotates (0 for a NoPE layer)."""
    return (layer.rotary_dim or layer.head_dim) if layer.use_rope else 0


def _check_options(layer) -> None:
    for name in ("sliding_window", "rotary_dim"):
        value = getattr(layer, name)
        if type(value) is not int or value < 0:
            raise LayerConfigError(f"{name} must be an integer >= 0, got {value!r}")
    rot = rotary_dim(layer)
    if rot % 2 or rot > layer.head_dim:
        raise LayerConfigError(
            f"rotary_dim {rot} must be even and <= head_dim {layer.head_dim} (rotary embeddings)"
        )
    for name in ("attn_scale", "attn_softcap"):
        value = getattr(layer, name)
        if not (isinstance(value, (int, float)) and np.isfinite(value) and value >= 0):
            raise LayerConfigError(f"{name} must be a finite number >= 0, got {value!r}")
    rs = layer.rope_scaling
    if rot and rs is not None and rs.rope_type == "longrope":
        for name in ("short_factor", "long_factor"):
            if len(getattr(rs, name)) != rot // 2:
                raise LayerConfigError(
                    f"rope scaling {name} has {len(getattr(rs, name))} values, "
                    f"the rotary dims need {rot // 2}"
                )


def has_options(layer) -> bool:
    """Whether the layer uses an option the fused C step does not implement (the Python path
    runs it): a q/k norm other than RMSNorm or LayerNorm. (Per-head q/k norms of either kind
    run in it, as does a rope recomputed per call, dynamic or longrope:
    poly/runtime/fused_rope.py writes the call's rows of its tables; a q8_0 KV cache too:
    csrc/decode/kv_q8.h.)"""
    return bool(layer.qk_norm and layer.qk_norm_kind not in QK_NORM_FORMS)


# the C step's q/k norm kinds (csrc/decode/recipe_args.h qk_form bit 0)
QK_NORM_FORMS = {"rms": 0, "layernorm": 1, "layernorm_nobias": 1}


def qk_form(layer) -> int:
    """The C step's qk_form: bit 0 LayerNorm, bit 1 one weight row per head (0: RMSNorm with
    one shared weight, or none)."""
    if not layer.qk_norm:
        return 0
    return QK_NORM_FORMS[layer.qk_norm_kind] | (2 if layer.qk_norm_heads else 0)


def spec(layer) -> Spec:
    """[(role, shape)] in master order: W_Q, W_K, W_V, W_O, the four biases, q/k norms (with
    qk_norm; their biases after them with qk_norm_kind "layernorm"), sinks (with attn_sinks)."""
    d, q, kv = layer.d_model, layer.query_dim, layer.num_kv_heads * layer.head_dim
    table = [("w_q", (q, d)), ("w_k", (kv, d)), ("w_v", (kv, d)), ("w_o", (d, q))]
    table += [("b_q", (q,)), ("b_k", (kv,)), ("b_v", (kv,)), ("b_o", (d,))]
    if layer.qk_norm:
        wide = layer.qk_norm_all or layer.qk_norm_heads
        qn, kn = (q, kv) if wide else (layer.head_dim, layer.head_dim)
        table += [("q_norm", (qn,)), ("k_norm", (kn,))]
        if layer.qk_norm_kind == "layernorm":
            table += [("q_norm_bias", (qn,)), ("k_norm_bias", (kn,))]
    if layer.attn_sinks:
        table += [("sinks", (layer.num_heads,))]
    return table


def views(layer) -> MHAViews:
    return MHAViews(**carve(layer.weights.master, spec(layer)))


def components(layer) -> dict:
    store = layer.weights
    return store.versions[store.active] if store.active is not None else views(layer).as_dict()


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


@dataclass(frozen=True)
class Attn:
    """What the softmax of one layer applies beyond causal attention (see the module doc)."""

    scale: float
    window: int = 0
    softcap: float = 0.0
    sinks: np.ndarray | None = None  # [H]

    @property
    def plain(self) -> bool:
        return not (self.window or self.softcap or self.sinks is not None)


def _attend(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, groups: int,
    opts: Attn | None = None, first: int = 0,
) -> np.ndarray:  # fmt: skip
    """q [n, H, hd] at positions start..start+n-1 over k/v [T, kvh, hd] of positions
    first..first+T-1 -> [n, H, hd]."""
    n, heads, hd = q.shape
    default = 1.0 / np.sqrt(hd)
    hook = HOOKS["attend"]
    plain = opts is None or (opts.scale == default and (opts.plain or (n == 1 and opts.window)))
    got = None if hook is None or not plain else hook(q, k, v, start - first, groups)
    if got is not None:
        return got
    kvh, t = k.shape[1], k.shape[0]
    # scaled q in one contiguous [kvh, g*n, hd] buffer: one GEMM per kv head, no stacked loops
    dt = q.dtype.type
    qg = np.empty((kvh, groups, n, hd), dtype=dt)  # [kvh, g, n, hd]
    scale = default if opts is None else opts.scale
    np.multiply(q.reshape(n, kvh, groups, hd).transpose(1, 2, 0, 3), dt(scale), out=qg)
    scores = qg.reshape(kvh, groups * n, hd) @ k.transpose(1, 2, 0)  # [kvh, g*n, T]
    scores = scores.reshape(kvh, groups, n, t)  # [kvh, g, n, T]
    if opts is not None and opts.softcap:
        cap = dt(opts.softcap)
        np.tanh(scores / cap, out=scores)
        scores *= cap
    window = 0 if opts is None else opts.window
    if n > 1 or (window and first + t - 1 - window >= first):  # causal (and window) mask
        kpos = np.arange(first, first + t)[None, :]  # [1, T]
        qpos = np.arange(start, start + n)[:, None]  # [n, 1]
        hide = (kpos > qpos) | ((kpos <= qpos - window) if window else False)
        scores[..., hide] = -np.inf
    sinks = None if opts is None else opts.sinks
    if sinks is None:
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
    else:  # the sink is one more logit per head in the denominator, with no value
        sink = sinks.astype(dt).reshape(kvh, groups, 1, 1)
        top = np.maximum(scores.max(axis=-1, keepdims=True), sink)
        scores -= top
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True) + np.exp(sink - top)
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


def rope_seq(rs, cache: KVCache, end: int) -> int:
    """The length a call ending at position `end` (exclusive) computes a length-dependent rope's
    frequencies for, as transformers recomputes them; dynamic's grows with the longest length
    the cache has seen (cache.rope_len, updated here)."""
    seq, orig = end, rs.original_max_position_embeddings
    if rs.rope_type == "dynamic":
        seq = orig if end < orig else max(cache.rope_len or orig, end)
        cache.rope_len = seq
    return seq


def _rope(layer, cache: KVCache, q, k, start: int, dt):
    """Rotate q and k (own float copies [n, heads, hd]) for positions start.. in place."""
    rot, n = rotary_dim(layer), q.shape[0]
    if not rot:
        return q, k
    rs, theta = layer.rope_scaling, float(layer.rope_freq_base)
    if rs is not None and rs.rope_type in LENGTH_DEPENDENT_ROPE:
        seq = rope_seq(rs, cache, start + n)
        cos, sin = rope_rows(rot, theta, rs, start, n, seq, dt.type)
        at = 0
    else:
        cos, sin = rope_tables(rot, theta, rs, cache.capacity, dt.type)
        at = start
    for x in (q, k):
        rope_inplace(x, cos, sin, at, rot, layer.rope_interleaved)
    return q, k


def _softmax_opts(layer, p: Plan) -> Attn:
    return Attn(
        scale=float(layer.attn_scale or 1.0 / np.sqrt(layer.head_dim)),
        window=int(layer.sliding_window),
        softcap=float(layer.attn_softcap),
        sinks=p.comps["sinks"] if layer.attn_sinks else None,
    )


def _append(layer, cache: KVCache, p: Plan, q, k, v, tile: int) -> np.ndarray:
    """RoPE q/k at the cache position, append k/v, attend -> [n, H*hd]."""
    n, hd, heads, kvh = q.shape[0], layer.head_dim, layer.num_heads, layer.num_kv_heads
    start = cache.length
    if start + n > cache.capacity:
        raise ContextOverflowError(
            f"context overflow: {start} cached + {n} new tokens > max_seq_len {cache.capacity}"
        )
    q, k = qk_norm(layer, p.comps, q, k)
    dt = np.dtype(np.float64 if q.dtype == np.float64 else np.float32)
    q = np.array(q, dtype=dt, order="C")  # own copies, rotated in place
    k = np.array(k, dtype=dt, order="C")
    q, k = _rope(layer, cache, q, k, start, dt)
    # RoPE in the activation dtype, then stored (rounded to float16 by a float16 cache)
    keys, values, first = cache.append(k, v.reshape(n, kvh, hd))  # [T, kvh, hd]
    if keys.dtype != dt:  # a float16 cache: attention sums in float32, laid out by head
        keys, values = attention_rows(keys, values)
    opts = _softmax_opts(layer, p)
    if tile and first == 0 and opts.plain and opts.scale == 1.0 / np.sqrt(hd):
        attn = _attend_tiled(q, keys, values, start, heads // kvh, tile)
    else:
        attn = _attend(q, keys, values, start, heads // kvh, opts, first)
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

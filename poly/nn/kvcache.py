"""The KV cache of one attention layer and one sequence.

A full-attention layer's cache holds every position [0, length) in rows reserved for
max_seq_len (a page of the reservation costs memory once written, `lazy_zeros`). A sliding-window
layer's cache holds the last positions only, in rows bounded by its window: when the rows are
full the positions no later query can see are dropped (the kept ones move to the front), so a
context far longer than the window costs the window's memory.

A q8_0 cache (dtype int8, `Q8`) stores each run of 32 values of a head as int8 codes and one
float16 scale, as llama.cpp's q8_0 K/V cache does (8.5 bits a value against float16's 16):
`append` quantizes the new rows and hands attention the visible rows dequantized (the new
token's own key and value included, as llama.cpp reads them back).
"""

from __future__ import annotations

import mmap

import numpy as np

from poly.errors import ContextOverflowError, DTypeError, GenerationError
from poly.nn import scratch

Q8 = np.dtype(np.int8)  # the KV dtype of a q8_0 cache (codes int8 + a float16 scale per block)
Q8_BLOCK = 32  # values per scale (llama.cpp QK8_0)


def q8_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., hd] (hd a multiple of 32) -> codes int8 [..., hd], scales float16 [..., hd/32]:
    llama.cpp's quantize_row_q8_0 (d = amax / 127 rounded to float16, codes round(x / d) with
    the float32 d, halves away from zero)."""
    xb = np.asarray(x, dtype=np.float32).reshape(*x.shape[:-1], x.shape[-1] // Q8_BLOCK, Q8_BLOCK)
    d = np.abs(xb).max(axis=-1) / np.float32(127)  # [..., hd/32]
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    y = xb * inv[..., None]
    codes = np.trunc(y + np.copysign(np.float32(0.5), y)).astype(np.int8)
    return codes.reshape(x.shape), d.astype(np.float16)


def q8_dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """codes int8 [..., hd], scales float16 [..., hd/32] -> float32 [..., hd]."""
    out = np.empty((*codes.shape[:-1], codes.shape[-1] // Q8_BLOCK, Q8_BLOCK), dtype=np.float32)
    q8_dequantize_into(codes, scales, out)
    return out.reshape(codes.shape)


def q8_dequantize_into(codes: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
    """codes int8 [..., hd] times scales float16 [..., hd/32] into out, float32 [..., hd/32, 32]
    of any strides; the codes are cast as they are read (no float copy of them)."""
    np.multiply(codes.reshape(out.shape), scales.astype(np.float32)[..., None], out=out)


def by_head(t: int, kv_heads: int, head_dim: int, values: bool, block: int):
    """A float32 [t, kvh, hd] laid out a head at a time: keys [kvh, t, hd], values [kvh, hd, t]
    (transposed) in memory, as the prompt attention reads them (poly/runtime/attention.py: a
    head's keys and values are then views, not copies) -> (that array, the same memory viewed as
    [t, kvh, hd/block, block]: q8_0's blocks). Scratch memory: valid until the next call."""
    split = (head_dim // block, block)
    if values:
        mem = scratch.take("values", (kv_heads, *split, t))
        return mem.reshape(kv_heads, head_dim, t).transpose(2, 0, 1), mem.transpose(3, 0, 1, 2)
    mem = scratch.take("keys", (kv_heads, t, *split))
    return mem.reshape(kv_heads, t, head_dim).transpose(1, 0, 2), mem.transpose(1, 0, 2, 3)


def attention_rows(k: np.ndarray, v: np.ndarray, ks=None, vs=None) -> tuple[np.ndarray, np.ndarray]:
    """float32 keys and values [t, kvh, hd] laid out by head (`by_head`) from a float16 cache's
    rows, or a q8_0 cache's codes and scales (`ks`, `vs`)."""
    t, kvh, hd = k.shape
    out = []
    for rows, scales, values in ((k, ks, False), (v, vs, True)):
        x, blocks = by_head(t, kvh, hd, values, hd if scales is None else Q8_BLOCK)
        if scales is None:
            np.copyto(x, rows)  # float16 -> float32 as it is read
        else:
            q8_dequantize_into(rows, scales, blocks)
        out.append(x)
    return out[0], out[1]


def q8_rows(rows: int, kv_heads: int, head_dim: int) -> tuple[np.ndarray, ...]:
    """A q8_0 cache's rows: (rows int8 [rows, bytes], codes int8 [rows, kvh, hd], scales float16
    [rows, kvh, hd/32]), codes and scales views into one buffer whose row for a position holds its
    codes then its scales, so the fused C step reads a position at one place (csrc/decode/kv_q8.h)."""
    kvd = kv_heads * head_dim
    buf = lazy_zeros((rows, kvd + kvd // Q8_BLOCK * 2), Q8)
    codes = buf[:, :kvd].reshape(rows, kv_heads, head_dim)
    scales = buf[:, kvd:].view(np.float16).reshape(rows, kv_heads, head_dim // Q8_BLOCK)
    return buf, codes, scales


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


def window_rows(max_len: int, window: int) -> int:
    """Rows a cache keeps: max_len, or for a window W at most 2W + W/2 (W - 1 seen by the next
    query, W/2 more for a rollback, W of room before the next move)."""
    return max_len if window <= 0 else min(max_len, 2 * window + window // 2)


class KVCache:
    """Keys/values of positions [start, length) of one sequence in rows k/v [rows, kvh, hd]
    (row 0 holds position `start`; start is 0 for full attention). `capacity` is the context a
    sequence may reach (max_seq_len), `window` the layer's sliding window (0: none)."""

    def __init__(self, max_len: int, kv_heads: int, head_dim: int, dtype=np.float32, window=0):
        rows = window_rows(max_len, window)
        self.ks = self.vs = self.kb = self.vb = None  # q8_0 only (q8_rows)
        if np.dtype(dtype) == Q8:
            if head_dim % Q8_BLOCK:
                raise DTypeError(f"a q8_0 KV cache needs head_dim a multiple of 32, not {head_dim}")
            self.kb, self.k, self.ks = q8_rows(rows, kv_heads, head_dim)
            self.vb, self.v, self.vs = q8_rows(rows, kv_heads, head_dim)
        else:
            self.k = lazy_zeros((rows, kv_heads, head_dim), dtype)  # [rows, kvh, hd]
            self.v = lazy_zeros((rows, kv_heads, head_dim), dtype)  # [rows, kvh, hd]
        self.max_len, self.window = int(max_len), int(window)
        self.length = 0
        self.start = 0  # the position of row 0
        self.rope_len = 0  # dynamic rope: the longest length seen (transformers' cached length)

    @property
    def capacity(self) -> int:
        return self.max_len

    @property
    def sliding(self) -> bool:
        """Whether positions ever leave the rows (a window shorter than the context)."""
        return self.k.shape[0] < self.max_len

    def reset(self) -> None:
        self.length = self.start = self.rope_len = 0

    def truncate(self, n: int) -> None:
        """Forget positions >= n. GenerationError when a query at n would need a position this
        sliding-window cache has already dropped (the caller runs the prefix again)."""
        n = max(0, min(self.length, n))
        if n < self.length and self.start > max(0, n - self.window + 1):
            raise GenerationError(
                f"cannot roll the sliding-window KV cache back to {n}: positions before "
                f"{self.start} are dropped"
            )
        self.length = n

    def clone(self, length: int | None = None) -> KVCache:
        """An independent copy holding positions up to `length` (default: all)."""
        n = self.length if length is None else length
        out = KVCache(self.max_len, self.k.shape[1], self.k.shape[2], self.k.dtype, self.window)
        self.truncate_check(n)
        rows = n - self.start
        for name in self.arrays():
            getattr(out, name)[:rows] = getattr(self, name)[:rows]
        out.length, out.start, out.rope_len = n, self.start, self.rope_len
        return out

    def truncate_check(self, n: int) -> None:
        if n > self.length or (n < self.length and self.start > max(0, n - self.window + 1)):
            raise GenerationError(f"the KV cache does not hold the positions up to {n}")

    def arrays(self) -> tuple[str, ...]:
        """The names of the row arrays: k, v (and the q8_0 scales ks, vs)."""
        return ("k", "v") if self.ks is None else ("k", "v", "ks", "vs")

    def _rows(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys/values of rows a..b-1 as attention reads them (q8_0: dequantized)."""
        if self.ks is None:
            return self.k[a:b], self.v[a:b]
        return attention_rows(self.k[a:b], self.v[a:b], self.ks[a:b], self.vs[a:b])

    def _put(self, a: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store k/v [n, kvh, hd] at rows a..a+n-1 (q8_0: quantized)."""
        n = k.shape[0]
        if self.ks is None:
            self.k[a : a + n], self.v[a : a + n] = k, v
            return
        (self.k[a : a + n], self.ks[a : a + n]) = q8_quantize(k)
        (self.v[a : a + n], self.vs[a : a + n]) = q8_quantize(v)

    def make_room(self, n: int) -> int | None:
        """Move the rows as `append` would so that positions length..length+n-1 get rows, for a
        writer that stores them itself (the fused C step) -> the position of row 0 (`start`), or
        None when n rows do not fit beside what the new queries see (nothing moved)."""
        start = self.length
        if start + n > self.max_len:
            raise ContextOverflowError(
                f"context overflow: {start} cached + {n} new tokens > max_seq_len {self.max_len}"
            )
        rows = self.k.shape[0]
        if start + n - self.start > rows:
            keep_from = max(self.start, start - self.window + 1 - self.window // 2)
            kept = start - keep_from
            if kept + n > rows:
                return None
            a = keep_from - self.start  # overlapping rows: numpy copies through a buffer
            for name in self.arrays():
                arr = getattr(self, name)
                arr[:kept] = arr[a : a + kept]
            self.start = keep_from
        return self.start

    def append(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """Store k/v [n, kvh, hd] at positions length..length+n-1 -> (keys, values, first): the
        keys/values of positions first..length+n-1, every one the new queries may see."""
        n, start = k.shape[0], self.length
        end = start + n
        if end > self.max_len:
            raise ContextOverflowError(
                f"context overflow: {start} cached + {n} new tokens > max_seq_len {self.max_len}"
            )
        rows = self.k.shape[0]
        first = max(self.start, start - self.window + 1) if self.window else 0
        if end - self.start > rows:  # full: drop what no new query sees, keep a rollback margin
            keep_from = max(self.start, start - self.window + 1 - self.window // 2)
            kept = start - keep_from
            if kept + n > rows:  # a chunk longer than the rows: attend over a copy, keep the end
                return self._append_long(k, v, first)
            a = keep_from - self.start
            for name in self.arrays():
                arr = getattr(self, name)
                arr[:kept] = arr[a : a + kept]
            self.start = keep_from
        a = start - self.start
        self._put(a, k, v)
        self.length = end
        keys, values = self._rows(first - self.start, a + n)
        return keys, values, first

    def _append_long(self, k, v, first):
        a, n = first - self.start, k.shape[0]
        if self.ks is not None:  # the new rows as a q8_0 cache gives them back
            k, v = (q8_dequantize(*q8_quantize(x)) for x in (k, v))
        old_k, old_v = self._rows(a, self.length - self.start)
        keys = np.concatenate([old_k, k.astype(old_k.dtype)])
        values = np.concatenate([old_v, v.astype(old_v.dtype)])
        rows = self.k.shape[0]
        keep = min(len(keys), rows - self.window)  # room for a window of new rows after them
        self._put(0, keys[-keep:], values[-keep:])
        self.length += n
        self.start = self.length - keep
        return keys, values, first


def kv_dtype(layer, dtype=np.float32) -> np.dtype:
    """What `layer`'s KV cache stores for activations of `dtype`: the layer's `kv_dtype`
    (float16 halves the bytes attention reads a position, like llama.cpp's default cache; int8:
    q8_0 blocks) for float32 activations; float64 activations keep float64."""
    dtype = np.dtype(dtype)
    return np.dtype(getattr(layer, "kv_dtype", dtype)) if dtype == np.float32 else dtype


def cache_for(layer, cache: KVCache | None, dtype=np.float32) -> KVCache:
    """`cache` if it fits `layer` (and holds what it stores for activations of `dtype`), else a
    new empty one (first use, max_seq_len, window, activation or cache dtype changed)."""
    store = kv_dtype(layer, dtype)
    window = getattr(layer, "sliding_window", 0)
    if (
        cache is None
        or cache.capacity != layer.max_seq_len
        or cache.window != window
        or cache.k.dtype != store
    ):
        return KVCache(layer.max_seq_len, layer.num_kv_heads, layer.head_dim, store, window)
    return cache


def live_cache(layer, dtype=np.float32) -> KVCache:
    """The layer's own KV cache (`layer.state`), created or refitted as needed."""
    layer.state = cache_for(layer, layer.state, dtype)
    return layer.state

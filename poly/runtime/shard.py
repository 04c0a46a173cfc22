"""Tensor-parallel partition rules and the slicing of every matrix form by rows or columns.

Column-parallel matrices (Q/K/V, gate/up, the LM head) keep whole rows: any row range of any
form is a view (float arrays, GGUF blocks, Loom Q4 with whole-block rows, per-row coded kinds).
Row-parallel matrices (O, down) keep a range of columns: a cut must fall on the form's block
boundary (32 or 256 weights for GGUF kinds, 32 for Loom Q4, the bytes of a packed sub-byte
kind), and the kept columns are copied out (rows of other ranks are never read). A form without
such a cut is dequantized for the kept columns only (exact values, float32 memory).
"""

from __future__ import annotations

import dataclasses
import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

from poly.errors import TensorParallelError


@dataclass(frozen=True)
class Split:
    """What rank `rank` of `size` keeps: [start, stop) ranges of query heads, KV heads, the
    intermediate dimension and vocabulary rows (all ranks' vocab counts for the gather)."""

    rank: int
    size: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    inter: tuple[int, int]
    vocab: tuple[int, int]
    vocab_counts: tuple[int, ...]


def head_ranges(heads: int, kv: int, size: int, rank: int) -> tuple[tuple, tuple]:
    """(query heads, KV heads) of one rank: whole KV groups (each with its query heads), as even
    as the group count allows; with more ranks than KV heads, `size` must be a multiple of the KV
    head count and each KV head is replicated on size/kv ranks that split its query heads."""
    per = heads // kv  # query heads per KV group
    if size <= kv:
        g0, g1 = kv * rank // size, kv * (rank + 1) // size
        return (g0 * per, g1 * per), (g0, g1)
    if size % kv:
        raise TensorParallelError(
            f"{size} ranks cannot share {kv} KV heads: use a rank count that divides {kv} "
            f"or a multiple of {kv}"
        )
    rep = size // kv
    if per < rep:
        raise TensorParallelError(
            f"{heads} query heads over {kv} KV heads give {per} per KV head, fewer than the "
            f"{rep} ranks that would share each KV head ({size} ranks)"
        )
    g, j = divmod(rank, rep)
    return (g * per + per * j // rep, g * per + per * (j + 1) // rep), (g, g + 1)


def balanced_inter(cfg, size: int, grain: int) -> list[int]:
    """Intermediate-dimension boundaries (size + 1 of them, in whole grains) that even out each
    rank's weights per block when the KV groups split unevenly (SmolLM2 at TP = 2: 2 + 1
    groups): the rank with fewer heads takes more FFN rows. Decode streams every weight once
    per token, so equal weights are equal work and equal memory."""
    h, hd, total = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    block_rows = total // grain
    if block_rows < size:
        raise TensorParallelError(
            f"intermediate size {total} holds {block_rows} blocks of {grain}: too few for {size} ranks"
        )
    attn = []
    for r in range(size):
        (h0, h1), (k0, k1) = head_ranges(cfg.num_heads, cfg.num_kv_heads, size, r)
        attn.append(2 * h * hd * ((h1 - h0) + (k1 - k0)))  # q + o, k + v weights
    per_row = 3 * h  # gate, up, down
    target = (sum(attn) + total * per_row) / size
    bounds, acc = [0], 0.0
    for r in range(size - 1):
        acc += max(0.0, (target - attn[r]) / per_row)
        b = round(acc / grain)
        b = min(max(b, bounds[-1] + 1), block_rows - (size - 1 - r))  # >= 1 block per rank
        bounds.append(b)
    bounds.append(block_rows)
    return [b * grain for b in bounds]


def make_split(cfg, size: int, rank: int, inter_grain: int) -> Split:
    """The split of a TransformerConfig over `size` ranks (errors name the numbers)."""
    if not 0 <= rank < size:
        raise TensorParallelError(f"rank {rank} outside 0..{size - 1}")
    heads, kv = head_ranges(cfg.num_heads, cfg.num_kv_heads, size, rank)
    bounds = balanced_inter(cfg, size, inter_grain)
    inter = (bounds[rank], bounds[rank + 1])
    v = cfg.vocab_size
    counts = tuple(v * (r + 1) // size - v * r // size for r in range(size))
    return Split(rank, size, heads, kv, inter, (v * rank // size, v * (rank + 1) // size), counts)


def qk_norm_share(comm, cfg):
    """`qk_norm_share` of a q/k norm over all heads (poly.nn.mha): local sums of squares [n, 2]
    -> mean squares over every head. A KV head held by r ranks (more ranks than KV heads) is
    counted r times in the sum, so each holder adds 1/r of it."""
    widths = np.array([cfg.num_heads, cfg.num_kv_heads], np.float64) * cfg.head_dim
    holders = comm.size // cfg.num_kv_heads if comm.size > cfg.num_kv_heads else 1

    def share(sums: np.ndarray) -> np.ndarray:
        if holders > 1:
            sums[:, 1] /= holders
        comm.allreduce(sums)
        return sums / widths.astype(sums.dtype)

    return share


# --- slicing the matrix forms ----------------------------------------------------------------


def col_grain(w: Any) -> int:
    """Columns of `w` that must stay together (its block): 1 for plain float arrays."""
    from poly.quant.qtensor import CodedMatrix, GGUFMatrix, Q4Matrix

    if isinstance(w, GGUFMatrix):
        from poly.quant.ggml import QUANT_SIZES

        return int(QUANT_SIZES[w.ggml_type][0])
    if isinstance(w, Q4Matrix):
        return 32
    if isinstance(w, CodedMatrix):
        codes = w.encoded.codes
        return w.shape[1] // codes.shape[1] if codes.ndim == 2 and codes.shape[1] else 1
    return 1


def rows(w: Any, a: int, b: int) -> Any:
    """Rows [a, b) of a matrix form, a view where the form allows it."""
    from poly.quant.qtensor import CodedMatrix, DenseMatrix, GGUFMatrix, Q4Matrix

    if isinstance(w, np.ndarray):
        return w[a:b]
    k = w.shape[1]
    if isinstance(w, DenseMatrix):
        return DenseMatrix(w.array[a:b])
    if isinstance(w, GGUFMatrix):
        return GGUFMatrix(w.raw[a:b], w.ggml_type, (b - a, k))
    if isinstance(w, Q4Matrix) and k % 32 == 0:
        nb = k // 32
        return Q4Matrix(w.scales[a * nb : b * nb], w.packed[a * nb : b * nb], (b - a, k))
    if isinstance(w, CodedMatrix) and _per_row(w):
        return CodedMatrix(_sub(w.encoded, slice(a, b), slice(None), (b - a, k)))
    return DenseMatrix(np.ascontiguousarray(w.dequantize(a, b), dtype=np.float32))


def cols(w: Any, a: int, b: int) -> Any:
    """Columns [a, b) of a matrix form as a new contiguous matrix (cut on block boundaries)."""
    from poly.quant.qtensor import CodedMatrix, DenseMatrix, GGUFMatrix, Q4Matrix

    if isinstance(w, np.ndarray):
        return np.ascontiguousarray(w[:, a:b])
    m, grain = w.shape[0], col_grain(w)
    if a % grain or b % grain:
        raise TensorParallelError(
            f"{w.scheme} matrix {w.shape}: a cut at columns [{a}, {b}) splits its {grain}-weight "
            "blocks (use a rank count that keeps whole blocks)"
        )
    if isinstance(w, DenseMatrix):
        return DenseMatrix(np.ascontiguousarray(w.array[:, a:b]))
    if isinstance(w, GGUFMatrix):
        ts = w.raw.shape[1] // (w.shape[1] // grain)  # bytes per block
        raw = np.ascontiguousarray(w.raw[:, a // grain * ts : b // grain * ts])
        return GGUFMatrix(raw, w.ggml_type, (m, b - a))
    if isinstance(w, Q4Matrix) and w.shape[1] % 32 == 0:
        nb = w.shape[1] // 32
        sc = np.ascontiguousarray(w.scales.reshape(m, nb)[:, a // 32 : b // 32]).reshape(-1)
        pk = np.ascontiguousarray(w.packed.reshape(m, nb, 16)[:, a // 32 : b // 32])
        return Q4Matrix(sc, pk.reshape(-1, 16), (m, b - a))
    if isinstance(w, CodedMatrix) and _per_row(w):
        sub = _sub(w.encoded, slice(None), slice(a // grain, b // grain), (m, b - a))
        return CodedMatrix(dataclasses.replace(sub, codes=np.ascontiguousarray(sub.codes)))
    out = np.empty((m, b - a), dtype=np.float32)
    for r in range(0, m, 256):  # dequantize a row block at a time, keep the columns
        out[r : r + 256] = w.dequantize(r, min(m, r + 256))[:, a:b]
    return DenseMatrix(out)


def _per_row(w) -> bool:
    """A CodedMatrix whose codes are [rows, bytes] with one scale (and zero) per row."""
    e = w.encoded
    return (
        e.codes.ndim == 2
        and e.codes.shape[0] == w.shape[0]
        and all(p is None or p.shape == (w.shape[0],) for p in (e.scales, e.zero))
    )


def _sub(e, rsel: slice, csel: slice, shape: tuple[int, int]):
    def part(p):
        return None if p is None else p[rsel]

    return dataclasses.replace(
        e, shape=shape, codes=e.codes[rsel, csel], scales=part(e.scales), zero=part(e.zero)
    )


# --- file pages ------------------------------------------------------------------------------


def mapping_of(a: Any) -> mmap.mmap | None:
    """The mmap a (memmap) array view reads, if any."""
    seen = 0
    while a is not None and seen < 64:
        if isinstance(a, mmap.mmap):
            return a
        a = getattr(a, "base", None) if not isinstance(a, memoryview) else a.obj
        seen += 1
    return None


def arrays_of(w: Any) -> list[np.ndarray]:
    """The numpy arrays a matrix form or vector holds."""
    if w is None:
        return []
    if isinstance(w, np.ndarray):
        return [w]
    out = []
    for name in ("array", "raw", "scales", "packed"):
        v = getattr(w, name, None)
        if isinstance(v, np.ndarray):
            out.append(v)
    enc = getattr(w, "encoded", None)
    if enc is not None:
        out += [p for p in (enc.codes, enc.scales, enc.zero) if p is not None]
    return out


def drop_pages(maps: list[mmap.mmap]) -> None:
    """Forget the resident pages of read-only file mappings (they stay in the page cache and
    fault back in on the next read): a rank that had to read past its own slices (a row-parallel
    matrix's kept columns cross every page of it) does not keep them in its RSS."""
    for mm in maps:
        try:
            if hasattr(mm, "release"):  # a poly.filesnapshot.FileSnapshot: the file's pages back
                mm.release(0, len(mm))
                continue
            if not memoryview(mm).readonly:
                continue  # anonymous or writable memory: DONTNEED would zero it
            mm.madvise(mmap.MADV_DONTNEED)
        except (AttributeError, OSError, ValueError):
            pass

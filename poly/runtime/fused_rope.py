"""Length-dependent rope (dynamic NTK, longrope) in the fused step: its frequencies depend on
the length a call reaches (transformers recomputes them per call), so no table made once holds
them. Each such layer's C tuple carries its own cos/sin tables [max_seq_len, rot/2] (zeros,
committed page by page as positions are written), and before every call the rows of the
positions that call writes are filled with the values the reference path (poly.nn.mha._rope)
computes for them: the C step reads only those rows (csrc/decode/kv.h rope_append)."""

from __future__ import annotations

import numpy as np

from poly.nn import mha
from poly.rope import LENGTH_DEPENDENT_ROPE, rope_frequencies


def is_length_dependent(attn) -> bool:
    rs = attn.rope_scaling
    return bool(mha.rotary_dim(attn)) and rs is not None and rs.rope_type in LENGTH_DEPENDENT_ROPE


def own_tables(attn) -> tuple[np.ndarray, np.ndarray]:
    """Zeroed float32 cos, sin [max_seq_len, rot/2] for one layer's C tuple."""
    shape = (attn.max_seq_len, mha.rotary_dim(attn) // 2)
    return np.zeros(shape, np.float32), np.zeros(shape, np.float32)


def records(attn_layers, layer_tuples) -> list[tuple]:
    """(block index, rope scaling, rot, theta, cos, sin) of each length-dependent layer (its C
    tuple's items 8 and 9 are the tables)."""
    out = []
    for li, (a, t) in enumerate(zip(attn_layers, layer_tuples)):
        if is_length_dependent(a):
            out.append((li, a.rope_scaling, mha.rotary_dim(a), float(a.rope_freq_base), t[8], t[9]))
    return out


def paged_seq(rs, end: int) -> int:
    """mha.rope_seq for a paged row (no cache object: a sequence's lengths only grow)."""
    orig = rs.original_max_position_embeddings
    return orig if rs.rope_type == "dynamic" and end < orig else end


def fill(recs: list[tuple], rows, pos, ends) -> bool:
    """Write the rows `pos` of every record's tables for a call: row i (caches rows[i], one per
    block, or None when paged) at position pos[i] of a call that reaches ends[i]. False when two
    rows at one position need different values (the reference path then runs)."""
    memo: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    for li, rs, rot, theta, cos, sin in recs:
        want: dict[int, int] = {}  # position -> seq
        for r, at, end in zip(rows, pos, ends):
            seq = paged_seq(rs, end) if r is None else mha.rope_seq(rs, r[li], end)
            if want.setdefault(at, seq) != seq:
                return False
        by_seq: dict[int, list[int]] = {}
        for at, seq in want.items():
            by_seq.setdefault(seq, []).append(at)
        for seq, ats in by_seq.items():
            key = (rot, theta, rs, seq, tuple(ats))
            if key not in memo:  # as poly.rope.rope_rows: float64 angles, then float32
                inv, attention = rope_frequencies(rot, theta, rs, seq)
                angles = np.asarray(ats, dtype=np.float64)[:, None] * inv[None, :]
                memo[key] = (
                    (np.cos(angles) * attention).astype(np.float32),
                    (np.sin(angles) * attention).astype(np.float32),
                )
            cos[ats], sin[ats] = memo[key]
    return True


def call(plan, rows: list, pos, keys: list, end: int = 0) -> bool:
    """fill for one fused call of a poly.runtime.fused.Plan (over its blocks: crossover's plans
    hold a prefix of them): the rows with one key (their caches list, or page table) are one
    sequence's, whose call reaches its largest position + 1 (or `end`). False when the
    reference path must run."""
    if not plan.lrope:
        return True
    last: dict[int, int] = {}
    for k, at in zip(keys, pos):
        last[id(k)] = max(last.get(id(k), end - 1), at)
    ends = [last[id(k)] + 1 for k in keys]
    return fill([r for r in plan.lrope if r[0] < len(plan.attn)], rows, pos, ends)

"""Importance-weighted quantizers that write GGUF's own block layouts.

Each block's scale (and min) is searched to minimise Σ weight·(w - ŵ)², the weight being the
importance matrix (mean squared activation of the input channel, `poly.model.imatrix`) times
sqrt(σ² + w²) as llama.cpp's quantize_row_*_impl weigh it: rounding error lands where the
activations are small. The blocks are byte-compatible with ggml's (gguf-py's dequantize reads
them, tests/test_weighted_quant.py), so the C kernels that run a GGUF's blocks run these.
Vectorised over all blocks of a row chunk; a llama.cpp-like search, not a bit-exact copy.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from poly.errors import UsageError
from poly.quant.ggml import QUANT_SIZES, GGMLType

__all__ = ["WEIGHTED_TYPES", "quantize", "weighted_error", "row_bytes"]

_T = GGMLType
IQ4_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32
)
_CHUNK = 1 << 18  # elements per row chunk: bounds the [rows, blocks, 32] temporaries


class _Grid:
    """Sorted code values of a block kind; `index` finds the nearest."""

    def __init__(self, values: np.ndarray):
        self.values = np.asarray(values, np.float32)
        self.uniform = bool(np.all(np.diff(self.values) == 1))
        mids = (self.values[1:] + self.values[:-1]) / 2
        # integer grids (IQ4_NL's): nearest code of each rounded value by a 256-entry table
        self.lut = np.searchsorted(mids, np.arange(-128, 128, dtype=np.float32))

    def index(self, v: np.ndarray) -> np.ndarray:
        if self.uniform:
            lo, n = self.values[0], len(self.values)
            return np.clip(np.rint(v) - lo, 0, n - 1).astype(np.int64)
        return self.lut[np.clip(np.rint(v), -128, 127).astype(np.int64) + 128]


_Q4 = _Grid(np.arange(-8, 8))
_Q5 = _Grid(np.arange(-16, 16))
_Q6 = _Grid(np.arange(-32, 32))
_Q8 = _Grid(np.arange(-127, 128))
_IQ4 = _Grid(IQ4_VALUES)


def _safe(a: np.ndarray) -> np.ndarray:
    return np.where(a != 0, a, 1.0)


def _signed_max(x: np.ndarray) -> np.ndarray:
    """Per block (last axis) the value of largest magnitude, sign kept."""
    i = np.argmax(np.abs(x), axis=-1)
    return np.take_along_axis(x, i[..., None], axis=-1)[..., 0]


def _best_scale(x, w, grid: _Grid, nmax: float, steps: Iterable[float]) -> np.ndarray:
    """Scale d per block (rows of x) maximising (Σwqx)²/Σwq² over inverse scales
    -(nmax + s)/max (llama.cpp's make_qx_quants and the IQ4_NL search)."""
    mx = _safe(_signed_max(x))
    best = np.full(x.shape[0], -1.0, np.float32)
    d = np.zeros(x.shape[0], np.float32)
    for s in steps:
        q = grid.values[grid.index(x * (-(nmax + s) / mx)[:, None])]
        sqx = np.einsum("ij,ij,ij->i", w, q, x)
        sq2 = np.einsum("ij,ij,ij->i", w, q, q)
        score = np.where(sq2 > 0, sqx * sqx / _safe(sq2), -1.0)
        better = score > best
        d = np.where(better, sqx / _safe(sq2), d)
        best = np.maximum(best, score)
    return _refit(x, w, grid, d)


def _refit(x, w, grid: _Grid, d: np.ndarray, rounds: int = 6) -> np.ndarray:
    """Alternate the nearest codes for d and the weighted least-squares d for those codes,
    keeping a block's new d only where Σw(x - dq)² fell: the search's pick, polished."""

    def fit(d):
        q = grid.values[_codes(x, d, grid)]
        err = np.einsum("ij,ij->i", w, np.square(x - d[:, None] * q))
        sqx, sq2 = np.einsum("ij,ij,ij->i", w, q, x), np.einsum("ij,ij,ij->i", w, q, q)
        return err, np.where(sq2 > 0, sqx / _safe(sq2), d).astype(np.float32)

    err, nxt = fit(d)
    for _ in range(rounds):
        e, after = fit(nxt)
        better = e < err
        d, err = np.where(better, nxt, d), np.where(better, e, err)
        nxt = np.where(better, after, d)
    return d


def _f16(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    h = np.asarray(a, np.float32).astype(np.float16)
    return h, h.astype(np.float32)


def _codes(x, d, grid: _Grid) -> np.ndarray:
    """Nearest code indices of x [B, n] under per-block scale d [B] (0 where d = 0)."""
    idx = grid.index(x / _safe(d)[:, None])
    zero = grid.index(np.zeros(1, np.float32))[0]
    return np.where((d != 0)[:, None], idx, zero)


def _nibbles(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return (lo.astype(np.uint8) & 15) | ((hi.astype(np.uint8) & 15) << 4)


def _high_bits(lev: np.ndarray) -> np.ndarray:
    """Bit 4 of each of a block's 32 codes as GGUF's little-endian uint32 qh [B, 4]."""
    bits = ((lev >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    return np.bitwise_or.reduce(bits, axis=1).astype("<u4")[:, None].view(np.uint8)


# --- 32-element blocks: Q4_0, Q5_0, Q8_0, IQ4_NL -----------------------------------------------------


def _sym32(x, w, kind):
    """x, w [B, 32] -> (bytes [B, type_size], dequantized [B, 32])."""
    grid, nmax, steps = {
        _T.Q4_0: (_Q4, 8, np.arange(-9, 10) * 0.1),
        _T.Q5_0: (_Q5, 16, np.arange(-9, 10) * 0.1),
        _T.Q8_0: (_Q8, 127, np.arange(-3, 4) * 0.25),
        _T.IQ4_NL: (_IQ4, 127, np.arange(-7, 8) * 1.0),
    }[kind]
    dh, d = _f16(_best_scale(x, w, grid, nmax, steps))
    idx = _codes(x, d, grid)  # [B, 32]
    deq = d[:, None] * grid.values[idx]
    head = dh[:, None].view(np.uint8)  # [B, 2]
    if kind == _T.Q8_0:
        body = (idx - 127).astype(np.int8).view(np.uint8)
    elif kind == _T.Q5_0:
        body = np.concatenate([_high_bits(idx), _nibbles(idx[:, :16], idx[:, 16:])], axis=1)
    else:  # Q4_0 and IQ4_NL: element j low nibble, j + 16 high
        body = _nibbles(idx[:, :16], idx[:, 16:])
    return np.concatenate([head, body], axis=1), deq


# --- 256-element super-blocks: Q6_K, Q4_K, Q5_K -----------------------------------------------------


def _q6_k(x, w):
    """x, w [B, 256] -> Q6_K blocks [B, 210]: 16 sub-blocks of 16, int8 sub-scales."""
    b = x.shape[0]
    xs, ws = x.reshape(-1, 16), w.reshape(-1, 16)
    sub = _best_scale(xs, ws, _Q6, 32, np.arange(-9, 10) * 0.1).reshape(b, 16)
    dh, d = _f16(_signed_max(sub) / -128.0)
    sc = np.clip(np.rint(sub / _safe(d)[:, None]), -128, 127)  # [B, 16]
    eff = (d[:, None] * sc).reshape(-1)
    idx = _codes(xs, eff, _Q6).reshape(b, 256)  # 0..63 = code + 32
    deq = (eff[:, None] * _Q6.values[idx.reshape(-1, 16)]).reshape(b, 256)
    ql = np.empty((b, 128), np.uint8)
    qh = np.empty((b, 64), np.uint8)
    for h in range(2):  # two halves of 128 elements
        L = idx[:, 128 * h : 128 * h + 128]
        ql[:, 64 * h : 64 * h + 32] = _nibbles(L[:, 0:32], L[:, 64:96])
        ql[:, 64 * h + 32 : 64 * h + 64] = _nibbles(L[:, 32:64], L[:, 96:128])
        hi = [(L[:, 32 * k : 32 * k + 32] >> 4).astype(np.uint8) << (2 * k) for k in range(4)]
        qh[:, 32 * h : 32 * h + 32] = hi[0] | hi[1] | hi[2] | hi[3]
    scales = sc.astype(np.int8).view(np.uint8)
    return np.concatenate([ql, qh, scales, dh[:, None].view(np.uint8)], axis=1), deq


def _affine_search(x, w, nmax: int):
    """llama.cpp's make_qkx3_quants over rows of x [N, n]: (scale, -min) per row, min <= 0."""
    mn = np.minimum(x.min(axis=1), 0.0)
    rng = x.max(axis=1) - mn
    live = rng > 0
    rng = np.where(live, rng, 1.0)
    sw, sx = w.sum(axis=1), np.einsum("ij,ij->i", w, x)
    best_s, best_m = rng / nmax, mn.copy()
    lev = np.clip(np.rint((x - mn[:, None]) / best_s[:, None]), 0, nmax)
    best = np.einsum("ij,ij->i", w, (best_s[:, None] * lev + mn[:, None] - x) ** 2)
    for k in range(37):
        lev = np.clip(
            np.rint((x - mn[:, None]) * ((nmax - 0.9 + 0.05 * k) / rng)[:, None]), 0, nmax
        )
        sl, sl2 = np.einsum("ij,ij->i", w, lev), np.einsum("ij,ij,ij->i", w, lev, lev)
        sxl = np.einsum("ij,ij,ij->i", w, lev, x)
        det = sw * sl2 - sl * sl
        ok = det > 0
        s = (sw * sxl - sx * sl) / _safe(det)
        m = (sl2 * sx - sl * sxl) / _safe(det)
        pos = m > 0  # the min must stay <= 0: refit the scale alone
        s = np.where(pos, sxl / _safe(sl2), s)
        m = np.where(pos, 0.0, m)
        err = np.einsum("ij,ij->i", w, (s[:, None] * lev + m[:, None] - x) ** 2)
        better = ok & (err < best)
        best_s, best_m, best = (
            np.where(better, a, b) for a, b in ((s, best_s), (m, best_m), (err, best))
        )
    return np.where(live, best_s, 0.0), np.where(live, -best_m, -mn)


def _qp(v, sw, nmax: int = 63):
    """llama.cpp's make_qp_quants: 6-bit codes of non-negative v [B, 8] weighted by sw."""
    mx = v.max(axis=1)
    live = mx > 1e-15
    mx = np.where(live, mx, 1.0)
    inv = nmax / mx
    best = np.einsum("ij,ij->i", sw, (v - np.rint(v * inv[:, None]) / inv[:, None]) ** 2)
    for k in (-4, -3, -2, -1, 1, 2, 3, 4):
        cand = (nmax + 0.1 * k) / mx
        lev = np.minimum(np.rint(v * cand[:, None]), nmax)
        err = np.einsum("ij,ij->i", sw, (v - lev / cand[:, None]) ** 2)
        inv = np.where(err < best, cand, inv)
        best = np.minimum(err, best)
    lev = np.minimum(np.rint(v * inv[:, None]), nmax)
    slx, sl2 = np.einsum("ij,ij,ij->i", sw, v, lev), np.einsum("ij,ij,ij->i", sw, lev, lev)
    d = np.where(live & (sl2 > 0), slx / _safe(sl2), 0.0)
    return d, np.where(live[:, None], lev, 0).astype(np.uint8)


def _pack_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins -> ggml's 12-byte get_scale_min_k4 layout."""
    out = np.zeros((ls.shape[0], 12), np.uint8)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 15) | ((lm[:, 4:8] & 15) << 4)
    return out


def _qk_affine(x, w, kind):
    """x, w [B, 256] -> Q4_K [B, 144] or Q5_K [B, 176] blocks."""
    b, nmax = x.shape[0], 15 if kind == _T.Q4_K else 31
    xs, ws = x.reshape(-1, 32), w.reshape(-1, 32)
    scale, mins = (a.reshape(b, 8) for a in _affine_search(xs, ws, nmax))
    sw = ws.sum(axis=1).reshape(b, 8)
    (dh, d), ls = (lambda r: (_f16(r[0]), r[1]))(_qp(scale, sw))
    (mh, m), lm = (lambda r: (_f16(r[0]), r[1]))(_qp(mins, sw))
    eff = (d[:, None] * ls).reshape(-1)
    off = (m[:, None] * lm).reshape(-1)
    lev = np.clip(np.rint((xs + off[:, None]) / _safe(eff)[:, None]), 0, nmax)
    lev = np.where((eff != 0)[:, None], lev, 0).astype(np.uint8)
    deq = (eff[:, None] * lev - off[:, None]).reshape(b, 256)
    L = lev.reshape(b, 256)
    qs = np.concatenate(
        [_nibbles(L[:, 64 * c : 64 * c + 32], L[:, 64 * c + 32 : 64 * c + 64]) for c in range(4)],
        axis=1,
    )
    parts = [dh[:, None].view(np.uint8), mh[:, None].view(np.uint8), _pack_scales(ls, lm)]
    if kind == _T.Q5_K:
        qh = np.zeros((b, 32), np.uint8)
        for c in range(4):
            qh |= ((L[:, 64 * c : 64 * c + 32] >> 4) << (2 * c)).astype(np.uint8)
            qh |= ((L[:, 64 * c + 32 : 64 * c + 64] >> 4) << (2 * c + 1)).astype(np.uint8)
        parts.append(qh)
    return np.concatenate([*parts, qs], axis=1), deq


def _affine32(x, w, kind):
    """x, w [B, 32] -> Q4_1 [B, 20] or Q5_1 [B, 24] blocks: f16 scale and min, 4- or 5-bit
    codes (the min <= 0)."""
    nmax = 15 if kind == _T.Q4_1 else 31
    scale, neg_min = _affine_search(x, w, nmax)
    dh, d = _f16(scale)
    mh, m = _f16(-neg_min)
    lev = np.clip(np.rint((x - m[:, None]) / _safe(d)[:, None]), 0, nmax)
    lev = np.where((d != 0)[:, None], lev, 0).astype(np.uint8)
    deq = d[:, None] * lev + m[:, None]
    parts = [dh[:, None].view(np.uint8), mh[:, None].view(np.uint8)]
    if kind == _T.Q5_1:
        parts.append(_high_bits(lev))
    return np.concatenate([*parts, _nibbles(lev[:, :16], lev[:, 16:])], axis=1), deq


# --- the entry points ----------------------------------------------------------------------------

WEIGHTED_TYPES = (_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0, _T.IQ4_NL, _T.Q4_K, _T.Q5_K, _T.Q6_K)


def row_bytes(kind: GGMLType, n_in: int) -> int:
    block, size = QUANT_SIZES[kind]
    return n_in // block * size


def _weights(x: np.ndarray, qw: np.ndarray, kind: GGMLType, block: int) -> np.ndarray:
    """Per-element weights [rows, n]: importance × sqrt(σ² + x²) (Q6_K: importance alone)."""
    if kind == _T.Q6_K:
        return np.broadcast_to(qw, x.shape)
    n = block if kind in (_T.Q4_K, _T.Q5_K, _T.IQ4_NL) else x.shape[1]
    sig = (x.reshape(x.shape[0], -1, n) ** 2).mean(axis=2) * (2.0 if n == block else 1.0)
    sig = np.repeat(sig, n, axis=1)  # [rows, n]
    return qw * np.sqrt(sig + x * x)


def _quantize_rows(x: np.ndarray, qw: np.ndarray, kind: GGMLType):
    block, _ = QUANT_SIZES[kind]
    w = _weights(x, qw, kind, block).reshape(-1, block).astype(np.float32)
    xb = x.reshape(-1, block)
    if kind == _T.Q6_K:
        raw, deq = _q6_k(xb, w)
    elif kind in (_T.Q4_K, _T.Q5_K):
        raw, deq = _qk_affine(xb, w, kind)
    elif kind in (_T.Q4_1, _T.Q5_1):
        raw, deq = _affine32(xb, w, kind)
    else:
        raw, deq = _sym32(xb, w, kind)
    return raw.reshape(x.shape[0], -1), deq.reshape(x.shape).astype(np.float32)


def quantize(w, kind, imatrix: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """float32 w [out, in] -> (GGUF block rows uint8 [out, row_bytes], dequantized float32)."""
    kind = GGMLType(int(kind))
    if kind not in WEIGHTED_TYPES:
        raise UsageError(f"no weighted quantizer for {kind.name}")
    w = np.asarray(w, np.float32)
    out_dim, n_in = w.shape
    if n_in % QUANT_SIZES[kind][0]:
        raise UsageError(f"row length {n_in} is not a multiple of the {kind.name} block")
    qw = np.ones(n_in, np.float32) if imatrix is None else np.asarray(imatrix, np.float32)
    qw = np.maximum(qw, 1e-10 * max(float(qw.max(initial=0.0)), 1e-30))  # no zero-weight block
    raw = np.empty((out_dim, row_bytes(kind, n_in)), np.uint8)
    deq = np.empty_like(w)
    step = max(1, _CHUNK // n_in)
    for a in range(0, out_dim, step):
        raw[a : a + step], deq[a : a + step] = _quantize_rows(w[a : a + step], qw, kind)
    return raw, deq


def weighted_error(w: np.ndarray, deq: np.ndarray, imatrix: np.ndarray | None) -> float:
    """Σ_rows Σ_i imatrix_i (w - ŵ)²: the expected squared output error E‖(W - Ŵ)x‖² for
    inputs with uncorrelated channels of mean square imatrix."""
    err = np.square(np.asarray(w, np.float32) - deq).sum(axis=0, dtype=np.float64)  # [in]
    return float(err.sum() if imatrix is None else err @ np.asarray(imatrix, np.float64))

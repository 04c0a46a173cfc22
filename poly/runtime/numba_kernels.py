"""The numba kernels of poly.runtime.kernels (imported only when the numba backend is chosen:
numba costs ~64 MB). Each computes out [n, m] = x [n, k] @ W.T reading W in its stored form.

Compiled with fastmath={"reassoc", "contract"} only: that lets LLVM vectorize the dot-product
reductions the way BLAS does (sums in a different order, FMA), while NaN/Inf still propagate.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

CHUNK = 16  # output rows decoded per parallel work item

FASTMATH = {"reassoc", "contract"}
OPTS = {"parallel": True, "fastmath": FASTMATH, "cache": True, "nogil": True}


def half_table() -> np.ndarray:
    return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


HALF = half_table()  # float16 bit pattern -> float32, for block scales


@njit(inline="always", fastmath=FASTMATH)
def dot_rows(vals, x, out, r):
    # float64 accumulation: the result then sits within BLAS's own rounding of the exact sum
    n, k = x.shape
    for i in range(n):
        acc = 0.0
        for j in range(k):
            acc += np.float64(vals[j]) * np.float64(x[i, j])
        out[i, r] = acc


@njit(**OPTS)
def mm_f32(x, w, out):
    """x [n, k] @ w [m, k].T -> out [n, m], w float32."""
    m = w.shape[0]
    for c in prange((m + CHUNK - 1) // CHUNK):
        for r in range(c * CHUNK, min(m, (c + 1) * CHUNK)):
            dot_rows(w[r], x, out, r)


@njit(**OPTS)
def mm_f16(x, bits, out):
    """w stored as float16 bit patterns uint16 [m, k]; exact widening in three passes."""
    m, k = bits.shape
    for c in prange((m + CHUNK - 1) // CHUNK):
        ub = np.empty(k, np.uint32)
        vals = ub.view(np.float32)
        for r in range(c * CHUNK, min(m, (c + 1) * CHUNK)):
            for j in range(k):  # exponent/mantissa moved into float32 position
                ub[j] = (np.uint32(bits[r, j]) & np.uint32(0x7FFF)) << np.uint32(13)
            for j in range(k):  # rebias the exponent by 2**112 (subnormals come out right)
                vals[j] *= np.float32(5.192296858534828e33)
            for j in range(k):  # sign, and inf/nan get the all-ones exponent
                h = np.uint32(bits[r, j])
                top = np.uint32(0x7F800000) if (h & np.uint32(0x7FFF)) >= 0x7C00 else 0
                ub[j] |= ((h & np.uint32(0x8000)) << np.uint32(16)) | np.uint32(top)
            dot_rows(vals, x, out, r)


# Inner block loops take their trip count (16 or 32) as an argument: a compile-time constant
# makes LLVM unroll them fully and then fail to vectorize; a runtime count vectorizes.


@njit(**OPTS)
def mm_i8(x, codes, scales, out, _bs):
    """Per-row int8: w[r, j] = codes[r, j] * scales[r]."""
    n, k = x.shape
    for r in prange(codes.shape[0]):
        row = codes[r]
        for i in range(n):
            xi = x[i]
            acc = np.float32(0.0)
            for j in range(k):
                acc += np.float32(row[j]) * xi[j]
            out[i, r] = acc * scales[r]


@njit(inline="always")
def half_bits(raw, off, table):
    return table[np.int32(raw[off]) | (np.int32(raw[off + 1]) << 8)]


@njit(inline="always")
def nib_dot(q, xl, xh, signed, half):
    """sum lo(q[j]) * xl[j] + hi(q[j]) * xh[j] over a 16-byte nibble block."""
    s = np.float32(0.0)
    for j in range(half):
        t = np.int32(q[j])
        lo, hi = t & 15, t >> 4
        if signed:  # 4-bit two's complement (Loom)
            lo, hi = (lo ^ 8) - 8, (hi ^ 8) - 8
        s += np.float32(lo) * xl[j] + np.float32(hi) * xh[j]
    return s


@njit(**OPTS)
def mm_q4loom(xp, scales, packed, out, half):
    """Loom Q4, rows of whole blocks; xp = x with each 32-block reordered [even16, odd16]."""
    n, k = xp.shape
    bpr = k // 32
    for r in prange(out.shape[1]):
        for i in range(n):
            acc = np.float32(0.0)
            for b in range(bpr):
                xb = xp[i, b * 32 : b * 32 + 32]
                s = nib_dot(packed[r * bpr + b], xb[:16], xb[16:], True, half)
                acc += scales[r * bpr + b] * s
            out[i, r] = acc


@njit(**OPTS)
def mm_gguf_q4(x, xs, raw, table, out, half, bsize, has_min):
    """GGUF Q4_0 (18-byte blocks: f16 d, (nibble - 8) * d) and Q4_1 (20 bytes: f16 d, f16 m,
    nibble * d + m); low nibble = element j, high = j + 16. xs [n, nb] = block sums of x."""
    n, k = x.shape
    for r in prange(raw.shape[0]):
        row = raw[r]
        for i in range(n):
            acc = np.float32(0.0)
            for b in range(k // 32):
                off = b * bsize
                q = row[off + bsize - 16 : off + bsize]
                xb = x[i, b * 32 : b * 32 + 32]
                s = nib_dot(q, xb[:16], xb[16:], False, half)
                d = half_bits(row, off, table)
                if has_min:
                    acc += d * s + half_bits(row, off + 2, table) * xs[i, b]
                else:
                    acc += d * (s - np.float32(8.0) * xs[i, b])
            out[i, r] = acc


@njit(**OPTS)
def mm_gguf_q8_0(x, raw, codes, table, out, full):
    """GGUF Q8_0 blocks of 34 bytes: f16 d, 32 int8 (codes = raw viewed as int8)."""
    n, k = x.shape
    for r in prange(raw.shape[0]):
        for i in range(n):
            acc = np.float32(0.0)
            for b in range(k // 32):
                off = b * 34
                q = codes[r, off + 2 : off + 34]
                xb = x[i, b * 32 : b * 32 + 32]
                s = np.float32(0.0)
                for j in range(full):
                    s += np.float32(q[j]) * xb[j]
                acc += half_bits(raw[r], off, table) * s
            out[i, r] = acc

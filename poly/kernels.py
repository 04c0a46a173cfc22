"""Compiled matrix-vector kernels (C extension or numba) and the CPU thread policy.

Each kernel computes out [n, m] = x [n, k] @ W.T for a small number of input rows n (decode
steps, batched decode, short prompts) and reads W in its stored form: float32/float16 arrays,
int8 per-row codes, Loom's Q4 bake, GGUF Q4_0/Q4_1/Q8_0 blocks (the C backend also bfloat16,
GGUF Q4_K/Q6_K). The loop over output rows runs in parallel threads. More than `SMALL_N` input
rows take the numpy path (dequantize row blocks + BLAS sgemm), which is faster for prefill.

Backends: "numpy" (the reference: `QTensor._matmul`), "c" (poly._ckernels from
csrc/poly_kernels.c, see poly/ckernels.py), "numba" (the kernels below, compiled on first
selection: numba is imported only then), "auto" (c if built, else numba if installed, else
numpy). Choose with `set_backend()` or the POLY_BACKEND environment variable. Threads:
`set_num_threads(n)` sets the C/OpenMP count, numba's pool (if loaded) and the BLAS pool
together (default: the physical core count, or POLY_NUM_THREADS).

The numba kernels are compiled with fastmath={"reassoc", "contract"} only: that lets LLVM
vectorize the dot-product reductions the way BLAS does (sums in a different order, FMA), while
NaN/Inf still propagate (no nnan/ninf assumptions).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable

import numpy as np

from poly import ckernels
from poly.errors import UsageError

SMALL_N = 16  # input rows up to which the matvec kernels beat dequantize + sgemm
C_DENSE_MAX_N = 16  # float32 rows up to which the C kernel beats BLAS (see dense_matmul)
CHUNK = 16  # output rows decoded per parallel work item
BACKENDS = ("auto", "numpy", "c", "numba")

HAVE_NUMBA = importlib.util.find_spec("numba") is not None  # the optional [fast] extra
HAVE_C = ckernels.AVAILABLE  # poly._ckernels, built at install when a C compiler exists
_NUMBA_NAMES = frozenset(
    {"HALF", "mm_f32", "mm_f16", "mm_i8", "mm_q4loom", "mm_gguf_q4", "mm_gguf_q8_0"}
)

_state = {"backend": "numpy", "threads": 0}


def physical_cores() -> int:
    """Physical cores available to this process (hyper-threads share a core's FMA units)."""
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except ImportError:
        n = None
    avail = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(n or avail or 1, avail or 1))


def set_num_threads(n: int | None = None) -> int:
    """Threads for the C/numba kernels and the BLAS pool; None/0 = physical cores. Returns n."""
    n = int(n or os.environ.get("POLY_NUM_THREADS") or physical_cores())
    if n < 1:
        raise UsageError(f"thread count must be >= 1, got {n}")
    ckernels.set_num_threads(n)
    if "mm_f32" in globals():  # numba loaded: never import it just to set its pool
        numba = sys.modules["numba"]
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(n, user_api="blas")
    except ImportError:
        pass  # without threadpoolctl BLAS keeps its own default (OPENBLAS_NUM_THREADS)
    _state["threads"] = n
    return n


def num_threads() -> int:
    return _state["threads"]


def backend() -> str:
    """The backend now in force ("numpy" or "numba")."""
    return _state["backend"]


def _compile_numba() -> None:
    """Define the numba kernels as module globals (imports numba: ~64 MB, so only on demand)."""
    global HALF, _dot_rows, mm_f32, mm_f16, mm_i8
    global _half, _nib_dot, mm_q4loom, mm_gguf_q4, mm_gguf_q8_0
    from numba import njit, prange

    _FM = {"reassoc", "contract"}
    _opts = {"parallel": True, "fastmath": _FM, "cache": True, "nogil": True}

    def _half_table() -> np.ndarray:
        return (
            np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
        )

    HALF = _half_table()  # float16 bit pattern -> float32, for block scales

    @njit(inline="always", fastmath=_FM)
    def _dot_rows(vals, x, out, r):
        # float64 accumulation: the result then sits within BLAS's own rounding of the exact sum
        n, k = x.shape
        for i in range(n):
            acc = 0.0
            for j in range(k):
                acc += np.float64(vals[j]) * np.float64(x[i, j])
            out[i, r] = acc

    @njit(**_opts)
    def mm_f32(x, w, out):
        """x [n, k] @ w [m, k].T -> out [n, m], w float32."""
        m = w.shape[0]
        for c in prange((m + CHUNK - 1) // CHUNK):
            for r in range(c * CHUNK, min(m, (c + 1) * CHUNK)):
                _dot_rows(w[r], x, out, r)

    @njit(**_opts)
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
                _dot_rows(vals, x, out, r)

    # Inner block loops take their trip count (16 or 32) as an argument: a compile-time constant
    # makes LLVM unroll them fully and then fail to vectorize; a runtime count vectorizes.

    @njit(**_opts)
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
    def _half(raw, off, table):
        return table[np.int32(raw[off]) | (np.int32(raw[off + 1]) << 8)]

    @njit(inline="always")
    def _nib_dot(q, xl, xh, signed, half):
        """sum lo(q[j]) * xl[j] + hi(q[j]) * xh[j] over a 16-byte nibble block."""
        s = np.float32(0.0)
        for j in range(half):
            t = np.int32(q[j])
            lo, hi = t & 15, t >> 4
            if signed:  # 4-bit two's complement (Loom)
                lo, hi = (lo ^ 8) - 8, (hi ^ 8) - 8
            s += np.float32(lo) * xl[j] + np.float32(hi) * xh[j]
        return s

    @njit(**_opts)
    def mm_q4loom(xp, scales, packed, out, half):
        """Loom Q4, rows of whole blocks; xp = x with each 32-block reordered [even16, odd16]."""
        n, k = xp.shape
        bpr = k // 32
        for r in prange(out.shape[1]):
            for i in range(n):
                acc = np.float32(0.0)
                for b in range(bpr):
                    xb = xp[i, b * 32 : b * 32 + 32]
                    s = _nib_dot(packed[r * bpr + b], xb[:16], xb[16:], True, half)
                    acc += scales[r * bpr + b] * s
                out[i, r] = acc

    @njit(**_opts)
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
                    s = _nib_dot(q, xb[:16], xb[16:], False, half)
                    d = _half(row, off, table)
                    if has_min:
                        acc += d * s + _half(row, off + 2, table) * xs[i, b]
                    else:
                        acc += d * (s - np.float32(8.0) * xs[i, b])
                out[i, r] = acc

    @njit(**_opts)
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
                    acc += _half(raw[r], off, table) * s
                out[i, r] = acc


# --- adapters: QTensor -> kernel call; None means "not for this one, use numpy" ---------------


def _dense(qt, x, out) -> bool:
    a = getattr(qt, "array", None)  # CodedMatrix also names its schemes "float16", ...
    if a is None or not a.flags.c_contiguous:
        return False
    if a.dtype == np.float32:
        mm_f32(x, a, out)
    elif a.dtype == np.float16:
        mm_f16(x, a.view(np.uint16), out)
    else:
        return False
    return True


def _int8(qt, x, out) -> bool:
    enc = getattr(qt, "encoded", None)
    if (
        enc is None
        or enc.codes.dtype != np.int8
        or enc.scales is None
        or enc.scales.dtype != np.float32
    ):
        return False
    mm_i8(x, enc.codes.reshape(qt.shape), enc.scales.reshape(-1), out, 32)
    return True


def _q4loom(qt, x, out) -> bool:
    n, k = x.shape
    if k % 32 or not hasattr(qt, "packed"):
        return False  # blocks straddle rows: numpy path
    xp = x.reshape(n, k // 32, 16, 2).transpose(0, 1, 3, 2).reshape(n, k)  # [n, k] even|odd
    mm_q4loom(np.ascontiguousarray(xp), qt.scales, qt.packed, out, 16)
    return True


def _block_sums(x: np.ndarray) -> np.ndarray:
    return x.reshape(x.shape[0], -1, 32).sum(axis=2, dtype=np.float32)  # [n, k/32]


def _q4_0(qt, x, out) -> bool:
    if not hasattr(qt, "raw"):
        return False
    mm_gguf_q4(x, _block_sums(x), qt.raw, HALF, out, 16, 18, False)
    return True


def _q4_1(qt, x, out) -> bool:
    if not hasattr(qt, "raw"):
        return False
    mm_gguf_q4(x, _block_sums(x), qt.raw, HALF, out, 16, 20, True)
    return True


def _q8_0(qt, x, out) -> bool:
    if not hasattr(qt, "raw"):
        return False
    mm_gguf_q8_0(x, qt.raw, qt.raw.view(np.int8), HALF, out, 32)
    return True


def _adapters() -> dict[str, Callable]:
    return {
        "float32": _dense,
        "float16": _dense,
        "int8": _int8,
        "q4_0": _q4loom,
        "gguf_q4_1": _q4_1,
        "gguf_q4_0": _q4_0,
        "gguf_q8_0": _q8_0,
    }


def _kernel(adapter: Callable) -> Callable:
    def kernel(qt, x2: np.ndarray, res: np.ndarray) -> None:
        if x2.shape[0] > SMALL_N or not adapter(qt, x2, res):
            qt._matmul(x2, res)

    kernel.__name__ = f"numba_{getattr(adapter, '__name__', 'kernel')}"
    return kernel


def dense_matmul(x: np.ndarray, w: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x [n, k] @ w.T for a float32 w [m, k]. One row: BLAS sgemv (measured fastest: SmolLM2 f32
    decode 37.9 tok/s vs 25.1 with the C kernel). 2..C_DENSE_MAX_N rows under the C backend:
    the C kernel, which streams each weight row once for all rows (OpenBLAS packs the whole
    weight for a small-m sgemm: B=4 lm_head 15 ms vs 5 ms). numba when chosen explicitly."""
    if out is None:
        out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    chosen, n = _state["backend"], x.shape[0]
    small = w.flags.c_contiguous and x.flags.c_contiguous
    if chosen == "c" and 2 <= n <= C_DENSE_MAX_N and small and ckernels.dense_matmul(x, w, out):
        return out
    if chosen == "numba" and n <= SMALL_N and small:
        mm_f32(x, w, out)
    else:
        np.matmul(x, w.T, out=out)
    return out


def _resolve(name: str) -> str:
    if name == "auto":
        return "c" if HAVE_C else ("numba" if HAVE_NUMBA else "numpy")
    if name == "numba" and not HAVE_NUMBA:
        raise UsageError("backend 'numba' needs the numba package (pip install poly[fast])")
    if name == "c" and not HAVE_C:
        raise UsageError(
            "backend 'c' needs the compiled extension poly._ckernels (reinstall with gcc)"
        )
    return name


def set_backend(name: str | None = None) -> str:
    """Select "auto" | "numpy" | "c" | "numba" (None: $POLY_BACKEND or "auto"); returns the one used."""
    from poly import qtensor

    name = (name or os.environ.get("POLY_BACKEND") or "auto").strip().lower()
    if name not in BACKENDS:
        raise UsageError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    chosen = _resolve(name)
    for scheme in {*_adapters(), *ckernels.SCHEMES}:
        qtensor.KERNELS.pop(scheme, None)
    if chosen == "numba":
        _load_numba()
        for scheme, adapter in _adapters().items():
            qtensor.KERNELS[scheme] = _kernel(adapter)
    elif chosen == "c":
        for scheme in ckernels.SCHEMES:
            if scheme != "float32":  # float32 matrices: dense_matmul (BLAS, or C for 2..16 rows)
                qtensor.KERNELS[scheme] = ckernels.kernel
    _state["backend"] = chosen
    return chosen


def _load_numba() -> None:
    if "mm_f32" not in globals():
        _compile_numba()
        set_num_threads(_state["threads"] or None)


def __getattr__(name: str):
    """The numba kernels (mm_f32, ...) compile on first access."""
    if name in _NUMBA_NAMES and HAVE_NUMBA:
        _load_numba()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


set_num_threads()
set_backend()

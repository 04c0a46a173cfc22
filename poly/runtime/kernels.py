"""Compiled matrix-vector kernels (C extension or numba) and the CPU thread policy.

Each kernel computes out [n, m] = x [n, k] @ W.T for a small number of input rows n (decode
steps, batched decode, short prompts) and reads W in its stored form: float32/float16 arrays,
int8 per-row codes, Loom's Q4 bake, GGUF Q4_0/Q4_1/Q8_0 blocks (the C backend also bfloat16,
GGUF Q4_K/Q6_K). The loop over output rows runs in parallel threads. More than `SMALL_N` input
rows take the numpy path (dequantize row blocks + BLAS sgemm), which is faster for prefill.

Backends: "numpy" (the reference: `QTensor.matmul_reference`), "c" (poly.runtime.native.ckernels from
csrc/matmul/entry.h, see poly/ckernels.py), "numba" (the kernels below, compiled on first
selection: numba is imported only then), "auto" (c if built, else numba if installed, else
numpy). Choose with `set_backend()` or the POLY_BACKEND environment variable. Threads:
`set_num_threads(n)` sets the C/OpenMP count, numba's pool (if loaded) and the BLAS pool
together (default: the physical core count, or POLY_NUM_THREADS).

The numba kernels are compiled with fastmath={"reassoc", "contract"} only: that lets LLVM
vectorize the dot-product reductions the way BLAS does (sums in a different order, FMA), while
NaN/Inf still propagate (no nnan/ninf assumptions).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from poly import openblas, ops
from poly.errors import UsageError
from poly.quant import qtensor
from poly.quant.schemes import SCHEMES
from poly.runtime import attention, ckernels, experts
from poly.weights import Generations

SMALL_N = 16  # input rows up to which the matvec kernels beat dequantize + sgemm
BACKENDS = ("auto", "numpy", "c", "numba")

HAVE_NUMBA = importlib.util.find_spec("numba") is not None  # the optional [fast] extra
HAVE_C = (
    ckernels.AVAILABLE
)  # poly.runtime.native.ckernels, built at install when a C compiler exists
_NUMBA_NAMES = frozenset(
    {"HALF", "mm_f32", "mm_f16", "mm_i8", "mm_q4loom", "mm_gguf_q4", "mm_gguf_q8_0"}
)

# blas: the BLAS pools' thread count as last set (None: not known)
_state = {"backend": "numpy", "threads": 0, "blas": 1 if openblas.ONE_THREAD else None}
NUMBA: Any = None  # poly.runtime.numba_kernels once the numba backend was chosen


def _sysfs_cores() -> int:
    """Distinct core sibling lists in Linux sysfs (0 if none): psutil's own first method for
    cpu_count(logical=False), read here so that no start pays for importing psutil."""
    base = "/sys/devices/system/cpu/cpu[0-9]*/topology/"
    paths = glob.glob(base + "core_cpus_list") or glob.glob(base + "thread_siblings_list")
    lists = set()
    for path in paths:
        with open(path, "rb") as fh:
            lists.add(fh.read().strip())
    return len(lists)


def physical_cores() -> int:
    """Physical cores available to this process (hyper-threads share a core's FMA units)."""
    n = _sysfs_cores() if sys.platform.startswith("linux") else 0
    if not n:
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
    _set_blas(blas_threads(n))
    _state["threads"] = n
    return n


def num_threads() -> int:
    return _state["threads"]


_BLAS: list = []  # threadpoolctl's BLAS controllers, found once


def use_threads(n: int) -> None:
    """Run the next C passes and BLAS calls on `n` threads without changing the configured
    count (`num_threads`); cheap enough to call per block (the prefill tuner does). The C
    count only under the C backend (the numpy backend reaches no C function)."""
    if _state["backend"] == "c":
        ckernels.set_num_threads(n)
    _set_blas(blas_threads(n))


def _set_blas(n: int) -> None:
    """The BLAS pools at n threads. threadpoolctl is imported only to change the count: numpy's
    OpenBLAS starts at one where poly loads it (`poly.openblas`), as the C backend wants."""
    if _state["blas"] == n:
        return
    if not _BLAS:
        try:
            from threadpoolctl import ThreadpoolController

            _BLAS.extend(ThreadpoolController().select(user_api="blas").lib_controllers)
        except ImportError:
            _BLAS.append(None)  # without threadpoolctl BLAS keeps its own count
    for lib in _BLAS:
        if lib is not None:
            lib.set_num_threads(n)
    _state["blas"] = n


def blas_threads(n: int) -> int:
    """BLAS threads for a count of n: one under the C backend. Its OpenMP workers spin after
    every C pass, and a BLAS call that wakes a second pthread then waits for a scheduler tick
    (measured: a 128x64 @ 64x64 product took 8 ms instead of 0.03 after a 2-thread C pass on a
    2-core machine). Under the C backend the large products run in the C gemm; BLAS keeps the
    attention products of a prefill."""
    return 1 if _state["backend"] == "c" else n


def backend() -> str:
    """The backend now in force ("numpy" or "numba")."""
    return _state["backend"]


# --- adapters: QTensor -> kernel call; None means "not for this one, use numpy" ---------------


def _dense(qt, x, out) -> bool:
    a = getattr(qt, "array", None)  # CodedMatrix also names its schemes "float16", ...
    if a is None or not a.flags.c_contiguous:
        return False
    if a.dtype == np.float32:
        NUMBA.mm_f32(x, a, out)
    elif a.dtype == np.float16:
        NUMBA.mm_f16(x, a.view(np.uint16), out)
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
    NUMBA.mm_i8(x, enc.codes.reshape(qt.shape), enc.scales.reshape(-1), out, 32)
    return True


def _q4loom(qt, x, out) -> bool:
    n, k = x.shape
    if k % 32 or not hasattr(qt, "packed"):
        return False  # blocks straddle rows: numpy path
    xp = x.reshape(n, k // 32, 16, 2).transpose(0, 1, 3, 2).reshape(n, k)  # [n, k] even|odd
    NUMBA.mm_q4loom(np.ascontiguousarray(xp), qt.scales, qt.packed, out, 16)
    return True


def _block_sums(x: np.ndarray) -> np.ndarray:
    return x.reshape(x.shape[0], -1, 32).sum(axis=2, dtype=np.float32)  # [n, k/32]


def _q4_0(qt, x, out) -> bool:
    if not hasattr(qt, "raw"):
        return False
    NUMBA.mm_gguf_q4(x, _block_sums(x), qt.raw, NUMBA.HALF, out, 16, 18, False)
    return True


def _q4_1(qt, x, out) -> bool:
    if not hasattr(qt, "raw"):
        return False
    NUMBA.mm_gguf_q4(x, _block_sums(x), qt.raw, NUMBA.HALF, out, 16, 20, True)
    return True


def _q8_0(qt, x, out) -> bool:
    if not hasattr(qt, "raw"):
        return False
    NUMBA.mm_gguf_q8_0(x, qt.raw, qt.raw.view(np.int8), NUMBA.HALF, out, 32)
    return True


# numba adapters by the name a scheme record gives (poly.quant.schemes.QuantScheme.numba)
ADAPTERS: dict[str, Callable] = {
    "dense": _dense,
    "int8": _int8,
    "loom_q4": _q4loom,
    "gguf_q4_0": _q4_0,
    "gguf_q4_1": _q4_1,
    "gguf_q8_0": _q8_0,
}


def _adapters() -> dict[str, Callable]:
    """scheme name -> its numba adapter."""
    return {n: ADAPTERS[r.numba] for n, r in SCHEMES.items() if r.numba is not None}


def _kernel(adapter: Callable) -> Callable:
    def kernel(qt, x2: np.ndarray, res: np.ndarray) -> None:
        if x2.shape[0] > SMALL_N or not adapter(qt, x2, res):
            qt.matmul_reference(x2, res)

    kernel.__name__ = f"numba_{getattr(adapter, '__name__', 'kernel')}"
    return kernel


def dense_matmul(x: np.ndarray, w: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x [n, k] @ w.T for a float32 w [m, k]. One row: BLAS sgemv (measured fastest: SmolLM2 f32
    decode 37.9 tok/s vs 25.1 with the C kernel). 2..MAX_N rows under the C backend: the C
    kernel's register tiles, which stream each weight row once for all rows (OpenBLAS packs the
    whole weight for a small-m sgemm: B=4 lm_head 15 ms vs 5 ms); from there the C gemm.
    numba when chosen explicitly."""
    if out is None:
        out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    chosen, n = _state["backend"], x.shape[0]
    small = w.flags.c_contiguous and x.flags.c_contiguous
    if chosen == "c" and 2 <= n <= ckernels.MAX_N and small and ckernels.dense_matmul(x, w, out):
        return out
    if chosen == "c" and n > ckernels.MAX_N and small and _gemm_ok(x, w, out):
        ckernels.gemm(ckernels.F32, w, None, x, out)  # prefill: no OpenBLAS threads to fight
        return out
    if chosen == "numba" and n <= SMALL_N and small:
        NUMBA.mm_f32(x, w, out)
    else:
        np.matmul(x, w.T, out=out)
    return out


def _gemm_ok(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> bool:
    f32 = np.float32
    return (
        x.dtype == f32
        and w.dtype == f32
        and out.dtype == f32
        and out.flags.c_contiguous
        and out.flags.writeable
        and x.ndim == 2
        and w.ndim == 2
        and out.shape == (x.shape[0], w.shape[0])
        and x.shape[1] == w.shape[1]
    )


def _resolve(name: str) -> str:
    if name == "auto":
        return "c" if HAVE_C else ("numba" if HAVE_NUMBA else "numpy")
    if name == "numba" and not HAVE_NUMBA:
        raise UsageError("backend 'numba' needs the numba package (pip install 'polyloom[fast]')")
    if name == "c" and not HAVE_C:
        raise UsageError(
            "backend 'c' needs the compiled extension poly.runtime.native.ckernels (reinstall with gcc)"
        )
    return name


def set_backend(name: str | None = None) -> str:
    """Select "auto" | "numpy" | "c" | "numba" (None: $POLY_BACKEND or "auto"); returns the one used."""
    name = (name or os.environ.get("POLY_BACKEND") or "auto").strip().lower()
    if name not in BACKENDS:
        raise UsageError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    chosen = _resolve(name)
    for scheme in {*_adapters(), *ckernels.C_SCHEMES}:
        qtensor.KERNELS.pop(scheme, None)
    if chosen == "numba":
        _load_numba()
        for scheme, adapter in _adapters().items():
            qtensor.KERNELS[scheme] = _kernel(adapter)
    elif chosen == "c":
        for scheme in ckernels.C_SCHEMES:
            if scheme != "float32":  # float32 matrices: dense_matmul (BLAS, or C for 2..16 rows)
                qtensor.KERNELS[scheme] = ckernels.kernel
    _state["backend"] = chosen
    if _state["threads"]:
        use_threads(_state["threads"])  # the BLAS count follows the backend (blas_threads)
    _install_hooks(chosen)
    Generations.bump()  # cached fused plans depend on the backend
    return chosen


def _install_hooks(chosen: str) -> None:
    """The numeric hooks of poly.ops and poly.quant.qtensor for this backend: pure numpy for
    "numpy" (no C call at all), the C passes (rope, silu*up, dequantize) where built otherwise."""
    ops.HOOKS.update(ops.NUMPY_HOOKS)
    qtensor.DEQUANTIZER.update(supported=None, rows=None)
    if chosen == "numpy":
        return
    ops.HOOKS["dense_matmul"] = dense_matmul
    if ckernels.AVAILABLE:
        ops.HOOKS["silu_mul"] = ckernels.silu_mul
        ops.HOOKS["rope_inplace"] = ckernels.EXT.rope
        ops.HOOKS["attend"] = attention.attend
        ops.HOOKS["expert"] = experts.run
        qtensor.DEQUANTIZER.update(
            supported=ckernels.dequantize_supported, rows=ckernels.dequantize
        )


def _load_numba() -> None:
    """Import the numba kernels (poly/runtime/numba_kernels.py) as globals of this module."""
    if "mm_f32" not in globals():
        global NUMBA
        from poly.runtime import numba_kernels

        NUMBA = numba_kernels
        globals().update({name: getattr(numba_kernels, name) for name in _NUMBA_NAMES})
        set_num_threads(_state["threads"] or None)


def __getattr__(name: str):
    """The numba kernels (mm_f32, ...) compile on first access."""
    if name in _NUMBA_NAMES and HAVE_NUMBA:
        _load_numba()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


set_backend()  # first: the thread count's BLAS share depends on the backend (blas_threads)
set_num_threads()

"""The compiled C kernels (poly.runtime.native.ckernels, built from csrc/): glue and registration.

`matmul(qt, x, out)` computes out [n, m] = x [n, k] @ W.T for 1 <= n <= MAX_N input rows,
reading W in its stored form: float32/float16/bfloat16 arrays, int8 per-row codes, Loom Q4,
GGUF F32/F16/BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, Q2_K..Q6_K, IQ4_NL/IQ4_XS (`GGUF_TYPE_KINDS`).
Sums are float32, parallel over output rows with OpenMP.

One extension holds a build of the kernels per instruction set ("base" C, "avx2": AVX2 + FMA +
F16C, "avx512": AVX-512 F/BW/DQ/VL/VNNI); csrc/module.c picks the best the CPU runs at import
(cpuid), POLY_ISA=base|avx2|avx512 caps it; `isas()`, `use_isa(name)`, `info()["isa"]`. Inputs
are validated here (poly errors); the C side re-checks sizes: no read out of bounds.

Scheme flag `set_act_q8(True)` (or POLY_ACT_Q8=1): the 4/8-bit kinds and int8 take x as two
int8 codes per element per 32-block (x ~= dx * (xh + xl / 254), dx = max|x| / 127) and use
integer dot products (maddubs/madd, or AVX-VNNI). Measured error vs the exact float path:
~1e-4 of max|out| (tests/test_ckernels.py asserts <= 2e-3 with an outlier channel); ~1.7x
faster for Q4_1 rows. The default, "auto", takes integer paths where they win, on one int8
code per element for the K-quants, the repacked Q4_0 and Loom Q4 rows (x's rounding is the
error, ~5e-3 of max|out| on Gaussian x; tests/test_k8.py, tests/test_interleave16_codes.py), on two for
the other repacked rows (`set_act_q8`). False or POLY_ACT_Q8=0: the float path always.

`AVAILABLE` is False when the extension was not built (no compiler at install time).
"""

from __future__ import annotations

import os

import numpy as np

from poly.errors import DTypeError, LayerConfigError, UsageError
from poly.quant import schemes as qs
from poly.quant.qtensor import DenseMatrix, GGUFMatrix
from poly.runtime.heap import keep_temporaries

try:
    from poly.runtime.native import ckernels as EXT

    AVAILABLE = True
    keep_temporaries()  # the C paths' prefill temporaries stay mapped (poly/runtime/heap.py)
except ImportError:  # pragma: no cover - only on installs without a C compiler
    EXT = None
    AVAILABLE = False
_MAIN = EXT  # the build chosen at import

MAX_N = 16  # input rows per call (the C side keeps one accumulator per row)
STEP_ROWS = 64  # rows of one fused step (csrc/decode/step.h STEP_MAX)
FLOAT_KMAJOR16: dict[int, np.ndarray] = {}  # id(array or QTensor) -> repack.float_kmajor16

# kind ids of csrc/core/common.h (poly.quant.schemes); k8_kind, pq8_kind: formats/kquant_rows.h
F32, F16, BF16, I8, LOOM_Q4 = qs.C_F32, qs.C_F16, qs.C_BF16, qs.C_I8, qs.C_LOOM_Q4
Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = qs.C_Q4_0, qs.C_Q4_1, qs.C_Q8_0, qs.C_Q4_K, qs.C_Q6_K
K8_KINDS = frozenset({qs.C_Q2_K, qs.C_Q3_K, qs.C_Q4_K, qs.C_Q5_K, qs.C_Q6_K})
PQ8_KINDS = frozenset({qs.C_Q5_0, qs.C_Q5_1, qs.C_IQ4_NL, qs.C_IQ4_XS, qs.C_MXFP4})
DENSE_KINDS = {n: r.c_kind for n, r in qs.SCHEMES.items() if r.qtensor is DenseMatrix}
GGUF_KINDS = {n: r.c_kind for n, r in qs.SCHEMES.items() if r.qtensor is GGUFMatrix}
GGUF_BLOCK = {r.c_kind: r.block for r in qs.SCHEMES.values() if r.qtensor is GGUFMatrix}
# GGUF (ggml) tensor type id -> the C kind that reads its stored bytes (decode and dequantize)
GGUF_TYPE_KINDS = {r.ggml_type: r.c_kind for r in qs.SCHEMES.values()
                   if r.ggml_type is not None and r.c_kind is not None}  # fmt: skip
_F32 = np.dtype(np.float32)
Q8_OFF, Q8_ON, Q8_AUTO = 0, 1, 2
# a flag on q8 for HF bfloat16 weights: their rows stay exact in the auto mode (parity with
# transformers); GGUF's BF16 takes llama.cpp's bf16 dots there (csrc/formats/vdpbf16_rows.h)
Q8_EXACT_BF16 = 4
_Q8_ENV = {"0": Q8_OFF, "1": Q8_ON}
_opts = {"q8": _Q8_ENV.get(os.environ.get("POLY_ACT_Q8", ""), Q8_AUTO)}


def set_act_q8(on: bool | str) -> int:
    """Scheme flag: True = int8 activations for every 4/8-bit kernel (two codes per element,
    ~1e-4 of the float path; docs/performance.md), False = the exact float path everywhere,
    "auto" (the default) = integer paths where they win, on one int8 code per element like
    llama.cpp's for: the K-quants (Q2_K..Q6_K) in decode rows (csrc/formats/kquant_rows.h; in the fused step
    every row of a batched decode too) and prompts of 4 rows or more (csrc/formats/kquant_panels.h: int8
    panels); the repacked Q4_0 and Loom Q4 rows, every row alike (csrc/formats/interleave16.h il16_x1; Q4_1,
    Q8_0, int8 keep two); Q5_0/Q5_1/IQ4_NL/IQ4_XS decode rows (and every row of a batched
    decode, csrc/rows/int8_rows.h), their prompts on the float paths, but IQ4's on the int8 panels too;
    BF16 prompts of 4 rows or more on vdpbf16ps where the CPU has AVX512_BF16 (x rounded to
    bf16, csrc/formats/vdpbf16_rows.h)."""
    _opts["q8"] = Q8_AUTO if on == "auto" else (Q8_ON if on else Q8_OFF)
    return _opts["q8"]


def prompt_kinds() -> frozenset:
    """The kinds whose prompts (one sequence's rows) take another path in the auto mode than
    the same rows in company: the K-quants (int8 panels), Q5_0/Q5_1/IQ4 (a prompt on the float
    paths or, IQ4, the int8 panels; int8 rows in company), on 8-lane builds Loom Q4 (int8 rows in
    company, the float paths alone: PK_LOOM8), and BF16 where the CPU has AVX512_BF16 (a prompt's
    rows on vdpbf16ps with x rounded to bf16, in company the float rows)."""
    if _opts["q8"] != Q8_AUTO or not AVAILABLE:
        return frozenset()
    return (
        K8_KINDS
        | (PQ8_KINDS if SIMD else frozenset())
        | (frozenset({LOOM_Q4}) if LOOM8 else frozenset())
        | (frozenset({BF16}) if BF16_DOT else frozenset())
    )


def act_q8() -> int:
    """The scheme flag as the C entries take it: Q8_OFF, Q8_ON or Q8_AUTO."""
    return _opts["q8"]


def info() -> dict:
    """Facts of the extension: {"simd": 0/1, "openmp": 0/1, "threads": n, "isa": the build in
    use, "isas": the builds this CPU runs}, {} if absent."""
    if not AVAILABLE:
        return {}
    return {**EXT.info(), "isa": EXT.ISA, "isas": isas()}


def isas() -> tuple[str, ...]:
    """The instruction-set builds of the kernels this CPU runs (best last); () without them."""
    return tuple(_MAIN.ISAS) if AVAILABLE else ()


def use_isa(name: str) -> str:
    """Run the `name` build of the kernels from now on (tests, benchmarks); returns the previous
    one. UsageError when this CPU cannot run it. The thread count carries over."""
    global EXT, GEMM_ROWS, LOOM8, SIMD, BF16_DOT
    if name not in isas():
        raise UsageError(f"no {name!r} build of the C kernels runs here (have {isas()})")
    old, threads = EXT.ISA, EXT.info()["threads"]
    if name != old:
        EXT = _MAIN if name == _MAIN.ISA else _MAIN.variant(name)
        EXT.set_threads(threads)
        GEMM_ROWS, LOOM8, SIMD, BF16_DOT = _facts()
    return old


def set_num_threads(n: int) -> int:
    if AVAILABLE:
        return EXT.set_threads(int(n))
    return int(n)


def operands(qt) -> tuple[int, np.ndarray, np.ndarray | None] | None:
    """(kind, weight array, aux array) for a QTensor the C kernels read, else None."""
    scheme = qt.scheme
    if scheme in DENSE_KINDS:
        a = getattr(qt, "array", None)  # CodedMatrix names its schemes "float16" too
        if a is not None and a.flags.c_contiguous and a.dtype.name == scheme:
            return DENSE_KINDS[scheme], a, None
        return None
    if scheme == "int8":
        enc = getattr(qt, "encoded", None)
        if enc is None or enc.codes.dtype != np.int8 or enc.scales is None:
            return None
        codes, scales = enc.codes, enc.scales
        if scales.dtype != _F32 or not (codes.flags.c_contiguous and scales.flags.c_contiguous):
            return None
        return I8, codes, scales
    if scheme == "loom_q4":
        if qt.shape[1] % 32 or not hasattr(qt, "packed"):
            return None  # blocks straddle rows: the numpy path handles those
        if not (qt.packed.flags.c_contiguous and qt.scales.flags.c_contiguous):
            return None
        return LOOM_Q4, qt.packed, qt.scales
    kind = GGUF_KINDS.get(scheme)
    raw = getattr(qt, "raw", None)
    if kind is None or raw is None or not raw.flags.c_contiguous:
        return None
    return kind, raw, None


def laid(qt) -> tuple | None:
    """(kind, stored rows, None) of a GGUF float matrix whose rows the file permutes, laid out by 16
    in order (`repack.float_kmajor16_stored`): read with its `repacked16` alone (not quantized
    ones: some routes read their rows, in order, `qt.raw`)."""
    kind = GGUF_KINDS[qt.scheme] if getattr(qt, "order", None) is not None else None
    laid16 = kind in (F16, F32) and getattr(qt, "repacked16", None) is not None
    return (kind, qt.stored, None) if laid16 else None


def supports(qt) -> bool:
    """True when the C kernels read this QTensor directly."""
    return AVAILABLE and operands(qt) is not None


def dequant_operands(qt) -> tuple[int, np.ndarray, np.ndarray | None] | None:
    """Like `operands`, for dequantizing: Loom Q4 blocks may straddle rows here."""
    if qt.scheme == "loom_q4" and hasattr(qt, "packed"):
        packed, scales = qt.packed, qt.scales
        if packed.flags.c_contiguous and scales.flags.c_contiguous and scales.dtype == _F32:
            return LOOM_Q4, packed, scales
        return None
    return operands(qt)


def dequantize_supported(qt) -> bool:
    """True when `dequantize` reads this QTensor's stored form."""
    return AVAILABLE and dequant_operands(qt) is not None


def dequantize(
    qt, start: int, stop: int, out: np.ndarray | None = None, threads: int = 0
) -> np.ndarray | None:
    """Rows [start, stop) of a QTensor as float32 [stop-start, in], written into `out` (a
    C-contiguous float32 buffer of at least that many rows) or a new array; bitwise equal to
    the numpy decoders. None when the extension is absent or does not read this stored form.
    threads: OpenMP threads, 0 = the `set_num_threads` value; use 1 right before a BLAS call
    (spinning idle OpenMP threads starve OpenBLAS's)."""
    ops = dequant_operands(qt) if AVAILABLE else None
    if ops is None:
        return None
    m, k = qt.shape
    start, stop = int(start), int(stop)
    if not 0 <= start <= stop <= m:
        raise LayerConfigError(f"row range [{start}, {stop}) outside 0..{m}")
    n = stop - start
    if out is None:
        out = np.empty((n, k), dtype=np.float32)
    else:
        if not isinstance(out, np.ndarray) or out.dtype != _F32:
            raise DTypeError(f"out must be a float32 array, got {getattr(out, 'dtype', out)}")
        if out.ndim != 2 or out.shape[1] != k or out.shape[0] < n or not out.flags.c_contiguous:
            raise LayerConfigError(
                f"out must be C-contiguous float32 [>= {n}, {k}], got {out.shape}"
            )
        if not out.flags.writeable:
            raise LayerConfigError("out must be writable")
        out = out[:n]  # [n, k], still contiguous
    kind, w, aux = ops
    if int(threads) < 0:
        raise LayerConfigError(f"threads must be >= 0, got {threads}")
    EXT.dequantize(kind, w, aux, m, k, start, stop, out, int(threads))
    return out


def silu_mul(gate_up: np.ndarray, out: np.ndarray, up: np.ndarray | None = None) -> np.ndarray:
    """out [n, I] = silu(gate_up[:, :I]) * gate_up[:, I:] in one vectorized pass, or with `up`
    silu(gate_up) * up (gate and up [n, I] apart); rows over the threads."""
    EXT.silu_mul(gate_up, out, *(() if up is None else (up,)))
    return out


def decode(layers, caches, head, x, logits, pos, threads, paged=None, reduce=None, exact=False):
    """The fused decode step (csrc/decode/step.h): every block, the final norm and the LM head
    for the rows of x [n, d] in one OpenMP region (argument tuples: poly.runtime.fused).
    ``paged`` = (page_size, int32 page table per row): caches are page pools (poly.serving).
    ``reduce`` (tensor parallel) = (buf float32 [n, d], fn): fn() sums buf over the ranks in
    place; it runs after the O and the down projection of every block. ``exact``: the model's
    BF16 rows are HF weights (Q8_EXACT_BF16)."""
    q8 = _opts["q8"] | (Q8_EXACT_BF16 if exact else 0)
    tail = (paged, reduce) if reduce is not None else () if paged is None else (paged,)
    EXT.decode(layers, caches, head, x, logits, pos, q8, threads, *tail)


def _check_io(x, out, m: int, k: int) -> None:
    for name, a in (("x", x), ("out", out)):
        if not isinstance(a, np.ndarray):
            raise LayerConfigError(f"{name} must be a numpy array, got {type(a).__name__}")
        if a.dtype != _F32:
            raise DTypeError(f"{name} must be float32, got {a.dtype}")
        if not a.flags.c_contiguous:
            raise LayerConfigError(f"{name} must be C-contiguous")
    if x.ndim != 2 or x.shape[1] != k or not 1 <= x.shape[0] <= MAX_N:
        raise LayerConfigError(f"x must be [1..{MAX_N}, {k}], got {x.shape}")
    if out.shape != (x.shape[0], m) or not out.flags.writeable:
        raise LayerConfigError(f"out must be a writable [{x.shape[0]}, {m}], got {out.shape}")


def matmul(qt, x: np.ndarray, out: np.ndarray | None = None, q8: bool | None = None) -> np.ndarray:
    """out [n, m] = x [n, k] @ W.T with the C kernel for this QTensor's stored form
    (q8: int8 activations, None = the `set_act_q8` setting)."""
    if not AVAILABLE:
        raise LayerConfigError(
            "the C kernels are not built (poly.runtime.native.ckernels is missing)"
        )
    ops = operands(qt)
    if ops is None:
        raise LayerConfigError(f"no C kernel reads {qt!r}")
    m, k = qt.shape
    if out is None and isinstance(x, np.ndarray) and x.ndim == 2:
        out = np.empty((x.shape[0], m), dtype=np.float32)
    _check_io(x, out, m, k)
    kind, w, aux = ops
    q8 = _q8(w) if q8 is None else (Q8_ON if q8 else Q8_OFF)
    EXT.matmul(kind, x, out, w, aux, x.shape[0], k, m, q8)
    return out


def _q8(w: np.ndarray) -> int:
    """The scheme flag for stored rows w: HF bfloat16 arrays exact (Q8_EXACT_BF16)."""
    return _opts["q8"] | (Q8_EXACT_BF16 if w.dtype.name == "bfloat16" else 0)


def dense_matmul(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> bool:
    """out = x @ w.T for a C-contiguous float32 w [m, k] and x [n <= MAX_N, k]; False = not taken."""
    n, k = x.shape
    if n > MAX_N or w.dtype != _F32 or not (w.flags.c_contiguous and x.flags.c_contiguous):
        return False
    if x.dtype != _F32 or not out.flags.c_contiguous or w.shape[1] != k:
        return False
    EXT.matmul(F32, aligned(x), out, w, None, n, k, w.shape[0], False)
    return True


def gemm(kind: int, w: np.ndarray, aux, x: np.ndarray, out: np.ndarray, threads: int = 0) -> None:
    """out [n, m] = x [n, k] @ W.T for any n with csrc/gemm/gemm.h (the stored form `kind`, not
    Loom Q4): OpenMP panels of dequantized rows, no BLAS (so no OpenMP/OpenBLAS thread fight)."""
    n, k = x.shape
    EXT.gemm(kind, x, out, w, aux, n, k, out.shape[1], int(threads))


def _facts() -> tuple[int, bool, bool, bool]:
    """The build's (GEMM_ROWS, LOOM8, SIMD, BF16_DOT): rows from which `gemm` beats the row
    kernels' tiles (csrc/core/common.h; 9 on 8-lane builds, MAX_N + 1 on AVX-512; the fused
    step's switch too; dense rows stay on the tiles to MAX_N on every build); whether the auto
    mode runs Loom Q4 rows in company on x's int8 codes and a prompt alone on the float paths
    (PK_LOOM8, 8-lane builds, matrices not repacked by 16); whether it has the SIMD kernels
    (base: plain loops, float paths only); whether it runs GGUF BF16 prompts on vdpbf16ps."""
    info = EXT.info() if AVAILABLE else {}
    rows = int(info.get("gemm_rows", MAX_N + 1))
    return rows, bool(info.get("loom8")), bool(info.get("simd")), bool(info.get("bf16"))


GEMM_ROWS, LOOM8, SIMD, BF16_DOT = _facts()  # follow use_isa; read by prompt_kinds


def aligned(x: np.ndarray) -> np.ndarray:
    """x itself when it starts on a 64-byte boundary or is one row, else a copy that does: the
    row kernels' 64-byte loads of x that split cache lines ran at 0.64x (an 8-row Q4_1 LM head
    2040 vs 1300 us); one row is streamed once, so copying it costs more than it saves."""
    if x.ctypes.data % 64 == 0 or x.shape[0] <= 1:
        return x
    buf = np.empty(x.size + 16, dtype=x.dtype)
    start = (-buf.ctypes.data % 64) // x.itemsize
    out = buf[start : start + x.size].reshape(x.shape)
    out[...] = x
    return out


def kernel(qt, x2: np.ndarray, res: np.ndarray) -> None:
    """The `poly.quant.qtensor.KERNELS` entry: C for a supported form, else numpy.

    Below GEMM_ROWS rows (dense rows: to MAX_N) the row kernels (each weight row streamed once);
    from there the register-tiled `gemm` (1.5-1.8x OpenBLAS sgemm on SmolLM2's shapes, no
    dequantized copy); forms without a C reader: dequantize + BLAS."""
    n = x2.shape[0]
    ops = laid(qt) or operands(qt)
    if ops is None:
        qt.matmul_reference(x2, res)
        return
    kind, w, aux = ops
    m, k = qt.shape[0], qt.shape[1]
    # the row kernels take x on a 64-byte boundary (`aligned`); gemm the same time aligned or not
    x2 = np.ascontiguousarray(x2, dtype=np.float32)
    # q/k/v (and gate/up) write into column slices of one buffer: strided for n > 1
    dst = res if res.flags.c_contiguous else np.empty((n, m), dtype=np.float32)
    rp = getattr(qt, "repacked16", FLOAT_KMAJOR16.get(id(w)))  # read instead of w (fused_args)
    tiles = kind in (F32, F16, BF16) and n <= MAX_N  # dense rows: the register tiles to MAX_N
    if n >= GEMM_ROWS and not tiles:  # Q4_K/Q6_K's copy by 8: gemm's int8 panels read it
        EXT.gemm(kind, x2, dst, w, aux, n, k, m, 0, _q8(w), getattr(qt, "kquant_interleave8", rp))
    else:  # as the fused step's rows: the repacked rows on x's int8 codes unless q8 is off
        EXT.matmul(kind, aligned(x2), dst, w, aux, n, k, m, _q8(w), rp)
    if dst is not res:
        res[...] = dst


C_SCHEMES = tuple(qs.c_kinds())  # the schemes a C kernel reads

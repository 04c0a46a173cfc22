"""Matrices [out, in] (HF nn.Linear layout) kept in their stored representation.

`matmul(x)` = x @ W.T, computed block of rows by block of rows so a quantized matrix is never fully
re-materialized in float32. A compiled backend can take over a scheme by registering a kernel in
`KERNELS` (signature `kernel(qtensor, x [n, in] float32, out [n, out] float32) -> None`).
"""

from __future__ import annotations

import functools
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from poly.dtypes import DType, Encoded, decode_rows, encode, parse_dtype
from poly.errors import (
    EntityFormatError,
    GGUFFormatError,
    LayerConfigError,
    NumericalError,
    UnsupportedError,
)
from poly.quant.ggml import GGUF_MATRIX_TYPES, QUANT_SIZES, GGMLType, dequantize_mxfp4

KERNELS: dict[str, Callable[[QTensor, np.ndarray, np.ndarray], None]] = {}
# A compiled dequantizer a backend installs (poly.runtime.kernels): "supported"(qt) -> bool,
# "rows"(qt, start, stop, out, threads=0) -> float32 rows bitwise equal to the numpy decoders.
DEQUANTIZER: dict[str, Callable | None] = {"supported": None, "rows": None}


class QTensor(ABC):
    """A matrix [out, in] in some stored representation."""

    shape: tuple[int, int]
    scheme: str
    block_rows: int = 256  # row-block ("tile") size of the blocked matmul

    @property
    @abstractmethod
    def nbytes(self) -> int: ...

    @abstractmethod
    def _rows_numpy(self, start: int, stop: int) -> np.ndarray:
        """float32 [stop-start, in] for a validated row range (the numpy reference decoder)."""

    def _rows(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, stop): the C dequantizer when it reads this form (bitwise equal), else numpy."""
        if start == stop:  # gguf-py cannot dequantize zero blocks
            return np.empty((0, self.shape[1]), np.float32)
        got = _c_rows(self, start, stop, out)
        return self._rows_numpy(start, stop) if got is None else got

    def dequantize(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) as float32 [stop-start, in] (may be a read-only view for float32)."""
        rows = self.shape[0]
        stop = rows if stop is None else int(stop)
        if not 0 <= start <= stop <= rows:
            raise LayerConfigError(f"row range [{start}, {stop}) outside 0..{rows}")
        return self._rows(int(start), stop)

    def matmul(self, x, out: np.ndarray | None = None) -> np.ndarray:
        """x @ W.T for float32 x [n, in] (or [in]) -> float32 [n, out] (or [out])."""
        x = np.asarray(x, dtype=np.float32)
        vec = x.ndim == 1
        x2 = np.ascontiguousarray(x.reshape(1, -1) if vec else x)  # [n, in]
        if x2.ndim != 2 or x2.shape[1] != self.shape[1]:
            raise LayerConfigError(f"matmul input {x.shape} does not match weight {self.shape}")
        want = (self.shape[0],) if vec else (x2.shape[0], self.shape[0])
        if out is None:
            out = np.empty(want, dtype=np.float32)
        elif out.shape != want or out.dtype != np.float32:
            raise LayerConfigError(f"out must be float32 {want}, got {out.dtype} {out.shape}")
        res = out.reshape(x2.shape[0], self.shape[0])  # [n, out] view of `out`
        kernel = KERNELS.get(self.scheme)
        if kernel is not None:
            kernel(self, x2, res)
        else:
            self.matmul_reference(x2, res)
        return out

    def matmul_reference(self, x2: np.ndarray, res: np.ndarray) -> None:
        rows, k = self.shape
        step = max(1, min(int(self.block_rows), _TILE_BYTES // (4 * max(1, k))))
        # one float32 tile reused for every row block when C dequantizes (stays in L2 for sgemm);
        # one dequantizing thread: spinning OpenMP threads would starve BLAS's
        buf = np.empty((min(step, rows), k), np.float32) if _c_reads(self) else None
        for a in range(0, rows, step):
            b = min(rows, a + step)
            w = self._rows(a, b) if buf is None else DEQUANTIZER["rows"](self, a, b, buf, threads=1)
            res[:, a:b] = x2 @ w.T  # [n, b-a]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, scheme={self.scheme!r})"


_TILE_BYTES = 512 * 1024  # float32 row-block size of the blocked matmul (cache-sized)


def _c_reads(qt: QTensor) -> bool:
    # float32 arrays are already float32: a view beats a copy
    supported = DEQUANTIZER["supported"]
    return supported is not None and qt.scheme != "float32" and supported(qt)


def _c_rows(qt: QTensor, start: int, stop: int, out: np.ndarray | None) -> np.ndarray | None:
    return DEQUANTIZER["rows"](qt, start, stop, out) if _c_reads(qt) else None


def _shape2(shape) -> tuple[int, int]:
    if len(shape) != 2 or min(shape) < 0:
        raise LayerConfigError(f"a matrix shape must be (out, in), got {tuple(shape)}")
    return int(shape[0]), int(shape[1])


# --- dense arrays ------------------------------------------------------------------------------

# by name (native byte order only): an array of ml_dtypes' bfloat16 means ml_dtypes is loaded,
# and naming it here does not import it (~0.2-0.8 s of a process's start)
_DENSE_SCHEMES: dict[str, str] = {n: n for n in ("float32", "float16", "bfloat16")}


def _dense_dtype(dt: np.dtype) -> bool:
    return dt.isnative and dt.name in _DENSE_SCHEMES


class DenseMatrix(QTensor):
    """A float32/float16/bfloat16 ndarray (memmap views welcome: never copied here)."""

    def __init__(self, array: np.ndarray):
        if not isinstance(array, np.ndarray) or not _dense_dtype(array.dtype):
            got = getattr(array, "dtype", type(array).__name__)
            raise LayerConfigError(f"DenseMatrix takes a float32/float16/bfloat16 array, got {got}")
        self.shape = _shape2(array.shape)
        self.array = array
        self.scheme = _DENSE_SCHEMES[array.dtype.name]

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def _rows_numpy(self, start: int, stop: int) -> np.ndarray:
        return self.array[start:stop].astype(np.float32, copy=False)

    def matmul_reference(self, x2: np.ndarray, res: np.ndarray) -> None:
        if self.array.dtype == np.float32:
            np.matmul(x2, self.array.T, out=res)  # one BLAS call, no blocking needed
        else:
            super().matmul_reference(x2, res)


# --- any of the 21 dtypes ----------------------------------------------------------------------


class CodedMatrix(QTensor):
    """A matrix encoded with `poly.dtypes.encode` (per-row scales, packed sub-byte kinds)."""

    def __init__(self, encoded: Encoded):
        self.shape = _shape2(encoded.shape)
        self.encoded = encoded
        self.dtype = encoded.dtype
        self.scheme = encoded.dtype.label

    @classmethod
    def encode(cls, w, dtype: DType | int | str) -> CodedMatrix:
        w = np.asarray(w, dtype=np.float32)
        _shape2(w.shape)
        return cls(encode(w, dtype))

    @property
    def nbytes(self) -> int:
        return self.encoded.nbytes

    def _rows_numpy(self, start: int, stop: int) -> np.ndarray:
        return decode_rows(self.encoded, start, stop)


# --- Loom's Q4 bake (scheme loom_q4; Loom calls it Q4_0) (inventory §2.5, §4.6, Appendix A) -----------------------------------------

Q4_BLOCK = 32


def _round_half_away(x: np.ndarray) -> np.ndarray:
    # Go math.Round; floor(x + 0.5) would mis-round 0.49999997.
    t = np.trunc(x)
    return t + np.sign(x) * (np.abs(x - t) >= 0.5)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [nb, 16] -> int8 [nb, 32]: low nibble = even element, 4-bit two's complement."""
    lo = ((packed & np.uint8(0xF)) ^ np.uint8(8)).view(np.int8) - np.int8(8)
    hi = ((packed >> np.uint8(4)) ^ np.uint8(8)).view(np.int8) - np.int8(8)
    return np.stack([lo, hi], axis=-1).reshape(packed.shape[0], Q4_BLOCK)  # [nb, 32]


def _q4_words(nblocks: int) -> int:
    return max(512, -(-4 * nblocks // 64) * 64)


class Q4Matrix(QTensor):
    """Loom's Q4_0: 32-weight blocks of the row-major matrix, float32 scale max|w|/7, nibbles."""

    scheme = "loom_q4"

    def __init__(self, scales: np.ndarray, packed: np.ndarray, shape):
        self.shape = _shape2(shape)
        nb = -(-self.shape[0] * self.shape[1] // Q4_BLOCK)
        if scales.dtype != np.float32 or scales.shape != (nb,):
            raise LayerConfigError(
                f"Q4 scales must be float32 [{nb}], got {scales.dtype} {scales.shape}"
            )
        if packed.dtype != np.uint8 or packed.size != nb * 16:
            raise LayerConfigError(f"Q4 packed must be uint8 [{nb}, 16], got {packed.shape}")
        self.scales = scales
        self.packed = packed.reshape(nb, 16)  # [nblocks, 16], a view

    @classmethod
    def quantize(cls, w) -> Q4Matrix:
        w = np.asarray(w, dtype=np.float32)
        shape = _shape2(w.shape)
        if not np.isfinite(w).all():
            raise NumericalError("cannot Q4-quantize non-finite weights")
        nb = -(-w.size // Q4_BLOCK)
        blocks = np.zeros(nb * Q4_BLOCK, np.float32)
        blocks[: w.size] = w.reshape(-1)
        blocks = blocks.reshape(nb, Q4_BLOCK)  # [nblocks, 32], zero-padded tail
        scales = np.max(np.abs(blocks), axis=1, initial=0.0) / np.float32(7.0)  # float32
        x = np.zeros_like(blocks)
        np.divide(blocks, scales[:, None], out=x, where=scales[:, None] > 0)  # scale 0 -> codes 0
        u = np.clip(_round_half_away(x), -8, 7).astype(np.int8).view(np.uint8) & np.uint8(0xF)
        packed = (u[:, 0::2] | (u[:, 1::2] << np.uint8(4))).astype(np.uint8)  # [nblocks, 16]
        return cls(scales.astype(np.float32), packed, shape)

    @property
    def nbytes(self) -> int:
        return int(self.scales.nbytes + self.packed.nbytes)

    def _rows_numpy(self, start: int, stop: int) -> np.ndarray:
        n_in = self.shape[1]
        a, e = start * n_in, stop * n_in  # flat element range
        b0, b1 = a // Q4_BLOCK, -(-e // Q4_BLOCK)
        vals = _nibbles(self.packed[b0:b1]).astype(np.float32)  # [nb, 32]
        vals *= self.scales[b0:b1, None]
        flat = vals.reshape(-1)
        if n_in % Q4_BLOCK == 0:  # rows are whole blocks: no offset, no copy
            return flat.reshape(stop - start, n_in)
        off = a - b0 * Q4_BLOCK
        return flat[off : off + e - a].reshape(stop - start, n_in)

    def to_loom_payload(self) -> bytes:
        """u32 n_scales | u32 n_words | f32 scales | u32 words (zero-padded, inventory §4.6)."""
        nb = self.scales.size
        words = np.zeros(_q4_words(nb) * 4, np.uint8)
        words[: nb * 16] = self.packed.reshape(-1)
        head = struct.pack("<II", nb, words.size // 4)
        return head + self.scales.astype("<f4").tobytes() + words.tobytes()

    @classmethod
    def from_loom_payload(cls, buf, shape) -> Q4Matrix:
        """Parse a Loom Q4_0 blob payload (views into `buf`, no copy)."""
        shape = _shape2(shape)
        b = (
            buf.reshape(-1).view(np.uint8)
            if isinstance(buf, np.ndarray)
            else np.frombuffer(buf, np.uint8)
        )
        nb = -(-shape[0] * shape[1] // Q4_BLOCK)
        if b.size < 8:
            raise EntityFormatError("Q4_0 payload shorter than its 8-byte header (size_mismatch)")
        ns, nw = struct.unpack("<II", b[:8].tobytes())
        if ns != nb:
            raise EntityFormatError(f"Q4_0 payload has {ns} scales, shape {shape} needs {nb}")
        if nw < 4 * nb or b.size != 8 + 4 * ns + 4 * nw:
            raise EntityFormatError(
                f"Q4_0 payload of {b.size} bytes does not match {ns} scales and {nw} words "
                "(size_mismatch)"
            )
        scales = b[8 : 8 + 4 * ns].view("<f4")
        if not np.isfinite(scales).all():
            raise EntityFormatError("Q4_0 payload has non-finite block scales")
        packed = b[8 + 4 * ns : 8 + 4 * ns + 16 * nb]
        return cls(scales.astype(np.float32, copy=False), packed, shape)


# --- raw GGUF quant blocks ---------------------------------------------------------------------


def _gguf_dequantizable(qtype: GGMLType) -> bool:
    """True when gguf-py's public `dequantize` decodes `qtype` (one zero block is tried)."""
    from gguf import quants  # only when a GGUF block matrix is made: its import costs ~5 MB

    block, size = QUANT_SIZES[qtype]
    try:
        quants.dequantize(np.zeros((1, size), np.uint8), qtype)
    except (NotImplementedError, ValueError, TypeError, KeyError):
        return False
    return True


@functools.cache
def gguf_supported() -> frozenset[GGMLType]:
    """The GGML types gguf-py dequantizes, asked of it (a test checks ggml.GGUF_MATRIX_TYPES)."""
    own = {GGMLType.MXFP4}  # dequantized by poly.quant.ggml, whatever gguf-py's version
    return frozenset(
        t for t in GGMLType if t in QUANT_SIZES and (t in own or _gguf_dequantizable(t))
    )


class GGUFMatrix(QTensor):
    """A GGUF tensor's raw bytes (numpy row-major shape (out, in)), dequantized per row block.

    `order`: the rows of `raw` in this matrix's order (llama.cpp's q/k permutation); `rows` that
    copy (`repack.ordered_rows`), else made when a path first reads `raw`. `stored`: the file's
    order (float rows laid out by 16 from it, `repack.float_kmajor16_stored`, need no copy)."""

    def __init__(self, raw: np.ndarray, ggml_type: int, shape, order=None, rows=None):
        try:
            qtype = GGMLType(int(ggml_type))
        except ValueError as exc:
            raise GGUFFormatError(f"unknown ggml tensor type {ggml_type} (tensor_type)") from exc
        if qtype not in GGUF_MATRIX_TYPES:  # a table: opening a file imports no gguf-py
            raise UnsupportedError(f"ggml type {qtype.name} cannot be dequantized (quant_type)")
        self.shape = _shape2(shape)
        block, type_size = QUANT_SIZES[qtype]
        if self.shape[1] % block:
            raise GGUFFormatError(
                f"row length {self.shape[1]} is not a multiple of the {qtype.name} block {block} "
                "(block_size)"
            )
        row_bytes = self.shape[1] // block * type_size
        flat = np.asarray(raw).reshape(-1).view(np.uint8)
        if flat.size != self.shape[0] * row_bytes:
            raise GGUFFormatError(
                f"{qtype.name} tensor {self.shape} needs {self.shape[0] * row_bytes} bytes, "
                f"got {flat.size} (size_mismatch)"
            )
        self.stored = flat.reshape(self.shape[0], row_bytes)  # [out, row_bytes], a view
        if order is not None and not np.array_equal(np.sort(order), np.arange(self.shape[0])):
            raise GGUFFormatError(f"row order is not a permutation of {self.shape[0]} rows")
        if rows is not None and (order is None or rows.shape != self.stored.shape):
            raise ValueError("rows: the stored rows in `order`, of their shape")
        self.order, self._raw = order, self.stored if order is None else rows  # None: made later
        self.ggml_type = qtype
        self.scheme = "gguf_" + qtype.name.lower()

    @property
    def raw(self) -> np.ndarray:
        """The rows [out, row_bytes] in this matrix's order."""
        if self._raw is None:  # whole rows reordered (quantized rows too)
            self._raw = np.ascontiguousarray(self.stored[self.order])
        return self._raw

    @property
    def nbytes(self) -> int:
        return int(self.stored.nbytes)

    def matmul_reference(self, x2: np.ndarray, res: np.ndarray) -> None:
        if self.ggml_type == GGMLType.F32:  # the stored rows are the matrix: one BLAS call
            np.matmul(x2, self.raw.view(np.float32).T, out=res)  # (a tiled copy cost ~20 %)
        else:
            super().matmul_reference(x2, res)

    def _rows_numpy(self, start: int, stop: int) -> np.ndarray:
        if self.ggml_type == GGMLType.MXFP4:  # numpy of our own (GPT-OSS experts)
            return dequantize_mxfp4(self.raw[start:stop], self.shape[1])
        from gguf import quants

        vals = quants.dequantize(self.raw[start:stop], self.ggml_type)
        return np.asarray(vals, dtype=np.float32).reshape(stop - start, self.shape[1])


# --- helpers -------------------------------------------------------------------------------------


def as_qtensor(x) -> QTensor:
    """A QTensor as is; a 2-D float32/float16/bfloat16 ndarray wrapped (no copy) as DenseMatrix."""
    if isinstance(x, QTensor):
        return x
    if isinstance(x, np.ndarray):
        return DenseMatrix(x)
    raise LayerConfigError(f"cannot use {type(x).__name__} as a weight matrix")


def encode_matrix(w, dtype: DType | int | str) -> QTensor:
    """Encode float32 w [out, in] as `dtype` (any of the 21, or "loom_q4" for Loom's Q4 bake;
    its old name "q4_0" is still accepted)."""
    if isinstance(dtype, str) and dtype.strip().lower() in ("loom_q4", "q4_0"):
        return Q4Matrix.quantize(w)
    dt = parse_dtype(dtype)
    w = np.asarray(w, dtype=np.float32)
    if dt is DType.FLOAT32:
        return DenseMatrix(w)
    if dt in (DType.FLOAT16, DType.BFLOAT16):
        if dt is DType.FLOAT16:
            return DenseMatrix(w.astype(np.float16))
        import ml_dtypes

        return DenseMatrix(w.astype(ml_dtypes.bfloat16))
    return CodedMatrix.encode(w, dt)

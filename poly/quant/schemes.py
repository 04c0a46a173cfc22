"""One record per stored-matrix scheme (in the manner of gguf-py's quant classes).

A `QuantScheme` names everything a scheme touches: its canonical name (`QTensor.scheme`), block
geometry, encode/decode, the QTensor class that holds it, the C kernel kind id
(csrc/core/common.h), the numba adapter (poly.runtime.kernels.ADAPTERS), the `.entity`
encoding name (entity's blob writer/reader), the `lucy --quant` alias and the aliases older
names keep working under. Adding a scheme = one record here + its kernels.

Loom's 4-bit bake is `loom_q4` (GGUF's Q4_0 is `gguf_q4_0`); `.entity` files written before
the rename say "q4_0" and keep loading (`LEGACY_ENCODINGS`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from poly.dtypes import DType
from poly.errors import UsageError
from poly.quant.ggml import QUANT_SIZES, GGMLType
from poly.quant.qtensor import CodedMatrix, DenseMatrix, GGUFMatrix, Q4Matrix, QTensor

# kind ids of csrc/core/common.h (the C side's `kind` argument)
C_F32, C_F16, C_BF16, C_I8, C_LOOM_Q4, C_Q4_0, C_Q4_1, C_Q8_0, C_Q4_K, C_Q6_K = range(10)
C_Q5_0, C_Q5_1, C_Q2_K, C_Q3_K, C_Q5_K, C_IQ4_NL, C_IQ4_XS, C_MXFP4 = range(10, 18)


@dataclass(frozen=True)
class QuantScheme:
    """One weight encoding: its tensor type, block size, C kind, and its names in `.entity`
    files, GGUF files and the CLI."""

    name: str  # canonical: QTensor.scheme and the stored-version name
    qtensor: type[QTensor]
    block: int  # weights per block along a row (1: per element)
    block_bytes: float  # bytes per block (scales included)
    encode: Callable[[np.ndarray], QTensor] | None  # float32 [out, in] -> QTensor
    c_kind: int | None = None  # None: no C kernel reads it
    numba: str | None = None  # key of poly.runtime.kernels.ADAPTERS
    entity: str | None = None  # the .entity encoding name (None: kept as native GGUF blocks)
    cli: str | None = None  # the `lucy --quant` name
    cli_aliases: tuple[str, ...] = ()  # more names the menu accepts
    embed: str | None = None  # .entity encoding of embeddings/LM head under this --quant
    ggml_type: int | None = None

    def decode(self, qt: QTensor) -> np.ndarray:
        """float32 [out, in] of a QTensor of this scheme."""
        return qt.dequantize()

    def bits_per_weight(self) -> float:
        return 8.0 * self.block_bytes / self.block


def _cast(dtype) -> Callable[[np.ndarray], QTensor]:
    def cast(w: np.ndarray) -> QTensor:
        dt = dtype
        if isinstance(dt, str):  # ml_dtypes' bfloat16, imported when first used
            import ml_dtypes

            dt = getattr(ml_dtypes, dt)
        return DenseMatrix(np.ascontiguousarray(np.asarray(w, np.float32).astype(dt)))

    return cast


def _gguf(t: GGMLType, c_kind: int, numba: str | None) -> QuantScheme:
    block, size = QUANT_SIZES[t]
    return QuantScheme(
        "gguf_" + t.name.lower(), GGUFMatrix, block, size, None, c_kind, numba, ggml_type=int(t)
    )


_T = GGMLType
_RECORDS = (
    QuantScheme(
        "float32", DenseMatrix, 1, 4, _cast(np.float32), C_F32, "dense", "float32", "f32",
        ("32", "fp32"), "float32",
    ),
    QuantScheme(
        "bfloat16", DenseMatrix, 1, 2, _cast("bfloat16"), C_BF16, None, "bfloat16",
        "bf16", (), "bfloat16",
    ),
    QuantScheme(
        "float16", DenseMatrix, 1, 2, _cast(np.float16), C_F16, "dense", "float16", "f16",
        ("16",), "float16",
    ),
    QuantScheme(
        "int8", CodedMatrix, 1, 1, lambda w: CodedMatrix.encode(w, DType.INT8), C_I8, "int8",
        "int8", "q8", ("8", "int8"), "int8",
    ),
    QuantScheme(
        "loom_q4", Q4Matrix, 32, 18, Q4Matrix.quantize, C_LOOM_Q4, "loom_q4", "loom_q4", "q4",
        ("4",), "int8",
    ),
    _gguf(_T.Q4_0, C_Q4_0, "gguf_q4_0"),
    _gguf(_T.Q4_1, C_Q4_1, "gguf_q4_1"),
    _gguf(_T.Q8_0, C_Q8_0, "gguf_q8_0"),
    _gguf(_T.Q4_K, C_Q4_K, None),
    _gguf(_T.Q6_K, C_Q6_K, None),
    # the rest of what llama.cpp's quantizer writes for its presets: C kernels only
    _gguf(_T.Q5_0, C_Q5_0, None),
    _gguf(_T.Q5_1, C_Q5_1, None),
    _gguf(_T.Q2_K, C_Q2_K, None),
    _gguf(_T.Q3_K, C_Q3_K, None),
    _gguf(_T.Q5_K, C_Q5_K, None),
    _gguf(_T.IQ4_NL, C_IQ4_NL, None),
    _gguf(_T.IQ4_XS, C_IQ4_XS, None),
    _gguf(_T.MXFP4, C_MXFP4, None),  # GPT-OSS's experts (formats/gguf_blocks.h)
    # float GGUF tensors (GGUFMatrix views on the file) read by the dense kernels
    _gguf(_T.F32, C_F32, None),
    _gguf(_T.F16, C_F16, None),
    _gguf(_T.BF16, C_BF16, None),
)  # fmt: skip

SCHEMES: dict[str, QuantScheme] = {s.name: s for s in _RECORDS}
# .entity encodings under their old names (files written before the rename keep loading)
LEGACY_ENCODINGS = {"q4_0": "loom_q4"}
CLI_QUANTS = tuple(s.cli for s in reversed(_RECORDS) if s.cli)  # lucy --quant, default first


def get(name: str) -> QuantScheme:
    """The record of a canonical scheme name (or a legacy .entity encoding name)."""
    rec = SCHEMES.get(LEGACY_ENCODINGS.get(name, name))
    if rec is None:
        raise UsageError(f"unknown quant scheme {name!r} (known: {', '.join(SCHEMES)})")
    return rec


def by_cli(alias: str) -> QuantScheme:
    """The record a `lucy --quant` name or menu alias means ("q4", "4", "int8", ...)."""
    key = alias.strip().lower()
    for rec in _RECORDS:
        if rec.cli and (key == rec.cli or key in rec.cli_aliases):
            return rec
    raise UsageError(f"unknown quant {alias!r} (choose one of {', '.join(CLI_QUANTS)})")


def by_entity(encoding: str) -> QuantScheme | None:
    """The record of a .entity encoding name (legacy names included), None if unknown."""
    name = LEGACY_ENCODINGS.get(encoding, encoding)
    rec = SCHEMES.get(name)
    return rec if rec is not None and rec.entity is not None else None


def cli_aliases() -> dict[str, str]:
    """Every menu alias -> its `--quant` name."""
    out = {}
    for rec in _RECORDS:
        if rec.cli:
            out.update({a: rec.cli for a in (rec.cli, *rec.cli_aliases)})
    return out


def c_kinds() -> dict[str, int]:
    """scheme name -> C kind id, for the schemes a C kernel reads."""
    return {s.name: s.c_kind for s in _RECORDS if s.c_kind is not None}

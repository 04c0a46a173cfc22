"""GGUF quant blocks kept as they are in a `.entity` ("nothing lost").

A matrix that a GGUF source already stores in a block kind poly's C kernels read (Q4_0, Q4_1,
Q8_0, Q4_K, Q6_K) goes into a q4/q8 `.entity` byte for byte instead of being dequantized and
re-quantized to Loom's Q4_0: that second rounding cost SmolLM2-135M's Q4_1 file all but 8 of 64
greedy tokens against float32, the kept blocks agree on 64/64. The blob is the GGUF rows, uint8
[out, row_bytes] (row_bytes = in / block × type_size), and its header record carries
`ggml_type`; loading gives a `GGUFMatrix` view on the file mapping (no copy), so the same C
kernels run it as run the GGUF. Float sources (HF, F32/F16 GGUF) keep the Loom Q4_0 bake.
Layout: docs/formats.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from poly.errors import EntityFormatError, IntegrityError
from poly.quant.ggml import QUANT_SIZES, GGMLType
from poly.quant.schemes import LEGACY_ENCODINGS, SCHEMES

__all__ = [
    "NATIVE_TYPES",
    "NATIVE_TARGETS",
    "native_kind",
    "keeps_native",
    "below_target",
    "row_bytes",
    "check_record",
    "put_native",
    "is_native_blob",
    "get_native",
    "check_same_blocks",
]

_T = GGMLType
# ggml type id -> encoding name (= GGUFMatrix.scheme, the poly.runtime.ckernels kind name)
NATIVE_TYPES: dict[int, str] = {  # block kinds only (float GGUF tensors are not quantized blocks)
    r.ggml_type: r.name for r in SCHEMES.values() if r.ggml_type is not None and r.block > 1
}
# Target encoding -> the native kinds kept in its place: only kinds at least as precise as the
# target (never worse than a re-bake, and never less than was asked: a q8 request from Q4_1
# blocks writes int8, see `below_target`). f32/f16/bf16 requests still dequantize.
NATIVE_TARGETS: dict[str, frozenset[str]] = {
    "loom_q4": frozenset(NATIVE_TYPES.values()),
    "int8": frozenset({"gguf_q8_0"}),
}
NATIVE_TARGETS.update({old: NATIVE_TARGETS[new] for old, new in LEGACY_ENCODINGS.items()})


def native_kind(value: Any) -> str | None:
    """The encoding name when ``value`` is a GGUFMatrix of a kept kind, else None."""
    from poly.quant.qtensor import GGUFMatrix

    if not isinstance(value, GGUFMatrix):
        return None
    return NATIVE_TYPES.get(int(value.ggml_type))


def keeps_native(encoding: str, value: Any) -> bool:
    """True when ``value``'s GGUF blocks go into a blob of ``encoding`` as they are."""
    kind = native_kind(value)
    return kind is not None and kind in NATIVE_TARGETS.get(encoding, ())


# Bits per weight of each target encoding's values (a GGUF source below it cannot fill them).
TARGET_BITS = {"loom_q4": 4, "q4_0": 4, "int8": 8, "float16": 16, "bfloat16": 16, "float32": 32}


def below_target(encoding: str, value: Any) -> str | None:
    """The GGUF kind (e.g. "Q4_1") of ``value`` when its blocks hold fewer bits per weight than
    ``encoding`` and are re-encoded into it (the output's precision cannot exceed them)."""
    from poly.quant.qtensor import GGUFMatrix

    if not isinstance(value, GGUFMatrix) or keeps_native(encoding, value):
        return None
    kind = _T(int(value.ggml_type))
    block, type_size = QUANT_SIZES[kind]
    return kind.name if type_size * 8 / block < TARGET_BITS.get(encoding, 0) else None


def row_bytes(ggml_type: int, n_in: int) -> int:
    """Bytes of one row of ``n_in`` weights (EntityFormatError for a kind or length we refuse)."""
    check_record(ggml_type, "uint8", [0, 0])
    block, type_size = QUANT_SIZES[_T(ggml_type)]
    if n_in % block:
        raise EntityFormatError(
            f"row length {n_in} is not a multiple of the {NATIVE_TYPES[ggml_type]} block {block}"
        )
    return n_in // block * type_size


def check_record(ggml_type: int, dtype: str, shape: list[int]) -> None:
    """Container-level check of a native blob record: uint8 [out, whole blocks], known kind."""
    if ggml_type not in NATIVE_TYPES:
        known = ", ".join(n[5:].upper() for n in NATIVE_TYPES.values())
        raise EntityFormatError(
            f"ggml type {ggml_type} is not a native block kind ({known}) (quant_type)"
        )
    type_size = QUANT_SIZES[_T(ggml_type)][1]
    if dtype != "uint8" or len(shape) != 2 or shape[1] % type_size:
        raise EntityFormatError(
            f"{NATIVE_TYPES[ggml_type]} blob must be uint8 [out, k × {type_size}], "
            f"got {dtype} {shape} (size_mismatch)"
        )


def put_native(w: Any, name: str, out) -> str:
    """Append ``w``'s GGUF rows as one blob ``name``; returns the encoding name."""
    kind = native_kind(w)
    if kind is None:
        raise EntityFormatError(f"{name}: {w!r} is not a native GGUF block matrix")
    out.add(name, np.ascontiguousarray(w.raw), ggml_type=int(w.ggml_type))
    return kind


def is_native_blob(ef, name: str) -> bool:
    rec = ef.blobs.get(name)
    return rec is not None and rec.ggml_type is not None


def get_native(ef, name: str, shape) -> Any:
    """The blob as a GGUFMatrix [out, in] (a view on the mapping), checked against ``shape``."""
    from poly.quant.qtensor import GGUFMatrix

    rec = ef.blobs[name]
    out_dim, n_in = (int(d) for d in shape)
    want = [out_dim, row_bytes(rec.ggml_type, n_in)]
    if list(rec.shape) != want:
        raise EntityFormatError(
            f"{name}: {NATIVE_TYPES[rec.ggml_type]} blob {rec.shape}, the model needs {want} "
            f"for a [{out_dim}, {n_in}] matrix (size_mismatch)",
            path=ef.path,
        )
    return GGUFMatrix(ef.array(name), rec.ggml_type, (out_dim, n_in))


def check_same_blocks(name: str, ref: Any, got: Any, path: str | None = None) -> None:
    """IntegrityError unless two native matrices hold the same kind, shape and bytes."""
    same = (
        int(ref.ggml_type) == int(got.ggml_type)
        and tuple(ref.shape) == tuple(got.shape)
        and np.array_equal(ref.raw, got.raw)
    )
    if not same:
        raise IntegrityError(
            f"{name}: stored GGUF blocks differ from the source (roundtrip)", path=path
        )

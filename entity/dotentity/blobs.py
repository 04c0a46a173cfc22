"""Which blobs a transformer is made of in a `.entity` v2, and how each one is encoded.

Blob names: `blocks.<i>.<role>` (role = attn_norm | attn | mlp_norm | mlp) holds a layer's whole
float32 master in the f32 scheme (loaded zero-copy as the master itself); the other schemes store
one blob per component, `blocks.<i>.<role>.<name>` (names of `poly.nn.layout`), with encoded matrices
split into parts (`.codes`/`.scales` for int8, `.scales`/`.packed` for q4_0), or one blob of GGUF
block rows when a q4/q8 source matrix already is GGUF blocks (`entity.dotentity.native_blocks`). Globals:
`embeddings`, `lm_head` (absent when tied), `final_norm`. Byte layouts: docs/formats.md.

Shared by the writer (`write`) and the reader (`read`): the quant schemes and, per encoding, how a float32 matrix becomes blobs and back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from entity.dotentity.container import BLOB_DTYPES, EntityFile, EntityWriter
from entity.dotentity.native_blocks import get_native, is_native_blob, keeps_native, put_native
from poly.dtypes import DType, Encoded
from poly.errors import EntityFormatError, LayerConfigError, UsageError
from poly.quant import schemes as quant_schemes
from poly.quant.qtensor import CodedMatrix, Q4Matrix, QTensor

__all__ = [
    "SCHEMES",
    "ENCODINGS",
    "EMBED_ALIASES",
    "embed_keep_as",
    "check_quant",
    "put_matrix",
    "read_matrix",
    "read_vector",
    "as_float",
    "role_layer",
]

# --quant name -> (matrix encoding, default embeddings/LM-head encoding), from the scheme records
# (poly.quant.schemes): 8-bit LM head for the quantized schemes (as llama.cpp's Q4 files do): it
# is the largest matrix read per token.
SCHEMES: dict[str, tuple[str, str]] = {
    r.cli: (r.entity, r.embed) for r in quant_schemes.SCHEMES.values() if r.cli
}
EMBED_ALIASES = {r.cli: r.entity for r in quant_schemes.SCHEMES.values() if r.cli}


# --- encodings: how one float32 matrix becomes blobs, and back ------------------------------------


def _put_cast(dtype):
    return lambda w, name, out: out.add(name, np.asarray(w, np.float32).astype(_dtype(dtype)))


def _dtype(dtype) -> np.dtype:
    """numpy's dtype of an encoding's dense blobs; a name (bfloat16: ml_dtypes, imported then)
    through the blob table."""
    return BLOB_DTYPES[dtype] if isinstance(dtype, str) else np.dtype(dtype)


def _put_int8(w, name, out) -> None:
    enc = CodedMatrix.encode(w, DType.INT8).encoded  # per-row symmetric scales max|w|/127
    out.add(f"{name}.codes", enc.codes)
    out.add(f"{name}.scales", enc.scales.astype(np.float32))


def _put_q4(w, name, out) -> None:
    q = Q4Matrix.quantize(w)
    out.add(f"{name}.scales", q.scales)
    out.add(f"{name}.packed", q.packed)


def _get_dense(ef: EntityFile, name: str, shape) -> np.ndarray:
    return ef.array(name)


def _get_int8(ef: EntityFile, name: str, shape) -> QTensor:
    codes, scales = ef.array(f"{name}.codes"), ef.array(f"{name}.scales")
    if codes.dtype != np.int8 or codes.shape != tuple(shape) or scales.shape != (shape[0],):
        raise EntityFormatError(f"{name}: int8 parts do not match shape {shape} (dtype_role)")
    return CodedMatrix(
        Encoded(DType.INT8, tuple(shape), codes, scales.astype(np.float32, copy=False))
    )


def _get_q4(ef: EntityFile, name: str, shape) -> QTensor:
    scales, packed = ef.array(f"{name}.scales"), ef.array(f"{name}.packed")
    if not np.isfinite(scales).all():
        raise EntityFormatError(f"{name}: non-finite Q4 block scale")
    try:
        return Q4Matrix(scales, packed, tuple(shape))
    except LayerConfigError as exc:
        raise EntityFormatError(f"{name}: {exc} (block_count)") from exc


# encoding -> (writer, reader, numpy dtype of a dense blob or None)
ENCODINGS: dict[str, tuple[Callable, Callable, Any]] = {
    "float32": (_put_cast(np.float32), _get_dense, np.float32),
    "float16": (_put_cast(np.float16), _get_dense, np.float16),
    "bfloat16": (_put_cast("bfloat16"), _get_dense, "bfloat16"),
    "int8": (_put_int8, _get_int8, None),
    "loom_q4": (_put_q4, _get_q4, None),
}
# files written before Loom's bake was named loom_q4 say "q4_0"
ENCODINGS.update({old: ENCODINGS[new] for old, new in quant_schemes.LEGACY_ENCODINGS.items()})


def read_matrix(ef: EntityFile, encoding: str, name: str, shape) -> Any:
    if is_native_blob(ef, name):  # GGUF blocks kept as they were (any scheme may hold them)
        return get_native(ef, name, shape)
    _, get, dense = ENCODINGS[encoding]
    value = get(ef, name, shape)
    if dense is not None and (value.dtype != _dtype(dense) or value.shape != tuple(shape)):
        raise EntityFormatError(
            f"{name}: stored {value.dtype} {value.shape}, header says {encoding} {tuple(shape)} "
            "(dtype_role)",
            path=ef.path,
        )
    return value


def read_vector(ef: EntityFile, name: str, n: int) -> np.ndarray:
    v = ef.array(name)
    if v.dtype != np.float32 or v.shape != (n,):
        raise EntityFormatError(f"{name}: expected float32 [{n}], got {v.dtype} {v.shape}")
    return v


def as_float(table) -> np.ndarray:
    return table.dequantize() if isinstance(table, QTensor) else np.asarray(table, np.float32)


def put_matrix(
    out: EntityWriter, w: Any, name: str, enc: str, kept: set[str], keep_as: str | None = None
) -> None:
    """One matrix in encoding ``enc``; kept native when it already is GGUF blocks at least as
    precise as ``keep_as`` (default ``enc``; re-quantizing would round twice), else encoded."""
    if keeps_native(keep_as or enc, w):
        kept.add(put_native(w, name, out))
    else:
        ENCODINGS[enc][0](as_float(w), name, out)


def embed_keep_as(quant: str, embed_quant: str | None) -> str:
    """The encoding whose precision GGUF embedding/LM-head blocks must reach to be kept: the
    scheme's matrix encoding (a q4 file keeps a Q4_0 head), or the one ``embed_quant`` asks."""
    return SCHEMES[quant][0] if embed_quant is None else check_quant(quant, embed_quant)[1]


def check_quant(quant: str, embed_quant: str | None) -> tuple[str, str]:
    if quant not in SCHEMES:
        raise UsageError(f"unknown quant {quant!r}; choose one of {sorted(SCHEMES)}")
    matrix_enc, embed_enc = SCHEMES[quant]
    if embed_quant is not None:
        embed_enc = EMBED_ALIASES.get(embed_quant, embed_quant)
        if embed_enc not in ENCODINGS:
            raise UsageError(f"unknown embed_quant {embed_quant!r}")
    return matrix_enc, embed_enc


# --- roles: a block's four layers and the shapes of their components ------------------------------


def role_layer(tf, i: int, role: str):
    return tf.role(i, role)

"""Transformer <-> `.entity` v2: which blobs a model is made of, in which encoding.

Blob names: `blocks.<i>.<role>` (role = attn_norm | attn | mlp_norm | mlp) holds a layer's whole
float32 master in the f32 scheme (loaded zero-copy as the master itself); the other schemes store
one blob per component, `blocks.<i>.<role>.<name>` (names of `poly.layout`), with encoded matrices
split into parts (`.codes`/`.scales` for int8, `.scales`/`.packed` for q4_0), or one blob of GGUF
block rows when a q4/q8 source matrix already is GGUF blocks (`entity.native_blocks`). Globals:
`embeddings`, `lm_head` (absent when tied), `final_norm`. Byte layouts: docs/formats.md.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import ml_dtypes
import numpy as np

from entity.entity_format import EntityFile, EntityWriter, read_prefix
from entity.native_blocks import NATIVE_TARGETS, get_native, is_native_blob, native_kind, put_native
from poly import layout
from poly.config import TransformerConfig
from poly.dtypes import DType, Encoded
from poly.errors import EntityFormatError, LayerConfigError, PolyError, UsageError
from poly.qtensor import CodedMatrix, Q4Matrix, QTensor

__all__ = ["save_entity", "load_entity", "write_entity", "SCHEMES", "ENCODINGS", "ROLES"]

ROLES = ("attn_norm", "attn", "mlp_norm", "mlp")
NORM_ROLES = frozenset({"attn_norm", "mlp_norm"})
# quant scheme -> (matrix encoding, default embeddings/LM-head encoding)
SCHEMES: dict[str, tuple[str, str]] = {
    "f32": ("float32", "float32"),
    "f16": ("float16", "float16"),
    "bf16": ("bfloat16", "bfloat16"),
    # 8-bit LM head for the quantized schemes (as llama.cpp's Q4 files do): it is the largest
    # matrix read per token.
    "q8": ("int8", "int8"),
    "q4": ("q4_0", "int8"),
}
EMBED_ALIASES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "q8": "int8", "q4": "q4_0"}
Progress = Callable[[int, int, str], None]


# --- encodings: how one float32 matrix becomes blobs, and back ------------------------------------


def _put_cast(dtype):
    return lambda w, name, out: out.add(name, np.asarray(w, np.float32).astype(dtype))


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
    "bfloat16": (_put_cast(ml_dtypes.bfloat16), _get_dense, ml_dtypes.bfloat16),
    "int8": (_put_int8, _get_int8, None),
    "q4_0": (_put_q4, _get_q4, None),
}


def _read_matrix(ef: EntityFile, encoding: str, name: str, shape) -> Any:
    if is_native_blob(ef, name):  # GGUF blocks kept as they were (any scheme may hold them)
        return get_native(ef, name, shape)
    _, get, dense = ENCODINGS[encoding]
    value = get(ef, name, shape)
    if dense is not None and (value.dtype != np.dtype(dense) or value.shape != tuple(shape)):
        raise EntityFormatError(
            f"{name}: stored {value.dtype} {value.shape}, header says {encoding} {tuple(shape)} "
            "(dtype_role)",
            path=ef.path,
        )
    return value


def _read_vector(ef: EntityFile, name: str, n: int) -> np.ndarray:
    v = ef.array(name)
    if v.dtype != np.float32 or v.shape != (n,):
        raise EntityFormatError(f"{name}: expected float32 [{n}], got {v.dtype} {v.shape}")
    return v


# --- model description ------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """Layer/config field values as msgpack-friendly data (enums by label)."""
    if isinstance(value, enum.Enum):
        return getattr(value, "label", value.name.lower())
    if isinstance(value, dict):
        return {str(_plain(k)): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, np.generic):
        return value.item()
    return value


_SKIP_FIELDS = frozenset({"weights", "allocate", "state", "sequential_layers"})


def layer_spec(layer) -> dict[str, Any]:
    """Every field of a layer (dims, dtype, eps, rope, tile maps), sub-layers recursively."""
    spec = {
        f.name: _plain(getattr(layer, f.name))
        for f in dataclasses.fields(layer)
        if f.name not in _SKIP_FIELDS
    }
    spec["sequential_layers"] = [layer_spec(s) for s in layer.sequential_layers]
    return spec


def network_spec(tf) -> dict[str, Any]:
    net = tf.network
    dims = {k: getattr(net, k) for k in ("depth", "rows", "cols", "layers_per_cell")}
    return {**dims, "layers": [layer_spec(layer) for layer in net.layers]}


def _role_layer(tf, i: int, role: str):
    return getattr(tf, role)(i)


def _role_shapes(cfg: TransformerConfig, role: str) -> dict[str, tuple[int, ...]]:
    """Component shapes per role, in master order (poly.layout field order)."""
    d, q, kv, inter = cfg.hidden_size, cfg.query_dim, cfg.kv_dim, cfg.intermediate_size
    if role in NORM_ROLES:
        return {"gamma": (d,)}
    if role == "attn":
        shapes = {"w_q": (q, d), "w_k": (kv, d), "w_v": (kv, d), "w_o": (d, q),
                  "b_q": (q,), "b_k": (kv,), "b_v": (kv,), "b_o": (d,)}  # fmt: skip
        if cfg.qk_norm:
            shapes.update(q_norm=(cfg.head_dim,), k_norm=(cfg.head_dim,))
        return shapes
    return {"w_gate": (inter, d), "w_up": (inter, d), "w_down": (d, inter),
            "b_gate": (inter,), "b_up": (inter,), "b_down": (d,)}  # fmt: skip


def float_components(layer) -> dict[str, np.ndarray]:
    """A layer's components as float32 arrays (dequantizing stored versions)."""
    out = {}
    for name, value in layout.components(layer).items():
        if value is None:
            continue
        out[name] = (
            value.dequantize() if isinstance(value, QTensor) else np.asarray(value, np.float32)
        )
    return out


def source_components(layer) -> dict[str, Any]:
    """Like `float_components`, but GGUF block matrices of a native kind stay as they are (the
    writer keeps them for q4/q8 and dequantizes them for the float schemes)."""
    out = {}
    for name, value in layout.components(layer).items():
        if value is not None:
            out[name] = value if native_kind(value) else _as_float(value)
    return out


def model_blocks(tf) -> Iterator[tuple[int, dict[str, dict[str, Any]]]]:
    """(i, {role: components}) for each block: float32 arrays, or native GGUF block matrices."""
    for i in range(tf.config.num_layers):
        yield i, {role: source_components(_role_layer(tf, i, role)) for role in ROLES}


def _as_float(table) -> np.ndarray:
    return table.dequantize() if isinstance(table, QTensor) else np.asarray(table, np.float32)


def _put_matrix(out: EntityWriter, w: Any, name: str, enc: str, kept: set[str]) -> None:
    """One matrix in encoding ``enc``; kept native when it already is GGUF blocks and ``enc``
    quantizes anyway (re-quantizing would round twice)."""
    if enc in NATIVE_TARGETS and native_kind(w):
        kept.add(put_native(w, name, out))
    else:
        ENCODINGS[enc][0](_as_float(w), name, out)


# --- writing ----------------------------------------------------------------------------------


def _write_block(
    out: EntityWriter, cfg, i: int, comps: dict, matrix_enc: str, kept: set[str]
) -> None:
    for role in ROLES:
        shapes = _role_shapes(cfg, role)
        got = dict(comps.get(role, {}))
        for name, shape in shapes.items():
            if name not in got and name.startswith("b_"):  # e.g. HF llama: no biases = zeros
                got[name] = np.zeros(shape, np.float32)
            if name not in got or tuple(np.shape(got[name])) != shape:
                raise LayerConfigError(f"block {i} {role}.{name}: expected shape {shape}")
        base = f"blocks.{i}.{role}"
        if matrix_enc == "float32":  # the whole master, in layout order
            master = [np.ravel(_as_float(got[n])) for n in shapes]
            out.add(base, np.concatenate(master).astype(np.float32))
            continue
        for name, shape in shapes.items():
            if len(shape) == 2:
                _put_matrix(out, got[name], f"{base}.{name}", matrix_enc, kept)
            else:
                out.add(f"{base}.{name}", np.asarray(got[name], np.float32))


def _check_quant(quant: str, embed_quant: str | None) -> tuple[str, str]:
    if quant not in SCHEMES:
        raise UsageError(f"unknown quant {quant!r}; choose one of {sorted(SCHEMES)}")
    matrix_enc, embed_enc = SCHEMES[quant]
    if embed_quant is not None:
        embed_enc = EMBED_ALIASES.get(embed_quant, embed_quant)
        if embed_enc not in ENCODINGS:
            raise UsageError(f"unknown embed_quant {embed_quant!r}")
    return matrix_enc, embed_enc


def write_entity(
    path: str | os.PathLike,
    cfg: TransformerConfig,
    blocks: Iterable[tuple[int, dict[str, dict[str, np.ndarray]]]],
    globals_: Callable[[], tuple[Any, Any, np.ndarray]],
    meta: dict[str, Any],
    *,
    quant: str = "f32",
    embed_quant: str | None = None,
    force: bool = False,
    inputs: Iterable = (),
    progress: Progress | None = None,
) -> os.PathLike:
    """Stream a model into a `.entity`: one block in memory at a time, globals last.

    ``globals_()`` returns (embeddings, lm_head or None when tied, final_norm); ``meta`` holds the
    header keys other than quant/blobs (network, transformer, tokenizer, ...).
    """
    matrix_enc, embed_enc = _check_quant(quant, embed_quant)
    total = cfg.num_layers + 2
    tick = progress or (lambda done, total, detail: None)
    kept: set[str] = set()  # native GGUF encodings written
    with EntityWriter(path, force=force, inputs=inputs) as out:
        for i, comps in blocks:
            _write_block(out, cfg, i, comps, matrix_enc, kept)
            tick(i + 1, total, f"packed block {i + 1}/{cfg.num_layers}")
        emb, head, final = globals_()
        _put_matrix(out, emb, "embeddings", embed_enc, kept)
        if head is not None:
            _put_matrix(out, head, "lm_head", embed_enc, kept)
        out.add("final_norm", np.asarray(final, np.float32))
        tick(total - 1, total, "writing .entity")
        quant_meta = {"scheme": quant, "matrix": matrix_enc, "embeddings": embed_enc,
                      "vectors": "float32", "q4_block": 32}  # fmt: skip
        if kept:  # only then: other files stay byte-identical to older writers' output
            quant_meta["native"] = sorted(kept)
        done = out.finish({**meta, "quant": quant_meta})
        tick(total, total, "done")
    return done


def model_meta(tf, cfg: TransformerConfig | None = None) -> dict[str, Any]:
    """Header metadata of a Transformer: specs, tokenizer, template, EOS, generation, source."""
    cfg = cfg or tf.config
    tok, tmpl, gen = tf.tokenizer, tf.chat_template, tf.generation_defaults
    tok_cfg = {}
    if tok is not None:
        tok_cfg.update(bos_token=tok.bos_token, eos_token=tok.eos_token)
    if tmpl is not None:
        tok_cfg["template"] = {
            "bos_token": tmpl.bos_token,
            "eos_token": tmpl.eos_token,
            "name": tmpl.name,
        }
    transformer = {**_plain(cfg.to_dict()), "tied": bool(cfg.tie_word_embeddings)}
    return {
        "network": network_spec(tf),
        "transformer": transformer,
        "tokenizer": None if tok is None else tok.to_str(),
        "tokenizer_config": tok_cfg,
        "chat_template": None if tmpl is None else tmpl.source,
        "generation_config": {} if gen is None else _plain(dataclasses.asdict(gen)),
        "eos_token_ids": [int(t) for t in tf.eos_token_ids],
        "source": _plain(dict(tf.source or {})),
    }


def save_entity(
    tf,
    path: str | os.PathLike,
    *,
    quant: str = "f32",
    embed_quant: str | None = None,
    force: bool = False,
    progress: Progress | None = None,
    inputs: Iterable = (),
) -> os.PathLike:
    """Write Transformer ``tf`` as a self-contained `.entity` v2 file (see docs/formats.md)."""
    cfg = dataclasses.replace(tf.config, tie_word_embeddings=bool(tf.tied))
    final = np.asarray(tf.final_norm, np.float32)
    return write_entity(
        path, cfg, model_blocks(tf), lambda: (tf.embeddings, None if tf.tied else tf.lm_head, final),
        model_meta(tf, cfg), quant=quant, embed_quant=embed_quant, force=force, inputs=inputs,
        progress=progress,
    )  # fmt: skip


# --- reading ----------------------------------------------------------------------------------


def _config(ef: EntityFile, max_seq_len: int | None) -> TransformerConfig:
    spec = dict(ef.meta("transformer"))
    spec.pop("tied", None)
    try:
        cfg = TransformerConfig.from_dict(spec)
        if max_seq_len is not None:
            cfg = dataclasses.replace(cfg, max_seq_len=int(max_seq_len))
        return cfg
    except (PolyError, TypeError, ValueError) as exc:
        raise EntityFormatError(f"bad transformer spec: {exc}", path=ef.path) from exc


def _install_block(tf, ef: EntityFile, i: int, matrix_enc: str) -> None:
    cfg = tf.config
    for role in ROLES:
        layer, shapes, base = (
            _role_layer(tf, i, role),
            _role_shapes(cfg, role),
            f"blocks.{i}.{role}",
        )
        if matrix_enc == "float32":
            layer.weights.master = _read_vector(ef, base, layer.weights.size)  # zero-copy master
            continue
        if role in NORM_ROLES:
            layer.weights.master = _read_vector(ef, f"{base}.gamma", cfg.hidden_size)
            continue
        comps = {
            name: _read_matrix(ef, matrix_enc, f"{base}.{name}", shape)
            if len(shape) == 2
            else _read_vector(ef, f"{base}.{name}", shape[0])
            for name, shape in shapes.items()
        }
        matrices = [comps[n] for n, shape in shapes.items() if len(shape) == 2]
        layer.weights.set_version(_version_name(matrices, matrix_enc), comps)


def _version_name(matrices: list, matrix_enc: str) -> str:
    """The stored version's name: its matrices' encodings (what `lucy inspect` shows as active),
    e.g. "q4_0", "gguf_q4_1", or "gguf_q4_1+gguf_q6_k" for a mixed GGUF source."""
    return "+".join(sorted({native_kind(m) or matrix_enc for m in matrices}))


def _attach_meta(tf, ef: EntityFile) -> None:
    from poly.chat import ChatTemplate
    from poly.sampling import GenOptions
    from poly.tokenizer import Tokenizer

    tok_cfg = ef.meta("tokenizer_config")
    text = ef.meta("tokenizer")
    if text is not None:
        special = {k: tok_cfg.get(k) for k in ("bos_token", "eos_token") if tok_cfg.get(k)}
        tf.tokenizer = Tokenizer.from_str(text, path=ef.path, **special)
    source = ef.meta("chat_template")
    if source is not None:
        tf.chat_template = ChatTemplate(source, **(tok_cfg.get("template") or {}))
    tf.eos_token_ids = tuple(ef.meta("eos_token_ids"))
    gen = ef.meta("generation_config")
    if gen:
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in gen.items()}
        tf.generation_defaults = GenOptions(**fields)
    quant = ef.meta("quant")
    tf.source = dict(ef.meta("source"), entity_path=ef.path, quant=quant["scheme"])
    if quant.get("native"):
        tf.source["native_blocks"] = list(quant["native"])


def load_entity(
    path: str | os.PathLike, *, verify: bool | str = True, max_seq_len: int | None = None
):
    """Load a `.entity` (v2, or Loom's v1) as a `poly.Transformer`.

    v2 weights are zero-copy views on one read-only mmap: f32 masters, or f16/bf16/int8/Q4 stored
    versions (no float32 copy of quantized matrices). ``verify``: see `EntityFile`.
    """
    with open(path, "rb") as f:
        if read_prefix(f, str(path))[0] == 1:
            from entity.entity_v1 import load_entity_v1

            return load_entity_v1(path, max_seq_len=max_seq_len)
    from poly.transformer import Transformer

    ef = EntityFile(path, verify=verify)
    cfg = _config(ef, max_seq_len)
    quant = ef.meta("quant")
    matrix_enc, embed_enc = quant.get("matrix"), quant.get("embeddings")
    if matrix_enc not in ENCODINGS or embed_enc not in ENCODINGS:
        raise EntityFormatError(f"unknown encodings {matrix_enc!r}/{embed_enc!r}", path=ef.path)
    tied = bool(ef.meta("transformer").get("tied", cfg.tie_word_embeddings))
    has_head = any(n == "lm_head" or n.startswith("lm_head.") for n in ef.blobs)
    if tied == has_head:
        raise EntityFormatError("tied flag and lm_head blob disagree", path=ef.path)
    try:
        tf = Transformer.from_config(cfg, allocate=False)
        for i in range(cfg.num_layers):
            _install_block(tf, ef, i, matrix_enc)
        vh = (cfg.vocab_size, cfg.hidden_size)
        tf.embeddings = _read_matrix(ef, embed_enc, "embeddings", vh)
        if not tied:
            tf.lm_head = _read_matrix(ef, embed_enc, "lm_head", vh)
        tf.final_norm = _read_vector(ef, "final_norm", cfg.hidden_size)
        _attach_meta(tf, ef)
    except EntityFormatError as exc:
        exc.path = exc.path or ef.path
        raise
    except (LayerConfigError, TypeError, ValueError) as exc:
        raise EntityFormatError(f"inconsistent .entity: {exc}", path=ef.path) from exc
    tf.entity_file = ef  # keeps the mapping (and its header) reachable
    return tf

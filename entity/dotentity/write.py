"""Transformer -> `.entity` v2: the header metadata (network and transformer specs), the
components of each block, and the streaming writer.

Which blobs a model is made of, and their encodings: `blobs`. The reader: `read`; the roles and
their shapes: `entity.arch`.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from entity.arch import global_shapes, role_shapes, roles
from entity.dotentity.blobs import as_float, check_quant, embed_keep_as, put_matrix, role_layer
from entity.dotentity.container import EntityWriter
from entity.dotentity.moe import is_sparse, moe_components, write_moe
from entity.dotentity.native_blocks import native_kind
from poly.config import TransformerConfig
from poly.errors import LayerConfigError
from poly.layer import LayerType
from poly.nn import layout
from poly.quant.qtensor import QTensor

__all__ = ["save_entity", "write_entity", "model_meta", "model_blocks", "source_components"]

Progress = Callable[[int, int, str], None]


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
            out[name] = value if native_kind(value) else as_float(value)
    return out


def final_norm_master(tf) -> np.ndarray:
    """The output vectors as the "final_norm" blob holds them: the final norm's gamma, then its
    beta for a LayerNorm with a bias, then the LM head's bias when it has one (the entries
    `entity.arch.global_shapes` lists: final_norm_bias, lm_head_bias)."""
    table = global_shapes(tf.config)
    parts = [tf.final_norm]
    if "final_norm_bias" in table:
        parts.append(tf.final_norm_bias)
    if "lm_head_bias" in table:
        parts.append(tf.lm_head_bias)
    return np.concatenate([np.asarray(p, np.float32) for p in parts])


def model_blocks(tf) -> Iterator[tuple[int, dict[str, dict[str, Any]]]]:
    """(i, {role: components}) for each block: float32 arrays, or native GGUF block matrices."""
    for i in range(tf.config.num_layers):
        layers = {role: role_layer(tf, i, role) for role in roles(tf.config)}
        yield (
            i,
            {
                role: moe_components(layer, source_components)
                if layer.type == LayerType.MOE
                else source_components(layer)
                for role, layer in layers.items()
            },
        )


# --- writing ----------------------------------------------------------------------------------


def _write_block(
    out: EntityWriter, cfg, i: int, comps: dict, matrix_enc: str, kept: set[str]
) -> None:
    for role in roles(cfg):
        if role == "mlp" and is_sparse(cfg, i):
            write_moe(out, cfg, i, dict(comps.get(role, {})), matrix_enc, kept)
            continue
        shapes = role_shapes(cfg, role)
        got = dict(comps.get(role, {}))
        for name, shape in shapes.items():
            # no biases = zeros (HF llama), and no beta for a LayerNorm without one (Cohere)
            if name not in got and (name.startswith("b_") or name == "beta"):
                got[name] = np.zeros(shape, np.float32)
            if name not in got or tuple(np.shape(got[name])) != shape:
                raise LayerConfigError(f"block {i} {role}.{name}: expected shape {shape}")
        base = f"blocks.{i}.{role}"
        if matrix_enc == "float32":  # the whole master, in layout order
            master = [np.ravel(as_float(got[n])) for n in shapes]
            out.add(base, np.concatenate(master).astype(np.float32))
            continue
        for name, shape in shapes.items():
            if len(shape) == 2:
                put_matrix(out, got[name], f"{base}.{name}", matrix_enc, kept)
            else:
                out.add(f"{base}.{name}", np.asarray(got[name], np.float32))


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
    matrix_enc, embed_enc = check_quant(quant, embed_quant)
    total = cfg.num_layers + 2
    tick = progress or (lambda done, total, detail: None)
    kept: set[str] = set()  # native GGUF encodings written
    with EntityWriter(path, force=force, inputs=inputs) as out:
        for i, comps in blocks:
            _write_block(out, cfg, i, comps, matrix_enc, kept)
            tick(i + 1, total, f"packed block {i + 1}/{cfg.num_layers}")
        emb, head, final = globals_()
        keep_as = embed_keep_as(quant, embed_quant)
        put_matrix(out, emb, "embeddings", embed_enc, kept, keep_as)
        if head is not None:
            put_matrix(out, head, "lm_head", embed_enc, kept, keep_as)
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
        "generation_config": _plain(dict(getattr(gen, "settings", None) or {})),
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
    final = final_norm_master(tf)
    return write_entity(
        path, cfg, model_blocks(tf), lambda: (tf.embeddings, None if tf.tied else tf.lm_head, final),
        model_meta(tf, cfg), quant=quant, embed_quant=embed_quant, force=force, inputs=inputs,
        progress=progress,
    )  # fmt: skip

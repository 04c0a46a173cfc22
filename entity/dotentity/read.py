"""`.entity` -> `poly.Transformer`: `load_entity` (v2 here; Loom's v1 files go to `v1`).

Blob names and encodings are `blobs`'; the writer is `write`.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from entity.arch import NORM_ROLES, global_shapes, role_shapes, roles
from entity.checks import check_eos_ids
from entity.dotentity.blobs import ENCODINGS, read_matrix, read_vector, role_layer
from entity.dotentity.container import EntityFile
from entity.dotentity.header import read_prefix
from entity.dotentity.moe import attach_pager, install_moe, is_sparse
from entity.dotentity.native_blocks import native_kind
from poly.config import LIMITS, TransformerConfig
from poly.errors import EntityFormatError, LayerConfigError, LimitExceededError, PolyError

__all__ = ["load_entity"]


# As for HF and GGUF: the file's max_seq_len is the model's context; the KV cache (preallocated)
# defaults to at most DEFAULT_CONTEXT unless the caller asks for more. 2^22 cost 3.26 GB for
# 3 tokens; 2^40 ended in a raw MemoryError.
DEFAULT_CONTEXT = 4096
MAX_CONTEXT = LIMITS["max_seq_len"]  # the table of every format (poly.config.LIMITS)


def _config(ef: EntityFile, max_seq_len: int | None) -> TransformerConfig:
    spec = dict(ef.meta("transformer"))
    spec.pop("tied", None)
    seq = spec.get("max_seq_len")
    if type(seq) is int and seq > MAX_CONTEXT:
        raise LimitExceededError(
            f"transformer.max_seq_len {seq} exceeds {MAX_CONTEXT}", path=ef.path
        )
    try:
        cfg = TransformerConfig.from_dict(spec)
        want = min(cfg.max_seq_len, DEFAULT_CONTEXT) if max_seq_len is None else int(max_seq_len)
        return dataclasses.replace(cfg, max_seq_len=want)
    except LimitExceededError as exc:  # a count past poly.config.LIMITS: nothing was built
        exc.path = ef.path
        raise
    except (PolyError, TypeError, ValueError) as exc:
        raise EntityFormatError(f"bad transformer spec: {exc}", path=ef.path) from exc


def _install_block(tf, ef: EntityFile, i: int, matrix_enc: str) -> None:
    cfg = tf.config
    for role in roles(cfg):
        if role == "mlp" and is_sparse(cfg, i):
            install_moe(tf.mlp(i), ef, i, matrix_enc)
            continue
        layer, shapes, base = (
            role_layer(tf, i, role),
            role_shapes(cfg, role),
            f"blocks.{i}.{role}",
        )
        if matrix_enc == "float32":
            layer.weights.master = read_vector(ef, base, layer.weights.size)  # zero-copy master
            continue
        if role in NORM_ROLES:  # gamma (RMSNorm), gamma then beta (LayerNorm): the master
            parts = [read_vector(ef, f"{base}.{n}", s[0]) for n, s in shapes.items()]
            layer.weights.master = parts[0] if len(parts) == 1 else np.concatenate(parts)
            continue
        comps = {
            name: read_matrix(ef, matrix_enc, f"{base}.{name}", shape)
            if len(shape) == 2
            else read_vector(ef, f"{base}.{name}", shape[0])
            for name, shape in shapes.items()
        }
        matrices = [comps[n] for n, shape in shapes.items() if len(shape) == 2]
        layer.weights.set_version(_version_name(matrices, matrix_enc), comps)


def _version_name(matrices: list, matrix_enc: str) -> str:
    """The stored version's name: its matrices' encodings (what `lucy inspect` shows as active),
    e.g. "loom_q4", "gguf_q4_1", or "gguf_q4_1+gguf_q6_k" for a mixed GGUF source."""
    return "+".join(sorted({native_kind(m) or matrix_enc for m in matrices}))


def _install_globals(tf, ef: EntityFile, embed_enc: str, tied: bool) -> None:
    """The embeddings, the untied LM head and the output vectors (final norm, head bias)."""
    table = global_shapes(tf.config)
    tf.embeddings = read_matrix(ef, embed_enc, "embeddings", table["embeddings"])
    if not tied:
        tf.lm_head = read_matrix(ef, embed_enc, "lm_head", table["lm_head"])
    # the output vectors: gamma, then beta for a LayerNorm with a bias, the LM head's bias
    h, beta = table["final_norm"][0], table.get("final_norm_bias", (0,))[0]
    vb = table.get("lm_head_bias", (0,))[0]
    final = read_vector(ef, "final_norm", h + beta + vb)
    tf.final_norm = final[:h]
    if beta:
        tf.final_norm_bias = final[h : h + beta]
    if vb:
        tf.lm_head_bias[...] = final[h + beta :]


def attach_meta(tf, ef: EntityFile, text: bool = True) -> None:
    from poly.errors import SamplingParamsError
    from poly.text.chat import ChatTemplate
    from poly.text.gendefaults import GenerationDefaults
    from poly.text.tokenizer import Tokenizer

    tok_cfg = ef.meta("tokenizer_config")
    vocab = ef.header.tokenizer if text else None  # its UTF-8 bytes: hashed, not decoded
    if vocab is not None:
        special = {k: tok_cfg.get(k) for k in ("bos_token", "eos_token") if tok_cfg.get(k)}
        tf.tokenizer = Tokenizer.from_str(vocab, path=ef.path, **special)
    source = ef.meta("chat_template") if text else None
    if source is not None:
        tf.chat_template = ChatTemplate(source, lazy=True, **(tok_cfg.get("template") or {}))
    tf.eos_token_ids = tuple(ef.meta("eos_token_ids"))
    check_eos_ids(tf.eos_token_ids, tf.config.vocab_size, path=ef.path, cls=EntityFormatError)
    try:  # files without settings (GGUF sources, older writers' {}) run with the fallback
        tf.generation_defaults = GenerationDefaults.from_file(ef.meta("generation_config"))
    except SamplingParamsError as exc:
        raise EntityFormatError(f"bad generation_config: {exc.message}", path=ef.path) from exc
    quant = ef.meta("quant")
    tf.source = dict(ef.meta("source"), entity_path=ef.path, quant=quant["scheme"])
    if quant.get("native"):
        tf.source["native_blocks"] = list(quant["native"])


def load_entity(
    path: str | os.PathLike,
    *,
    verify: bool | str = "once",
    max_seq_len: int | None = None,
    max_resident_experts: int | None = None,
    text: bool = True,
):
    """Load a `.entity` (v2, or Loom's v1) as a `poly.Transformer`.

    v2 weights are zero-copy views on the file's bytes read into memory of our own (a change of the
    file on disk cannot crash the model): f32 masters, or f16/bf16/int8/Q4 stored versions (no
    float32 copy of quantized matrices). ``verify``: see `EntityFile` (by default every blob's
    checksum at the first open of a file, not again while it is unchanged).
    ``max_resident_experts``: MoE experts stay mapped from the file, at most that many resident (LRU,
    see `poly.runtime.expert_cache`); stats in ``tf.expert_pager.report()``. ``text=False``
    leaves out the tokenizer and chat template (a tensor-parallel follower rank never tokenizes).
    """
    with open(path, "rb") as f:
        if read_prefix(f, str(path))[0] == 1:
            from entity.dotentity.v1 import load_entity_v1

            return load_entity_v1(path, max_seq_len=max_seq_len)
    from poly.model.transformer import Transformer

    ef = EntityFile(path, verify=verify, lazy_experts=max_resident_experts is not None)
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
        _install_globals(tf, ef, embed_enc, tied)
        attach_meta(tf, ef, text)
    except EntityFormatError as exc:
        exc.path = exc.path or ef.path
        raise
    except (LayerConfigError, TypeError, ValueError) as exc:
        raise EntityFormatError(f"inconsistent .entity: {exc}", path=ef.path) from exc
    tf.entity_file = ef  # keeps the mapping (and its header) reachable
    if max_resident_experts is not None:
        attach_pager(tf, ef, max_resident_experts)
    return tf

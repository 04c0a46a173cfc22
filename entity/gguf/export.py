"""Write a converted model as a GGUF file llama.cpp loads unchanged (`lucy convert SRC --to gguf`).

The matrices are the converter's (the calibrated recipe's GGUF blocks, a GGUF source's blocks as
stored, float32 for f32); a matrix in an encoding GGUF has no type for (`.entity`'s own q4/q8)
is written as Q8_0 of its values. llama-arch files get llama.cpp's q/k row permutation
(convert_hf_to_gguf ``permute``; entity.gguf.loader undoes it), whole rows, so quantized rows
move as they are. Metadata: the hyper-parameters llama.cpp reads for the plain pre-norm block
families (llama, mistral, qwen2, qwen3), the tokenizer (byte-level BPE: ``gpt2`` vocab, merges
and token types from tokenizer.json) and the chat template. gguf-py's GGUFWriter writes it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, BinaryIO

import numpy as np

from entity.families import GGUF_FAMILIES
from entity.gguf.loader import PERMUTED, qk_row_order
from poly.errors import UsageError
from poly.quant.ggml import GGMLType
from poly.quant.qtensor import GGUFMatrix, QTensor

__all__ = ["write_gguf", "check_exportable"]

EXPORTABLE = ("llama", "qwen2", "qwen3")  # GGUF architectures of plain pre-norm families
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER = 1, 3, 4  # llama.cpp's token types


def check_exportable(cfg) -> None:
    """UsageError unless llama.cpp reads this model from the keys written here."""
    arch = cfg.architecture
    if arch not in EXPORTABLE or cfg.moe is not None or cfg.rope_scaling is not None:
        raise UsageError(
            f"--to gguf supports plain {', '.join(EXPORTABLE)} models without rope scaling "
            f"or experts; this model is {arch}"
        )


def _inverse(order: np.ndarray) -> np.ndarray:
    inv = np.empty_like(order)
    inv[order] = np.arange(order.size)
    return inv


# convert's --quant -> the GGUF type of a float matrix no recipe chose (None: float32 / float16)
FLOAT_QUANT = {"q8": GGMLType.Q8_0, "q4": GGMLType.Q4_0}


def _tensor(w: Any, order, quant: str) -> tuple[np.ndarray, GGMLType | None, tuple]:
    """(data, raw type or None for a float array, numpy shape) in the file's row order."""
    from poly.quant.weighted import quantize

    kind = FLOAT_QUANT.get(quant, GGMLType.Q8_0) if np.ndim(w) == 2 else None
    if isinstance(w, GGUFMatrix):
        data, kind = w.raw, w.ggml_type
    elif isinstance(w, QTensor):  # an encoding GGUF has no type for: its values as Q8_0
        data, kind = (
            quantize(np.asarray(w.dequantize(), np.float32), GGMLType.Q8_0)[0],
            GGMLType.Q8_0,
        )
    elif kind is not None and quant not in ("f32", "f16", "bf16"):
        data = quantize(np.asarray(w, np.float32), kind)[0]
    else:
        kind = None
        half = quant in ("f16", "bf16") and np.ndim(w) == 2  # GGUF F16 for both half kinds
        data = np.asarray(w, np.float16 if half else np.float32)
    if order is not None:  # poly's rows -> llama.cpp's interleaved rows
        data = data[_inverse(order)] if data.ndim == 2 else data.reshape(-1)[_inverse(order)]
    return np.ascontiguousarray(data), kind, tuple(np.shape(w))


def _hparams(writer, cfg, vocab: int) -> None:
    writer.add_context_length(int(cfg.max_seq_len))
    writer.add_embedding_length(int(cfg.hidden_size))
    writer.add_block_count(int(cfg.num_layers))
    writer.add_feed_forward_length(int(cfg.intermediate_size))
    writer.add_head_count(int(cfg.num_heads))
    writer.add_head_count_kv(int(cfg.num_kv_heads))
    writer.add_key_length(int(cfg.head_dim))
    writer.add_value_length(int(cfg.head_dim))
    writer.add_rope_dimension_count(int(cfg.head_dim))
    writer.add_rope_freq_base(float(cfg.rope_theta))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_vocab_size(vocab)


def _tokenizer(writer, meta: dict, vocab: int) -> None:
    raw = meta.get("tokenizer")
    spec = json.loads(raw) if raw else {}
    model = spec.get("model", {})
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise UsageError("--to gguf needs a byte-level BPE tokenizer (tokenizer.json model BPE)")
    tokens = [f"[PAD{i}]" for i in range(vocab)]
    types = [TOKEN_USER] * vocab  # padding rows past the tokenizer's vocab
    for text, i in model["vocab"].items():
        if i < vocab:
            tokens[i], types[i] = text, TOKEN_NORMAL
    for added in spec.get("added_tokens", []):
        if added["id"] < vocab:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = TOKEN_CONTROL if added.get("special") else TOKEN_USER
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # the pre-tokenizer changes text -> ids, never logits
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    ids = {t: i for i, t in enumerate(tokens)}
    cfg = meta.get("tokenizer_config") or {}
    bos, eos = ids.get(cfg.get("bos_token") or ""), ids.get(cfg.get("eos_token") or "")
    eos_ids = meta.get("eos_token_ids") or []
    if eos is None and eos_ids:
        eos = int(eos_ids[0])
    if bos is not None:
        writer.add_bos_token_id(bos)
    if eos is not None:
        writer.add_eos_token_id(eos)
    writer.add_add_bos_token(False)  # poly's prompts carry their own BOS (the chat template)
    if meta.get("chat_template"):
        writer.add_chat_template(meta["chat_template"])


def write_gguf(
    out: BinaryIO,
    cfg,
    meta: dict,
    blocks,
    globals_: Callable,
    quant: str = "q4",
    progress: Callable[[int, int, str], None] | None = None,
) -> None:
    """The model (convert's ``blocks`` / ``globals_`` passes) as a GGUF file into the open
    binary file ``out`` (convert's atomic temporary file, renamed over the destination)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.gguf_writer import WriterState

    check_exportable(cfg)
    family = GGUF_FAMILIES[cfg.architecture]
    names = {(t.role, t.component): t.gguf for t in family.tensors}
    orders = {}
    if family.permute_qk:
        orders = {c: qk_row_order(getattr(cfg, h), cfg.head_dim) for c, h in PERMUTED.items()}
    writer = GGUFWriter(None, cfg.architecture)
    writer.add_name(str((meta.get("source") or {}).get("path", "poly export")).rstrip("/"))
    tick = progress or (lambda done, total, detail: None)

    def add(name: str, w, order=None) -> None:
        data, kind, shape = _tensor(w, order, quant)
        if kind is None:
            writer.add_tensor(name, data)
        else:
            qtype = GGMLQuantizationType(int(kind))
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

    for i, comps in blocks:
        for role, parts in comps.items():
            for comp, w in parts.items():
                if w is None or (role, comp) not in names:
                    continue
                add(f"blk.{i}.{names[role, comp]}", w, orders.get(comp))
        tick(i + 1, cfg.num_layers + 1, f"block {i}")
    emb, head, final = globals_()
    vocab = int(np.shape(emb)[0])
    add("token_embd.weight", emb)
    add("output_norm.weight", np.asarray(final, np.float32)[: cfg.hidden_size])
    if head is not None:
        add("output.weight", head)
    _hparams(writer, cfg, vocab)
    _tokenizer(writer, meta, vocab)
    writer.fout, writer.state = [out], WriterState.EMPTY  # our file: no path, no shards
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.fout = None  # the caller closes (and renames) it
    tick(cfg.num_layers + 1, cfg.num_layers + 1, "written")

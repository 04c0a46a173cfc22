"""Load a GGUF file (llama/mistral, qwen2, qwen3) into a ``poly.Transformer``.

Matrices stay quantized as ``GGUFMatrix`` (raw blocks, dequantized per row block) unless
``keep_quantized=False``. llama-arch files store q/k rows permuted for interleaved RoPE; we undo
that by reordering whole rows, which works on raw quantized rows too.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import numpy as np

from entity.arch import NORM_ROLES, global_shapes, role_shapes, roles, stored_shape
from entity.checks import check_eos_ids
from entity.families import GGUF_FAMILIES, Family
from entity.gguf.config import LONGROPE_TENSORS, gguf_config
from entity.gguf.moe import PAGED_TENSORS, attach_pager, fill_moe
from entity.gguf.moe import required as moe_required
from entity.gguf.moe import tensor_shape as moe_tensor_shape
from entity.gguf.reader import GGUFFile
from entity.gguf.tokenizer import VOCABULARY_KEYS, load_gguf_tokenizer
from poly.errors import GGUFFormatError, PolyError, UsageError, WeightMappingError
from poly.recipe import AttentionConfig
from poly.runtime.expert_cache import check_budget
from poly.text.gendefaults import GenerationDefaults

QUANT_VERSION = "gguf"


# Components a file may leave out (biases: zeros; q/k norms: as the family says).
OPTIONAL = frozenset({"b_q", "b_k", "b_v", "b_o", "q_norm", "k_norm", "b_gate", "b_up", "b_down",
                      "q_norm_bias", "k_norm_bias"})  # fmt: skip


def layer_tensors(cfg) -> dict[str, tuple[str, str]]:
    """blk.{i}.<suffix> -> (Transformer accessor, layout component): the family's table, the
    roles its block has."""
    have = set(roles(cfg))
    table = GGUF_FAMILIES[cfg.architecture].tensors
    return {t.gguf: (t.role, t.component) for t in table if t.role in have}


def _global_names(family: Family) -> dict[str, str]:
    return {t.gguf: t.role for t in family.global_tensors}


# Whole-row reorders that undo llama.cpp's q/k permutation: component -> which head count.
PERMUTED = {"w_q": "num_heads", "b_q": "num_heads", "w_k": "num_kv_heads", "b_k": "num_kv_heads"}
# End-of-turn markers the chat templates emit; added to the stop ids when control tokens.
END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
BLOCK_NAME = re.compile(r"blk\.(\d{1,4})\.(.+)")


def fused_rows(cfg, role: str, comp: str) -> tuple[int, ...]:
    """The rows of each part of a fused component ("w_gate+w_up": GLM-4's ffn_up)."""
    shapes = role_shapes(cfg, role)
    return tuple(shapes[c][0] for c in comp.split("+"))


def _shape_of(shapes: dict, comp: str) -> tuple[int, ...]:
    parts = [shapes[c] for c in comp.split("+")]
    return (sum(p[0] for p in parts), *parts[0][1:])


def _expected_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """blk.{i}.<suffix> -> shape, from poly's layer spec (`entity.arch.role_shapes`)."""
    table = layer_tensors(cfg)
    shapes = {role: role_shapes(cfg, role) for role in {r for r, _ in table.values()}}
    with_norms = dataclasses.replace(cfg, qk_norm=True)  # q/k norm names are known for every arch
    shapes["attn"] = {**role_shapes(with_norms, "attn"), **shapes["attn"]}
    return {  # a component the config has no slot for (phi's q/k norm biases) stays unexpected
        suffix: stored_shape(cfg, comp, _shape_of(shapes[role], comp))
        for suffix, (role, comp) in table.items()
        if all(c in shapes[role] for c in comp.split("+"))
    }


def check_tensors(gg: GGUFFile, cfg) -> None:
    """Every tensor is known, every required one present, every shape right (errors name it)."""
    shapes = _expected_shapes(cfg)
    table = global_shapes(cfg)
    family = GGUF_FAMILIES[cfg.architecture]
    globals_ = {name: table[role] for name, role in _global_names(family).items()}
    rope = cfg.rope_scaling
    if rope is not None and rope.rope_type == "longrope":  # one factor per rotated pair
        pairs = (cfg.attention or AttentionConfig()).rotary_dim(cfg.head_dim, 0) // 2
        globals_.update(dict.fromkeys(LONGROPE_TENSORS, (pairs,)))
    for name, info in gg.tensors.items():
        m = BLOCK_NAME.fullmatch(name)
        moe_shape = m and moe_tensor_shape(cfg, m.group(2), gg.path)
        if m and moe_shape and int(m.group(1)) < cfg.num_layers:
            want = moe_shape
        elif m and m.group(2) in shapes and int(m.group(1)) < cfg.num_layers:
            want = shapes[m.group(2)]
        elif name in globals_:
            want = globals_[name]
        else:
            raise WeightMappingError(f"unexpected tensor {name!r}", path=gg.path)
        if info.shape != want:
            raise WeightMappingError(
                f"tensor {name!r} has shape {info.shape}, expected {want}", path=gg.path
            )
    needed = [s for s, (role, comp) in layer_tensors(cfg).items() if comp not in OPTIONAL]
    required = [
        f"blk.{i}.{s}"
        for i in range(cfg.num_layers)
        for s in needed
        if not (_sparse(cfg, i) and layer_tensors(cfg)[s][0] == "mlp")
    ]
    required += [
        n
        for i in range(cfg.num_layers)
        if _sparse(cfg, i)
        for n in moe_required(cfg, i, gg.tensors)
    ]
    if cfg.qk_norm:
        required += [f"blk.{i}.attn_{c}_norm.weight" for i in range(cfg.num_layers) for c in "qk"]
    # a LayerNorm with a bias ends in one too; Phi-2's LM head has a bias
    biases = ("final_norm_bias", "lm_head_bias")
    required += [n for n, role in _global_names(family).items() if role in biases and role in table]
    for name in ("output_norm.weight", *required):
        if name not in gg.tensors:
            raise WeightMappingError(f"missing tensor {name!r}", path=gg.path)


def _sparse(cfg, i: int) -> bool:
    return cfg.moe is not None and i not in cfg.moe.dense_layers


def qk_row_order(n_heads: int, head_dim: int) -> np.ndarray:
    """Row indices that turn llama.cpp's interleaved q/k rows back into HF's half-split order.

    convert_hf_to_gguf ``permute`` maps HF row (head, half, j) to GGUF row (head, 2*j + half)."""
    one = np.arange(head_dim).reshape(head_dim // 2, 2).T.reshape(-1)  # [2, hd/2] -> [hd]
    return (np.arange(n_heads)[:, None] * head_dim + one[None, :]).reshape(-1)  # [heads*hd]


class _Loader:
    def __init__(self, gg: GGUFFile, cfg, keep_quantized: bool):
        self.gg, self.cfg, self.keep = gg, cfg, keep_quantized
        spec = GGUF_FAMILIES[cfg.architecture]
        self.table = layer_tensors(cfg)
        self.orders = {}
        if spec.permute_qk:
            for comp, heads in PERMUTED.items():
                self.orders[comp] = qk_row_order(getattr(cfg, heads), cfg.head_dim)

    def matrix(self, name: str, comp: str) -> Any:
        from poly.quant.qtensor import GGUFMatrix
        from poly.runtime.repack import float_kmajor16_stored, ordered_rows

        info, order = self.gg.tensors[name], self.orders.get(comp)
        if not self.keep:
            w = self.gg.dequantize(name)  # [out, in]
            return w if order is None else np.ascontiguousarray(w[order])
        raw = self.gg.tensor_bytes(name)  # [out, row_bytes]
        if info.ggml_type in FLOAT_TYPES and _by16(info):  # laid out from the mapping
            w = GGUFMatrix(raw, info.ggml_type, info.shape, order)
            float_kmajor16_stored(
                w
            )  # permuted q/k rows now, in order (others when the plan is made)
            return w
        if order is not None:  # whole quantized rows reordered, the copy cached as layouts are
            return GGUFMatrix(raw, info.ggml_type, info.shape, order, ordered_rows(raw, order))
        if info.ggml_type in FLOAT_TYPES:
            raw = _on_huge_pages(self.gg, name, raw)
        return GGUFMatrix(raw, info.ggml_type, info.shape)

    def vector(self, name: str, comp: str) -> np.ndarray:
        v = self.gg.dequantize(name).reshape(-1)
        order = self.orders.get(comp)
        return np.ascontiguousarray(v if order is None else v[order], dtype=np.float32)

    def components(self, i: int, accessor: str) -> dict[str, Any]:
        out = {}
        for suffix, (acc, comp) in self.table.items():
            name = f"blk.{i}.{suffix}"
            if acc != accessor or name not in self.gg.tensors:
                continue
            if "+" in comp:  # fused rows, split whole rows (quantized ones too)
                out.update(self.split(name, comp, fused_rows(self.cfg, accessor, comp)))
                continue
            is_matrix = comp.startswith("w_")
            out[comp] = self.matrix(name, comp) if is_matrix else self.vector(name, comp)
        return out

    def split(self, name: str, comp: str, rows: tuple[int, ...]) -> dict[str, Any]:
        from poly.quant.qtensor import GGUFMatrix

        info, cuts = self.gg.tensors[name], np.cumsum(rows)[:-1]
        if len(info.shape) == 1:  # a fused bias (GPT-NeoX's attn_qkv.bias)
            v = self.gg.dequantize(name).reshape(-1).astype(np.float32)
            return dict(zip(comp.split("+"), np.split(v, cuts)))
        if not self.keep:
            parts = np.split(self.gg.dequantize(name), cuts)  # [out, in]
        else:
            raw = np.split(self.gg.tensor_bytes(name), cuts)  # [out, row_bytes] each
            shapes = [(r, info.shape[1]) for r in rows]
            parts = [GGUFMatrix(np.ascontiguousarray(b), info.ggml_type, shape)
                     for b, shape in zip(raw, shapes)]  # fmt: skip
        return dict(zip(comp.split("+"), parts))


FLOAT_TYPES = (0, 1, 30)  # ggml type ids of float32, float16, bfloat16


def _by16(info) -> bool:
    """float16/float32 rows the fused plan lays out by 16 (poly.runtime.repack.float_kmajor16):
    left on the file's mapping, whose pages the copy releases (read into memory first, they would
    be held twice)."""
    from poly.runtime import ckernels, repack

    kind = {0: ckernels.F32, 1: ckernels.F16}.get(info.ggml_type)
    return kind is not None and repack.float_kmajor16_wanted(kind, int(info.shape[0]))


def _on_huge_pages(gg: GGUFFile, name: str, raw: np.ndarray) -> np.ndarray:
    """A float tensor read off the file into 2 MB-aligned memory (huge pages where the OS offers
    them), like an HF float32 master: streamed every token, the mapping's 4 KB pages cost TLB
    misses (SmolLM2 F32 GGUF, 16-token prefill 41 -> 24 ms). Read with pread, not copied off the
    mapping, so the mapping's pages are never touched and the resident set holds the weights once."""
    from entity.gguf.pread import read_tensor
    from poly.weights import aligned_zeros

    out = aligned_zeros(raw.size, np.uint8).reshape(raw.shape)  # [out, row_bytes]
    read_tensor(gg, name, out)
    release_mapped(raw)
    return out


def release_mapped(arr: np.ndarray) -> None:
    """The file's pages of `arr` handed back (a copy of ours serves: not held twice)."""
    from poly.runtime.repack import release_mapped as release

    release(arr)


def _bias_sizes(cfg) -> dict[str, dict[str, int]]:
    """Vectors a stored version must carry even when the file has none (zeros)."""
    return {
        role: {c: shape[0] for c, shape in role_shapes(cfg, role).items() if c.startswith("b_")}
        for role in ("attn", "mlp")
    }


def _fill_layer(tf, loader: _Loader, i: int) -> None:
    from poly.nn import layout

    for accessor in NORM_ROLES.intersection(roles(loader.cfg)):
        layer = tf.role(i, accessor)
        layer.weights.ensure_master()
        views = layout.views(layer)  # gamma, and beta for a LayerNorm (zero when it has none)
        for comp, value in loader.components(i, accessor).items():
            views[comp][...] = value
    biases = _bias_sizes(loader.cfg)
    for accessor in ("attn", "mlp"):
        layer = getattr(tf, accessor)(i)
        if accessor == "mlp" and _sparse(loader.cfg, i):
            fill_moe(layer, loader, i)
            continue
        comps = loader.components(i, accessor)
        if loader.keep:
            full = {k: np.zeros(n, dtype=np.float32) for k, n in biases[accessor].items()}
            if accessor == "attn":
                full.update(q_norm=None, k_norm=None)
            full.update(comps)
            layer.weights.set_version(QUANT_VERSION, full, activate=True)
        else:
            views = layout.views(layer)
            for comp, value in comps.items():
                views[comp][...] = value


def _table(gg: GGUFFile, name: str, loader: _Loader) -> Any:
    """Embedding table: a zero-copy memmap view when stored F32; kept in its quantized blocks
    when keep_quantized (rows are dequantized on lookup, the tied LM head runs on the blocks:
    ~4x less memory and memory traffic than a float32 copy); else float32 values."""
    if gg.tensors[name].ggml_type == 0:
        return gg.tensor_array(name)
    if loader.keep:
        return loader.matrix(name, "embeddings")
    return gg.dequantize(name)


def _end_tokens(spec, template_source: str | None) -> tuple[int, ...]:
    ids = list(spec.end_token_ids)
    vocab = spec.tokenizer
    for marker in END_MARKERS:
        tid = vocab.token_to_id(marker)
        if tid is not None and template_source and marker in template_source and tid not in ids:
            ids.append(tid)
    return tuple(ids)


def _load_weights(gg: GGUFFile, cfg, keep_quantized: bool, paged: bool):
    """A ``poly.Transformer`` holding the file's weights (no tokenizer or metadata yet)."""
    from poly import Transformer

    loader = _Loader(gg, cfg, keep_quantized)
    loader.paged = paged
    try:
        tf = Transformer.from_config(cfg, allocate=not keep_quantized)
        for i in range(cfg.num_layers):
            _fill_layer(tf, loader, i)
        tf.embeddings = _table(gg, "token_embd.weight", loader)
        if not cfg.tie_word_embeddings:
            tf.lm_head = loader.matrix("output.weight", "lm_head")
        tf.final_norm = gg.dequantize("output_norm.weight")
        if "output_norm.bias" in gg.tensors and tf.final_norm_bias is not None:
            tf.final_norm_bias = gg.dequantize("output_norm.bias")
        if tf.lm_head_bias is not None:
            tf.lm_head_bias[...] = gg.dequantize("output.bias")
    except PolyError:
        raise
    except (ValueError, TypeError) as exc:  # e.g. a dequantizer rejecting bad block bytes
        raise GGUFFormatError(f"cannot load GGUF weights: {exc}", path=gg.path) from None
    return tf


def load_gguf(
    path: str | os.PathLike,
    *,
    keep_quantized: bool = True,
    max_seq_len: int | None = None,
    max_resident_experts: int | None = None,
):
    """Load a GGUF checkpoint as a ``poly.Transformer`` with its tokenizer and chat template.

    ``keep_quantized`` keeps the block matrices as ``GGUFMatrix`` (else float32 masters);
    ``max_seq_len`` sizes the KV cache (default min(context_length, 2048));
    ``max_resident_experts``: MoE experts stay on the file mapping, at most that many resident
    (`entity.gguf.moe.attach_pager`; stats in ``tf.expert_pager.report()``).
    """
    paged = max_resident_experts is not None
    if paged:
        check_budget(max_resident_experts, None)  # its UsageError before the file is read
        if not keep_quantized:
            raise UsageError("an expert budget pages the stored experts: keep_quantized=True")
    gg = GGUFFile(path, lazy=PAGED_TENSORS.fullmatch if paged else None, later=VOCABULARY_KEYS)
    cfg = gguf_config(gg, max_seq_len)
    if paged:
        check_budget(max_resident_experts, cfg.moe)
    check_tensors(gg, cfg)
    tokenizer, template, spec = load_gguf_tokenizer(gg)
    if tokenizer.vocab_size != cfg.vocab_size:  # llama.cpp requires them equal too
        raise WeightMappingError(
            f"tokenizer has {tokenizer.vocab_size} tokens but token_embd has {cfg.vocab_size} rows",
            path=gg.path,
        )
    tf = _load_weights(gg, cfg, keep_quantized, paged)
    tf.tokenizer, tf.chat_template = tokenizer, template
    tf.eos_token_ids = _end_tokens(spec, spec.chat_template)
    check_eos_ids(tf.eos_token_ids, cfg.vocab_size, path=gg.path, cls=GGUFFormatError)
    tf.generation_defaults = GenerationDefaults()  # GGUF carries no generation settings
    tf.source = {
        "format": "gguf",
        "path": str(path),
        "file_type": gg.metadata.get("general.file_type"),
        "name": gg.metadata.get("general.name"),
        "keep_quantized": keep_quantized,
        "context_length": gg.metadata.get(f"{cfg.architecture}.context_length"),  # as trained
    }
    if paged and cfg.moe is not None:
        attach_pager(tf, gg, max_resident_experts)
    return tf

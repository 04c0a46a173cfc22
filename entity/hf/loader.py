"""Load a HuggingFace snapshot dir (safetensors) into a ``poly.Transformer``.

``load_hf`` reads the config once, checks every tensor name and shape against the name
table before touching any data, then fills the model block by block straight from the
memory-mapped files (peak memory ≈ the model in float32). ``iter_hf_blocks`` exposes the
same walk for block-by-block converters.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from entity.checks import check_eos_ids
from entity.hf import paged
from entity.hf.config import HFModelConfig, load_hf_config
from entity.hf.moe import unstack
from entity.hf.names import Slot, group_by_block, plan
from entity.hf.safetensors_io import FLOAT_DTYPES, Checkpoint, open_checkpoint
from entity.strict_json import read_json
from poly.config import MoEConfig
from poly.errors import (
    CheckpointError,
    ConfigError,
    IntegrityError,
    SamplingParamsError,
    TokenizerError,
    UnsupportedError,
    UsageError,
    WeightMappingError,
)
from poly.filesnapshot import snapshot_of

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers >= 4.43 saves the template
# Storage of the embedding / LM-head tables per requested dtype (default float32); bfloat16
# from ml_dtypes, imported when asked for (`_table_dtype`)
TABLE_DTYPES: dict[str | None, Any] = {
    None: np.float32,
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": "bfloat16",
}


def _table_dtype(dtype: str | None) -> Any:
    got = TABLE_DTYPES.get(dtype, np.float32)
    if isinstance(got, str):
        import ml_dtypes

        got = getattr(ml_dtypes, got)
    return got


Block = dict[str, dict[str, np.ndarray]]  # part -> component -> array


@dataclass(frozen=True)
class HFSource:
    """A snapshot whose config, tensor names, shapes and dtypes have all been checked."""

    path: Path
    config: HFModelConfig
    checkpoint: Checkpoint
    slots: dict[str, Slot]  # HF tensor name -> destination


def open_hf(path: str | Path) -> HFSource:
    """Validate a snapshot dir without reading tensor data (except a tied lm_head check)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory", path=str(root))
    cfg = load_hf_config(root)
    ckpt = open_checkpoint(root)
    rename = cfg.arch.hf_rename or (lambda name: name)
    actual = {rename(n): n for n in ckpt.names() if rename(n) is not None}  # canonical -> stored
    slots = plan(cfg, {name: ckpt.info(stored).shape for name, stored in actual.items()})
    slots = {actual[name]: slot for name, slot in slots.items()}
    for name, slot in slots.items():
        if slot.component.startswith("mx.") and ckpt.info(name).dtype == "U8":
            continue  # MXFP4 blocks/scales (entity.hf.moe dequantizes them)
        if ckpt.info(name).dtype not in FLOAT_DTYPES:
            raise UnsupportedError(
                f"tensor {name!r} is stored as {ckpt.info(name).dtype}; only "
                f"{', '.join(FLOAT_DTYPES)} weights are supported",
                path=str(ckpt.where[name].path),
            )
    if cfg.tie_word_embeddings and "lm_head.weight" in slots:
        # transformers ties the head to the embeddings and drops this tensor; refuse a mismatch.
        if not np.array_equal(
            ckpt.tensor(actual["lm_head.weight"]), ckpt.tensor(actual["model.embed_tokens.weight"])
        ):
            raise WeightMappingError(
                "lm_head.weight differs from model.embed_tokens.weight but tie_word_embeddings is true"
            )
        slots = {n: s for n, s in slots.items() if n != actual["lm_head.weight"]}
        release_mapped(ckpt.tensor(actual["lm_head.weight"]))  # checked, never used
    return HFSource(root, cfg, ckpt, slots)


def iter_hf_blocks(
    source: str | Path | HFSource, split_stacks: bool = True
) -> Iterator[tuple[int | None, Block]]:
    """Yield ``(None, globals)`` first, then ``(i, block_i)`` for i = 0 .. num_layers-1.

    Arrays are read-only memmap views in the stored dtype (float32, float16 or
    ml_dtypes.bfloat16), shaped like HF (matrices ``[out, in]``); widen them with
    ``np.asarray(a, np.float32)``. Globals: ``{"embeddings": {"value": [V, H]},
    "final_norm": {"value": [H]}, "lm_head": {"value": [V, H]}}`` (no ``lm_head`` when
    tied). A block: ``{"attn_norm": {"gamma"}, "attn": {"w_q", "w_k", "w_v", "w_o",
    ["b_q", "b_k", "b_v", "b_o"], ["q_norm", "k_norm"]}, "mlp_norm": {"gamma"},
    "mlp": {"w_gate", "w_up", "w_down"}}`` — component names are the ``poly.nn.layout`` views.
    Everything was validated up front, so iteration only fails on I/O. ``split_stacks=False``
    leaves stacked experts as they are stored (``stack.*``, ``mx.*``: `entity.hf.paged`).
    """
    src = source if isinstance(source, HFSource) else open_hf(source)
    blocks, globals_ = group_by_block(src.slots)
    offset = src.config.arch.norm_offset
    yield None, _collect(src.checkpoint, globals_, offset)
    moe = MoEConfig.coerce(src.config.moe)
    for i in range(src.config.num_layers):
        block = _collect(src.checkpoint, blocks.get(i, {}), offset)
        if split_stacks and moe is not None and "mlp" in block:  # stacks split per expert
            block["mlp"] = unstack(block["mlp"], moe)
        yield i, block


# Components that are norm weights: a (1 + w) family's get the 1 added here, on every path.
NORM_COMPONENTS = frozenset({"gamma", "q_norm", "k_norm"})


def _collect(ckpt: Checkpoint, slots: dict[str, Slot], norm_offset: float = 0.0) -> Block:
    out: Block = {}
    for name, slot in slots.items():
        value = ckpt.tensor(name)
        if norm_offset and (slot.component in NORM_COMPONENTS or slot.part == "final_norm"):
            value = np.asarray(value, np.float32) + np.float32(norm_offset)  # as torch: f32 sum
        if slot.component in ("q_norm", "k_norm") and value.ndim == 2:
            value = value.reshape(-1)  # cohere's per-head [heads, head_dim]: poly's flat row
        comps = out.setdefault(slot.part, {})
        if slot.rows:  # fused rows (gate_up_proj): one view per part, in order
            comps.update(zip(slot.component.split("+"), split_rows(value, slot.rows, slot.groups)))
        else:
            comps[slot.component] = value
    return out


def release_mapped(arr: np.ndarray) -> None:
    """The file's pages of `arr` handed back (copied into the model: not held twice)."""
    from poly.runtime.repack import release_mapped as release

    release(arr)


def copy_released(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src, 1 MB of rows at a time, each piece's file pages handed back once copied:
    the model's bytes are resident once (a whole matrix twice was 6 % of a 100 MB model). The
    same bytes in the same order during a deferred open are read with pread instead."""
    snap = snapshot_of(src) if src.dtype == dst.dtype and src.shape == dst.shape else None
    if snap is not None and snap.deferred and src.flags.c_contiguous and dst.flags.c_contiguous:
        snap.read_into(src, dst)
        return
    if src.ndim < 2:
        dst[...] = src
        release_mapped(src)
        return
    step = max(1, (1 << 20) // max(1, src[0].nbytes))
    for r in range(0, len(src), step):
        dst[r : r + step] = src[r : r + step]
        release_mapped(src[r : r + step])


def _table_copy(src: np.ndarray, dtype: Any) -> np.ndarray:
    out = np.empty(src.shape, dtype=dtype)
    copy_released(out, src)
    return out


def split_rows(value: np.ndarray, rows: tuple[int, ...], groups: int = 1) -> list[np.ndarray]:
    """A fused tensor's parts: `rows` rows each, stacked whole (groups 1) or in `groups` runs
    of rows[k] // groups rows per part (GPT-NeoX's [q_h; k_h; v_h] per head h)."""
    runs = value.reshape(groups, -1, *value.shape[1:])
    cuts = np.cumsum([r // groups for r in rows])[:-1]
    return [p.reshape(r, *value.shape[1:]) for p, r in zip(np.split(runs, cuts, axis=1), rows)]


def _fill_block(tf: Any, i: int, block: Block) -> None:
    from poly.nn import layout

    for part, comps in block.items():
        # norms and attention: the layer's named views; the FFN: SwiGLU views or MoE targets
        target = _ffn_targets(tf.mlp(i)) if part == "mlp" else layout.views(tf.role(i, part))
        for comp, arr in comps.items():
            dst = target.get(comp) if isinstance(target, dict) else getattr(target, comp)
            if dst is None or dst.shape != arr.shape:
                got = None if dst is None else dst.shape
                raise WeightMappingError(
                    f"block {i} {part}.{comp}: layout slot {got}, tensor {arr.shape}"
                )
            copy_released(dst, arr)  # widens F16/BF16 to the float32 master in place


def _ffn_targets(layer):
    from poly import layout
    from poly.layer import LayerType

    if layer.type == LayerType.MOE:
        from entity.hf.moe import MoETargets

        return MoETargets(layer)
    return layout.views(layer)  # SwiGLU or GeluMLP views by name


def _fill_globals(tf: Any, parts: Block, table_dtype: Any) -> None:
    emb = _table_copy(parts["embeddings"]["value"], table_dtype)  # [V, H], copied off the file
    tf.embeddings = emb
    tf.final_norm = parts["final_norm"]["value"]
    if "final_norm_bias" in parts:
        tf.final_norm_bias = parts["final_norm_bias"]["value"]
    if "lm_head_bias" in parts:
        tf.lm_head_bias[...] = parts["lm_head_bias"]["value"]
    if "lm_head" in parts:
        tf.lm_head = _table_copy(parts["lm_head"]["value"], table_dtype)
    else:
        tf.lm_head = tf.embeddings  # tied: the same object


def load_hf(
    path: str | Path,
    *,
    max_seq_len: int | None = None,
    dtype: str | None = None,
    max_resident_experts: int | None = None,
):
    """A ``poly.Transformer`` from a snapshot dir (config.json + safetensors + tokenizer).

    ``max_seq_len`` sizes the KV cache (default: min(max_position_embeddings, 4096), and never
    beyond a sliding window). ``dtype`` None/"float32" keeps everything float32 (exact parity
    with transformers); any other poly dtype name morphs the block weights to it (norms stay
    float32) and float16/bfloat16 also store the embedding and LM-head tables in that dtype.
    ``max_resident_experts``: MoE experts stay mapped from the files, at most that many
    resident (`entity.hf.paged`; stats in ``tf.expert_pager.report()``).
    """
    from poly import Transformer, morph_network

    src = open_hf(path)
    cfg = src.config
    pager = _pager(src, max_resident_experts, dtype)
    tf = Transformer.from_config(cfg.to_transformer_config(max_seq_len))
    table_dtype = _table_dtype(dtype)
    attach_hf_metadata(tf, src)  # first: the tokenizer's build peak comes before the weights'
    if pager is not None:
        paged.drop_expert_masters(tf)
        tf.expert_pager = pager
    for index, block in iter_hf_blocks(src, split_stacks=pager is None):
        if index is None:
            _fill_globals(tf, block, table_dtype)
            continue
        if pager is not None and any(paged.is_expert(k) for k in block.get("mlp", ())):
            block["mlp"] = paged.install(tf, index, block["mlp"], src, pager)
        _fill_block(tf, index, block)
    if dtype not in (None, "float32"):
        morph_network(tf.network, dtype)
    return tf


def _pager(src: HFSource, budget: int | None, dtype: str | None):
    """The expert pager of a budget (its expert tensors left mapped), or None."""
    if budget is None:
        return None
    from poly.runtime.expert_cache import ExpertPager, check_budget

    check_budget(budget, MoEConfig.coerce(src.config.moe))
    pager = ExpertPager(None, budget)
    if dtype not in (None, "float32"):
        raise UsageError(
            f"an expert budget on an HF snapshot runs its experts as stored, not as {dtype}: "
            "drop the dtype, or convert to .entity/GGUF first"
        )
    if src.config.moe is not None:
        src.checkpoint.lazy(paged.expert_names(src))
    return pager


def attach_hf_metadata(tf: Any, src: HFSource) -> None:
    from poly.text.chat import ChatTemplate
    from poly.text.gendefaults import GenerationDefaults
    from poly.text.tokenizer import Tokenizer

    root, cfg = src.path, src.config
    tok_cfg: dict[str, Any] = {}
    if (root / TOKENIZER_CONFIG_FILE).is_file():
        tok_cfg = read_json(root / TOKENIZER_CONFIG_FILE, TokenizerError)
    if "chat_template" not in tok_cfg and (root / CHAT_TEMPLATE_FILE).is_file():
        try:
            tok_cfg = dict(tok_cfg, chat_template=(root / CHAT_TEMPLATE_FILE).read_text("utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(
                f"cannot read {CHAT_TEMPLATE_FILE}: {exc}", path=str(root)
            ) from None
    eos = cfg.eos_token_ids
    if (root / TOKENIZER_FILE).is_file():
        tok = Tokenizer.from_file(root / TOKENIZER_FILE)
        tok.apply_config(tok_cfg)
        if tok.vocab_size > cfg.vocab_size:
            raise IntegrityError(
                f"token_id_out_of_range: tokenizer has {tok.vocab_size} ids, config vocab_size is "
                f"{cfg.vocab_size}",
                path=str(root / TOKENIZER_FILE),
            )
        tf.tokenizer = tok
        if not eos and tok.eos_token_id is not None:
            eos = (tok.eos_token_id,)
    tf.chat_template = ChatTemplate.from_tokenizer_config(tok_cfg, lazy=True)
    tf.eos_token_ids = tuple(eos)
    check_eos_ids(tf.eos_token_ids, cfg.vocab_size, path=root / "config.json", cls=ConfigError)
    try:
        tf.generation_defaults = GenerationDefaults.from_file(cfg.generation.gen_options_kwargs())
    except SamplingParamsError as exc:
        raise ConfigError(f"generation_config.json: {exc}", path=str(root)) from None
    tf.source = {
        "format": "hf",
        "path": str(root),
        "model_type": cfg.model_type,
        "dtype": cfg.dtype,
        "architectures": list(cfg.architectures),
        "context_length": cfg.max_position_embeddings,  # as trained
    }

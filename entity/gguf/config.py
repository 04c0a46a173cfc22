"""The TransformerConfig a GGUF file describes: its ``{arch}.*`` metadata keys (sizes, norms,
rope scaling, the family's options) checked as llama.cpp's loader reads them."""

from __future__ import annotations

from entity.families import GGUF_FAMILIES, Family
from entity.gguf.moe import moe_config
from entity.gguf.reader import GGUFFile
from poly.config import LIMITS
from poly.errors import GGUFFormatError, LayerConfigError, UnsupportedError, WeightMappingError

MAX_LAYERS = LIMITS["num_layers"]  # the table of every format (llama.cpp LLAMA_MAX_LAYERS)
DEFAULT_MAX_SEQ = 2048  # KV caches are preallocated; ask for more with max_seq_len=


def _meta_int(gg: GGUFFile, key: str, default: int | None = None) -> int:
    value = gg.metadata.get(key, default)
    if value is None:
        raise GGUFFormatError(f"missing metadata key {key}", path=gg.path)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise GGUFFormatError(
            f"metadata {key} must be a positive integer, got {value!r}", path=gg.path
        )
    return value


def _meta_float(gg: GGUFFile, key: str, default: float) -> float:
    value = gg.metadata.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GGUFFormatError(f"metadata {key} must be a number, got {value!r}", path=gg.path)
    return float(value)


# llama.cpp's rope.scaling.type values we compute (poly.rope); its other yarn knobs (attention
# and extrapolation factors, log multiplier) have no transformers twin here, so they are refused.
GGUF_ROPE_TYPES = ("none", "linear", "yarn")
_GGUF_ROPE_REFUSED = ("attn_factor", "yarn_attn_factor", "yarn_ext_factor", "yarn_log_multiplier")


def _rope_scaling(gg: GGUFFile, arch: str, context: int) -> dict | None:
    """RopeScaling fields from ``{arch}.rope.scaling.*`` (defaults as llama.cpp's loader)."""
    pre = f"{arch}.rope.scaling."
    kind = gg.metadata.get(pre + "type", "none")
    if kind not in GGUF_ROPE_TYPES:
        raise UnsupportedError(
            f"GGUF rope scaling type {kind!r} is not supported "
            f"(supported: {', '.join(GGUF_ROPE_TYPES)})",
            path=gg.path,
        )
    if kind == "none":  # Phi-3's longrope: no type key, its factors are tensors
        return _longrope(gg, pre, context) if LONGROPE_TENSORS[0] in gg.tensors else None
    refused = [pre + key for key in _GGUF_ROPE_REFUSED if pre + key in gg.metadata]
    if refused:
        raise UnsupportedError(f"GGUF {', '.join(refused)} is not supported", path=gg.path)
    fields = {"rope_type": kind, "factor": _meta_float(gg, pre + "factor", 1.0)}
    if kind == "yarn":
        fields["original_max_position_embeddings"] = _meta_int(
            gg, pre + "original_context_length", context
        )
        for beta in ("beta_fast", "beta_slow"):
            if pre + "yarn_" + beta in gg.metadata:
                fields[beta] = _meta_float(gg, pre + "yarn_" + beta, 0.0)
    return fields


# Phi-3's longrope factors as llama.cpp's converter stores them: long, short ([rotary dims / 2])
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _longrope(gg: GGUFFile, pre: str, context: int) -> dict:
    """A longrope RopeScaling from the factor tensors, rope.scaling.original_context_length and
    attn_factor (the converter's value is transformers' default attention factor)."""
    rot = gg.metadata.get(pre.replace("scaling.", "dimension_count"))
    for name in LONGROPE_TENSORS:
        if name not in gg.tensors:
            raise WeightMappingError(f"missing tensor {name!r}", path=gg.path)
        shape = gg.tensors[name].shape
        if isinstance(rot, int) and shape != (rot // 2,):  # one factor per rotated pair
            raise WeightMappingError(
                f"tensor {name!r} has shape {shape}, expected {(rot // 2,)}", path=gg.path
            )
    long, short = (gg.dequantize(n).reshape(-1).tolist() for n in LONGROPE_TENSORS)
    orig = _meta_int(gg, pre + "original_context_length", context)
    fields = {"rope_type": "longrope", "factor": context / orig, "long_factor": long,
              "short_factor": short, "original_max_position_embeddings": orig}  # fmt: skip
    if pre + "attn_factor" in gg.metadata:
        fields["attention_factor"] = _meta_float(gg, pre + "attn_factor", 1.0)
    return fields


def gguf_config(gg: GGUFFile, max_seq_len: int | None = None):
    """The ``TransformerConfig`` a GGUF file describes (metadata ``{arch}.*`` keys)."""
    from poly import TransformerConfig

    arch = gg.metadata.get("general.architecture")
    if arch not in GGUF_FAMILIES:
        raise UnsupportedError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_FAMILIES)})",
            path=gg.path,
        )
    family = GGUF_FAMILIES[arch]
    if "rope_freqs.weight" in gg.tensors:
        raise UnsupportedError(
            "GGUF rope_freqs (per-dim RoPE factors) is not supported", path=gg.path
        )
    if "token_embd.weight" not in gg.tensors:
        raise WeightMappingError("missing tensor token_embd.weight", path=gg.path)
    hidden = _meta_int(gg, f"{arch}.embedding_length")
    heads = _meta_int(gg, f"{arch}.attention.head_count")
    head_dim = _meta_int(gg, f"{arch}.attention.key_length", hidden // heads or None)
    layers = _meta_int(gg, f"{arch}.block_count")
    if layers > MAX_LAYERS:
        raise GGUFFormatError(f"{arch}.block_count {layers} exceeds {MAX_LAYERS}", path=gg.path)
    context = _meta_int(gg, f"{arch}.context_length", DEFAULT_MAX_SEQ)
    ffn = _meta_int(gg, f"{arch}.feed_forward_length")
    options, scaling = _options(gg, arch, family), _rope_scaling(gg, arch, context)
    _check_rotary(gg, arch, head_dim, options)
    truncate = options.pop("rope_truncate", None)  # GPT-OSS's yarn is not truncated (config.json)
    if scaling is not None and truncate is not None:
        scaling = {**scaling, "truncate": truncate}
    try:
        return TransformerConfig(
            moe=moe_config(gg, arch, layers, ffn, family.moe and family.moe.options),
            vocab_size=gg.tensors["token_embd.weight"].shape[0],
            hidden_size=hidden,
            intermediate_size=ffn,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=_meta_int(gg, f"{arch}.attention.head_count_kv", heads),
            head_dim=head_dim,
            rms_norm_eps=options.pop("rms_norm_eps", None)  # LayerNorm families: their eps key
            or _meta_float(gg, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=_meta_float(gg, f"{arch}.rope.freq_base", 10000.0),
            rope_scaling=scaling,
            max_seq_len=max_seq_len or min(context, DEFAULT_MAX_SEQ),
            tie_word_embeddings="output.weight" not in gg.tensors,
            attention_bias="blk.0.attn_q.bias" in gg.tensors,
            qk_norm=family.qk_norm or options.pop("qk_norm", False),
            architecture=arch,
            **options,
        )
    except LayerConfigError as exc:
        raise GGUFFormatError(
            f"inconsistent GGUF hyper-parameters: {exc.message}", path=gg.path
        ) from None


def _options(gg: GGUFFile, arch: str, family: Family) -> dict:
    """TransformerConfig fields of the family's recipe and its own ``{arch}.*`` keys."""
    out: dict = {} if family.block.plain else {"block": family.block}
    if family.gguf_options is not None:
        out.update(
            family.gguf_options(lambda key, default: gg.metadata.get(f"{arch}.{key}", default))
        )
    extra = family.qk_norm_options
    if not family.qk_norm and extra is not None and "blk.0.attn_q_norm.weight" in gg.tensors:
        out["qk_norm"] = True  # Command-R+: its norm's kind is the family's
        out["attention"] = {**(out.get("attention") or {}), **extra}
    return out


def _check_rotary(gg: GGUFFile, arch: str, head_dim: int, options: dict) -> None:
    """rope.dimension_count below head_dim: partial rotary, read by the families that declare it
    (their gguf_options give partial_rotary_factor); refused for the others."""
    rot = gg.metadata.get(f"{arch}.rope.dimension_count", head_dim)
    factor = (options.get("attention") or {}).get("partial_rotary_factor", 1.0)
    if rot != head_dim and int(head_dim * factor) != rot:
        raise UnsupportedError(
            f"partial rotary ({rot} of {head_dim} dims) is not supported", path=gg.path
        )

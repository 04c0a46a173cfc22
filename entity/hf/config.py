"""Parse and validate a HuggingFace ``config.json`` (+ ``generation_config.json``) once.

The result is a frozen record, :class:`HFModelConfig`, holding only what poly needs. Every
failure is a typed poly error: malformed JSON, wrong types and missing keys are ``ConfigError``
naming the key (`entity.strict_json`'s name tables); absurd sizes are ``LimitExceededError``;
architectures or features we cannot run exactly (gemma, phi3, dynamic/longrope rope scaling, MLP
biases ...) are ``UnsupportedError`` naming them. The files are read by
`entity.strict_json.read_json` (callers that import it from here still can).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from entity.families import FAMILIES, REFUSED_REASONS, WRAPPERS, Family
from entity.hf.attention import attention_options, sliding_window
from entity.hf.generation import RAW_GENERATION, HFGeneration, check_generation
from entity.hf.moe import expert_storage, moe_config
from entity.hf.rope import parse_rope
from entity.strict_json import (
    BOOL,
    FLOAT,
    INT,
    MAP,
    STR,
    STRS,
    TOKEN_IDS,
    Field,
    JsonRecord,
    default,
    read_json,
    validate_json,
)
from poly.config import LIMITS as POLY_LIMITS
from poly.errors import ConfigError, LayerConfigError, LimitExceededError, UnsupportedError
from poly.recipe import AttentionConfig
from poly.rope import RopeScaling

CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
DEFAULT_CONTEXT = 4096  # KV cache size when the caller gives no max_seq_len


SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
# Upper bounds, checked before anything is sized from these numbers (reliability B3 #42): the
# one table of every format, poly.config.LIMITS, under config.json's key names.
HF_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size",
           "intermediate_size": "intermediate_size", "num_hidden_layers": "num_layers",
           "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
           "head_dim": "head_dim", "max_position_embeddings": "max_seq_len"}  # fmt: skip
LIMITS: dict[str, int] = {key: POLY_LIMITS[name] for key, name in HF_KEYS.items()}
TokenIds = int | list[int] | None

# config.json keys as written by transformers 4.x and 5.x (the others are kept: `raw.extra`).
RAW_CONFIG: dict[str, Field] = {
    "model_type": STR,
    "architectures": default(STRS),
    "vocab_size": INT,
    "hidden_size": INT,
    "intermediate_size": INT,
    "num_hidden_layers": INT,
    "num_attention_heads": INT,
    "num_key_value_heads": default(INT),
    "head_dim": default(INT),
    "rms_norm_eps": default(FLOAT, 1e-6),
    "rope_theta": default(FLOAT),
    "rope_scaling": default(MAP),
    "rope_parameters": default(MAP),
    "tie_word_embeddings": default(BOOL, False),
    "attention_bias": default(BOOL, False),
    "mlp_bias": default(BOOL, False),
    "hidden_act": default(STR, "silu"),
    "max_position_embeddings": default(INT),
    "sliding_window": default(INT),
    "use_sliding_window": default(BOOL, False),
    "bos_token_id": TOKEN_IDS,
    "eos_token_id": TOKEN_IDS,
    "torch_dtype": default(STR),
    "dtype": default(STR),
}


@dataclasses.dataclass(frozen=True)
class HFModelConfig:
    """A validated HF decoder config. Build it with :func:`load_hf_config` or :meth:`parse`."""

    model_type: str
    architectures: tuple[str, ...]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    sliding_window: int | None  # effective window (None: full attention)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # config.json ∪ generation_config.json, in first-seen order
    dtype: str | None
    generation: HFGeneration
    moe: dict | None = None  # poly.config.MoEConfig fields (entity.hf.moe), None when dense
    expert_storage: str | None = None  # "mxfp4": GPT-OSS's experts as *_blocks/*_scales
    # further TransformerConfig fields: the family's block recipe and options
    options: dict = dataclasses.field(default_factory=dict)

    @property
    def arch(self) -> Family:
        return FAMILIES[self.model_type]

    @classmethod
    def parse(
        cls, config: Any, generation: Any = None, *, source: str | None = None
    ) -> HFModelConfig:
        """Validate already-decoded JSON objects (``generation`` may be None)."""
        return _build(config, generation, source)

    def default_max_seq_len(self) -> int:
        return min(self.max_position_embeddings, DEFAULT_CONTEXT)

    def to_transformer_config(self, max_seq_len: int | None = None):
        """The matching ``poly.TransformerConfig`` (KV cache sized to ``max_seq_len``; a sliding
        window layer's cache keeps its window only)."""
        from poly import TransformerConfig

        seq = self.default_max_seq_len() if max_seq_len is None else max_seq_len
        if type(seq) is not int or seq <= 0:
            raise ConfigError(f"max_seq_len must be a positive int, got {seq!r}")
        return TransformerConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_seq_len=seq,
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=self.qkv_bias or self.o_bias,
            qk_norm=self.qk_norm,
            architecture=self.model_type,
            moe=self.moe,
            **self.options,
        )


def load_hf_config(model_dir: str | Path) -> HFModelConfig:
    """Read ``config.json`` and, when present, ``generation_config.json`` from a snapshot dir."""
    root = Path(model_dir)
    config = read_json(root / CONFIG_FILE)
    gen_path = root / GENERATION_FILE
    generation = read_json(gen_path) if gen_path.is_file() else None
    return _build(config, generation, str(root / CONFIG_FILE))


def _token_ids(value: TokenIds) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def _check_sizes(raw: JsonRecord, kv_heads: int, head_dim: int, source: str | None) -> None:
    sizes = {
        "vocab_size": raw.vocab_size,
        "hidden_size": raw.hidden_size,
        "intermediate_size": raw.intermediate_size,
        "num_hidden_layers": raw.num_hidden_layers,
        "num_attention_heads": raw.num_attention_heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": raw.max_position_embeddings or 1,
    }
    for key, value in sizes.items():
        if value <= 0:
            raise ConfigError(f"{key}: must be > 0, got {value}", path=source)
        if value > LIMITS[key]:
            raise LimitExceededError(f"{key}: {value} exceeds the limit {LIMITS[key]}", path=source)
    if raw.num_attention_heads % kv_heads:
        raise ConfigError(
            f"num_attention_heads: {raw.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {kv_heads}",
            path=source,
        )
    if not 0 < raw.rms_norm_eps < 1:
        raise ConfigError(f"rms_norm_eps: must be in (0, 1), got {raw.rms_norm_eps}", path=source)


def _check_features(raw: JsonRecord, source: str | None) -> Family:
    arch = FAMILIES.get(raw.model_type)
    if arch is None:
        why = REFUSED_REASONS.get(raw.model_type, "no importer for it")
        raise UnsupportedError(
            f"model_type {raw.model_type!r} is not supported ({why}); "
            f"supported: {', '.join(FAMILIES)}",
            path=source,
        )
    classes = (arch.causal_lm_class, *arch.other_classes)
    if raw.architectures and not set(classes) & set(raw.architectures):
        raise UnsupportedError(
            f"architectures {raw.architectures} is not supported for model_type "
            f"{raw.model_type!r} (expected {arch.causal_lm_class})",
            path=source,
        )
    if raw.hidden_act not in arch.activations:
        raise UnsupportedError(
            f"hidden_act {raw.hidden_act!r} is not supported for {raw.model_type} "
            f"({', '.join(arch.activations)})",
            path=source,
        )
    if raw.mlp_bias:
        raise UnsupportedError("mlp_bias=true is not supported", path=source)
    dtype = raw.dtype or raw.torch_dtype
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        raise UnsupportedError(
            f"dtype {dtype!r} is not supported ({', '.join(SUPPORTED_DTYPES)})", path=source
        )
    return arch


def _unwrap(config: Any, source: str | None) -> Any:
    """A multimodal config.json (model_type "gemma3": Gemma3ForConditionalGeneration) -> its
    nested text_config, read as the text family's own, with the outer architectures and tied
    head (the keys transformers reads at the top level)."""
    mt = config.get("model_type") if isinstance(config, dict) else None
    family = WRAPPERS.get(mt) if isinstance(mt, str) else None
    if family is None:
        return config
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(
            f"text_config: a {mt} config.json needs its text model's config", path=source
        )
    if text.get("model_type", family.model_type) != family.model_type:
        raise UnsupportedError(
            f"text_config.model_type {text.get('model_type')!r} is not supported for {mt} "
            f"(expected {family.model_type})",
            path=source,
        )
    outer = {k: config[k] for k in ("architectures", "tie_word_embeddings") if k in config}
    return {**text, "model_type": family.model_type, **outer}


def _with_defaults(config: Any) -> Any:
    """config.json with its family's defaults for the keys it leaves out (transformers' own)."""
    mt = config.get("model_type") if isinstance(config, dict) else None
    family = FAMILIES.get(mt) if isinstance(mt, str) else None
    if family is None:
        return config
    merged = {**family.hf_defaults, **config}
    aliases = {new: merged[old] for old, new in family.hf_aliases.items() if old in merged}
    return {**aliases, **merged}


def _options(raw: JsonRecord, arch: Family, source: str | None) -> dict:
    """TransformerConfig fields of the family's recipe and its own config keys."""
    out: dict = {"block": dataclasses.asdict(arch.block)} if not arch.block.plain else {}
    attention = attention_options(raw, arch, source)
    if arch.hf_options is not None:
        try:
            out.update(arch.hf_options(raw.as_dict()))
        except (LayerConfigError, TypeError, ValueError) as exc:
            raise ConfigError(str(exc), path=source) from None
    attention.update(out.get("attention") or {})  # the family's own options on top
    if attention:
        try:
            out["attention"] = dataclasses.asdict(AttentionConfig(**attention))
        except (LayerConfigError, TypeError) as exc:
            raise ConfigError(f"attention: {exc}", path=source) from None
    return out


def _head_dim(raw: JsonRecord, arch: Family, source: str | None) -> int:
    """config.json's head_dim, else the family's, else hidden_size / num_attention_heads."""
    if raw.head_dim is not None:
        return raw.head_dim
    if arch.default_head_dim is not None:
        return arch.default_head_dim
    if raw.num_attention_heads <= 0 or raw.hidden_size % raw.num_attention_heads:
        raise ConfigError(
            f"hidden_size: {raw.hidden_size} is not a multiple of num_attention_heads "
            f"{raw.num_attention_heads} and no head_dim is given",
            path=source,
        )
    return raw.hidden_size // raw.num_attention_heads


def _special_tokens(
    raw: JsonRecord, gen: JsonRecord, source: str | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(eos ids of config.json then generation_config.json, bos ids of the first that has one),
    each checked to be a token of the vocabulary."""
    eos = _union(_token_ids(raw.eos_token_id), _token_ids(gen.eos_token_id))
    bos = _token_ids(raw.bos_token_id) or _token_ids(gen.bos_token_id)
    for tid in (*eos, *bos):
        if not 0 <= tid < raw.vocab_size:
            raise ConfigError(
                f"special_token_id: {tid} is outside [0, {raw.vocab_size})", path=source
            )
    return eos, bos


def _build(config: Any, generation: Any, source: str | None) -> HFModelConfig:
    config = _with_defaults(_unwrap(config, source))
    raw = validate_json(RAW_CONFIG, config, source, extra=True)
    arch = _check_features(raw, source)
    gen_source = None if source is None else str(Path(source).with_name(GENERATION_FILE))
    gen = validate_json(RAW_GENERATION, generation or {}, gen_source)
    kv_heads = raw.num_key_value_heads or raw.num_attention_heads
    head_dim = _head_dim(raw, arch, source)
    _check_sizes(raw, kv_heads, head_dim, source)
    max_positions = raw.max_position_embeddings or arch.default_max_positions
    theta, scaling = parse_rope(raw, max_positions, source)
    eos, bos = _special_tokens(raw, gen, source)
    check_generation(gen, gen_source)
    rules = {"flag": raw.attention_bias, "qkv": True, "qkv_flag": raw.attention_bias, "none": False}
    biased = rules[arch.bias_rule]
    moe = moe_config(raw, raw.num_hidden_layers, source)
    options = _options(raw, arch, source)
    return HFModelConfig(
        options=options,
        moe=None if moe is None else dataclasses.asdict(moe),
        expert_storage=expert_storage(raw, source),
        model_type=raw.model_type,
        architectures=tuple(raw.architectures or ()),
        vocab_size=raw.vocab_size,
        hidden_size=raw.hidden_size,
        intermediate_size=raw.intermediate_size,
        num_layers=raw.num_hidden_layers,
        num_heads=raw.num_attention_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=raw.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=raw.tie_word_embeddings,
        qkv_bias=biased,
        o_bias=biased and arch.bias_rule == "flag",
        # a family whose q/k norms a config key switches on (cohere, phi) says so in its options
        qk_norm=arch.qk_norm or bool(options.pop("qk_norm", False)),
        max_position_embeddings=max_positions,
        sliding_window=sliding_window(raw, arch),
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=eos,
        dtype=raw.dtype or raw.torch_dtype,
        generation=HFGeneration.of(gen, present=generation is not None),
    )


def _union(*groups: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(t for group in groups for t in group))

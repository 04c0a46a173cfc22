"""The record of one model family (`Family`) and the tensor-name table most families share.

A family file (entity/families/<model_type>.py) holds everything entity knows about one
`model_type`: its HF config mapping (the causal-LM class, the defaults of transformers' config
class for keys a config.json leaves out), its tensor names (HF and GGUF), the GGUF architecture
llama.cpp's converter writes and the keys past the common ones, and its block recipe
(poly.config.BlockRecipe plus model-level options). mlx-lm's models/*.py are the anchor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from poly.recipe import PLAIN_BLOCK, BlockRecipe


@dataclass(frozen=True)
class TensorName:
    """One tensor: its role and component, its HF name (a suffix of ``model.layers.{i}.`` for
    block tensors) and its GGUF name (a suffix of ``blk.{i}.``). Globals: component "value".
    A component "a+b" is a fused tensor holding the rows of a, then b (split at load)."""

    role: str
    component: str
    hf: str
    gguf: str
    # A fused "a+b+c" component whose HF rows interleave per kv head ([q_h; k_h; v_h] for each
    # head h: GPT-NeoX's query_key_value), not whole parts stacked ([q; k; v]: Phi-3's qkv_proj)
    per_head: bool = False


# llama's block (every family until Gemma 2 names its tensors so).
LLAMA_TENSORS: tuple[TensorName, ...] = (
    TensorName("attn_norm", "gamma", "input_layernorm.weight", "attn_norm.weight"),
    TensorName("attn", "w_q", "self_attn.q_proj.weight", "attn_q.weight"),
    TensorName("attn", "w_k", "self_attn.k_proj.weight", "attn_k.weight"),
    TensorName("attn", "w_v", "self_attn.v_proj.weight", "attn_v.weight"),
    TensorName("attn", "w_o", "self_attn.o_proj.weight", "attn_output.weight"),
    TensorName("attn", "b_q", "self_attn.q_proj.bias", "attn_q.bias"),
    TensorName("attn", "b_k", "self_attn.k_proj.bias", "attn_k.bias"),
    TensorName("attn", "b_v", "self_attn.v_proj.bias", "attn_v.bias"),
    TensorName("attn", "b_o", "self_attn.o_proj.bias", "attn_output.bias"),
    TensorName("attn", "q_norm", "self_attn.q_norm.weight", "attn_q_norm.weight"),
    TensorName("attn", "k_norm", "self_attn.k_norm.weight", "attn_k_norm.weight"),
    TensorName("mlp_norm", "gamma", "post_attention_layernorm.weight", "ffn_norm.weight"),
    TensorName("mlp", "w_gate", "mlp.gate_proj.weight", "ffn_gate.weight"),
    TensorName("mlp", "w_up", "mlp.up_proj.weight", "ffn_up.weight"),
    TensorName("mlp", "w_down", "mlp.down_proj.weight", "ffn_down.weight"),
)
GLOBAL_TENSORS: tuple[TensorName, ...] = (
    TensorName("embeddings", "value", "model.embed_tokens.weight", "token_embd.weight"),
    TensorName("final_norm", "value", "model.norm.weight", "output_norm.weight"),
    TensorName("lm_head", "value", "lm_head.weight", "output.weight"),
)


@dataclass(frozen=True)
class MoENames:
    """An MoE family's sparse-FFN names and config keys (entity.hf.moe, entity.gguf.moe).

    ``prefix`` + ``experts.<e>.<proj[view]>.weight`` per expert; the router is
    ``prefix + "gate.weight"``. ``width_key``: the config key of the expert width.
    ``shared``: a shared expert exists (Qwen2-MoE). ``norm_topk``: whether top-k weights are
    renormalised when the config (or the GGUF file) does not say; ``norm_topk_key``: False when
    transformers hard-codes it (Mixtral). ``router``: the router's name after ``prefix``.
    ``layout``: "per_expert" (the names above), "granite" (``input_linear`` [E, 2I, d] gate
    rows then up rows, ``output_linear`` [E, d, I]) or "gpt_oss" (``experts.gate_up_proj``
    [E, d, 2I] gate/up interleaved by column, ``experts.down_proj`` [E, I, d], their biases; or
    MXFP4 ``*_blocks``/``*_scales``). ``options``: MoEConfig fields the family fixes (gating,
    biases, activation: what transformers and llama.cpp hard-code for it)."""

    prefix: str
    proj: Mapping[str, str]
    width_key: str
    shared: bool = False
    norm_topk: bool = True
    norm_topk_key: bool = True
    router: str = "gate.weight"
    layout: Literal["per_expert", "granite", "gpt_oss"] = "per_expert"
    options: Mapping[str, Any] = field(default_factory=dict)


QWEN_PROJ = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


@dataclass(frozen=True)
class Family:
    """How one model family maps onto the poly decoder block (HF and GGUF rules together)."""

    model_type: str
    causal_lm_class: str  # HF config.json "architectures"
    # "flag": q/k/v/o biases follow `attention_bias`; "qkv": q/k/v always biased, o never;
    # "qkv_flag": q/k/v biases follow `attention_bias`, o never (GLM-4).
    bias_rule: Literal["flag", "qkv", "qkv_flag", "none"]
    qk_norm: bool
    default_head_dim: int | None  # None: hidden_size // num_attention_heads
    default_max_positions: int
    # Which keys turn a sliding window on (transformers' own rule per architecture).
    sliding: Literal["none", "sliding_window", "use_sliding_window"]
    # GGUF `general.architecture` llama.cpp's converter writes (None: no GGUF import). The first
    # family registered under a name reads its files (Mistral and Mixtral files say "llama").
    gguf_arch: str | None = None
    # GGUF: llama.cpp's convert_hf_to_gguf permutes q/k rows for LlamaModel only.
    permute_qk: bool = False
    # transformers' config-class defaults for keys a config.json leaves out
    hf_defaults: Mapping[str, Any] = field(default_factory=dict)
    # config.json key -> the common key it stands for (StarCoder2's norm_epsilon is the
    # rms_norm_eps slot), copied over when the common key is absent
    hf_aliases: Mapping[str, str] = field(default_factory=dict)
    other_classes: tuple[str, ...] = ()  # further accepted "architectures" entries
    activations: tuple[str, ...] = ("silu", "swish")  # hidden_act values (one function each)
    tensors: tuple[TensorName, ...] = LLAMA_TENSORS
    global_tensors: tuple[TensorName, ...] = GLOBAL_TENSORS
    block: BlockRecipe = PLAIN_BLOCK
    moe: MoENames | None = None
    # (1 + w) norms (Gemma): the importer adds this to every norm weight, so poly runs the plain
    # RMSNorm (llama.cpp's converter stores the sum in GGUF files already).
    norm_offset: float = 0.0
    # rope_scaling type names a family's transformers config maps to ours (Phi-3: su -> longrope)
    rope_aliases: Mapping[str, str] = field(default_factory=dict)
    # HF block tensors are this prefix + the table's suffixes (GPT-NeoX: "gpt_neox.layers.{i}.")
    hf_block_prefix: str = "model.layers.{i}."
    # multimodal model_types whose config.json nests this family's config under `text_config`
    # (Gemma3ForConditionalGeneration: "gemma3"); their vision towers are dropped (hf_rename)
    wrapper_types: tuple[str, ...] = ()
    # HF tensor name -> the canonical name above, or None to drop it (multimodal checkpoints)
    hf_rename: Callable[[str], str | None] | None = None
    # TransformerConfig fields past the common ones, from the parsed config.json (its keys,
    # defaults applied) / from the GGUF metadata (`get(key, default)` of ``{arch}.<key>``)
    hf_options: Callable[[Mapping[str, Any]], dict] | None = None
    # AttentionConfig fields of the q/k norm a config key switches on (cohere's use_qk_norm);
    # a GGUF file switches it on by holding blk.0.attn_q_norm.weight
    qk_norm_options: Mapping[str, Any] | None = None
    gguf_options: Callable[[Callable[[str, Any], Any]], dict] | None = None

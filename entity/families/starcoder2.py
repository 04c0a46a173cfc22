"""starcoder2: LayerNorm with a bias (the final norm too), a plain biased GELU MLP (c_fc, c_proj),
q/k/v/o biases and the FFN biases per `use_bias`, a sliding window on every layer when set."""

import dataclasses

from entity.families.base import GLOBAL_TENSORS, Family, TensorName
from poly.errors import LayerConfigError
from poly.recipe import BlockRecipe

BLOCK = BlockRecipe(norm="layernorm", ffn="gelu_tanh_mlp", mlp_bias=True)
# hidden_act -> the FFN kind running it (transformers' ACT2FN: "gelu" is the exact form)
FFN = {"gelu_pytorch_tanh": "gelu_tanh_mlp", "gelu_new": "gelu_tanh_mlp", "gelu": "gelu_mlp"}

TENSORS = (
    TensorName("attn_norm", "gamma", "input_layernorm.weight", "attn_norm.weight"),
    TensorName("attn_norm", "beta", "input_layernorm.bias", "attn_norm.bias"),
    TensorName("attn", "w_q", "self_attn.q_proj.weight", "attn_q.weight"),
    TensorName("attn", "w_k", "self_attn.k_proj.weight", "attn_k.weight"),
    TensorName("attn", "w_v", "self_attn.v_proj.weight", "attn_v.weight"),
    TensorName("attn", "w_o", "self_attn.o_proj.weight", "attn_output.weight"),
    TensorName("attn", "b_q", "self_attn.q_proj.bias", "attn_q.bias"),
    TensorName("attn", "b_k", "self_attn.k_proj.bias", "attn_k.bias"),
    TensorName("attn", "b_v", "self_attn.v_proj.bias", "attn_v.bias"),
    TensorName("attn", "b_o", "self_attn.o_proj.bias", "attn_output.bias"),
    TensorName("mlp_norm", "gamma", "post_attention_layernorm.weight", "ffn_norm.weight"),
    TensorName("mlp_norm", "beta", "post_attention_layernorm.bias", "ffn_norm.bias"),
    TensorName("mlp", "w_up", "mlp.c_fc.weight", "ffn_up.weight"),
    TensorName("mlp", "b_up", "mlp.c_fc.bias", "ffn_up.bias"),
    TensorName("mlp", "w_down", "mlp.c_proj.weight", "ffn_down.weight"),
    TensorName("mlp", "b_down", "mlp.c_proj.bias", "ffn_down.bias"),
)


def _options(cfg) -> dict:
    act = cfg.get("hidden_act")
    if act not in FFN:  # _check_features names the key first; this guards direct callers
        raise LayerConfigError(f"hidden_act {act!r} is not supported for starcoder2")
    use_bias = cfg.get("use_bias", True)
    if type(use_bias) is not bool:
        raise LayerConfigError(f"use_bias must be true or false, got {use_bias!r}")
    block = dataclasses.replace(BLOCK, ffn=FFN[act], mlp_bias=use_bias)
    return {"block": dataclasses.asdict(block)}


def _gguf(get) -> dict:
    """llama.cpp's starcoder2: no sliding-window key (llama.cpp attends to every position) and
    no activation (transformers' default, gelu_pytorch_tanh); LayerNorm eps."""
    return {"block": dataclasses.asdict(BLOCK),
            "rms_norm_eps": float(get("attention.layer_norm_epsilon", 1e-5))}  # fmt: skip


FAMILY = Family(
    model_type="starcoder2",
    causal_lm_class="Starcoder2ForCausalLM",
    bias_rule="flag",  # `use_bias` (aliased to attention_bias) biases q, k, v and o alike
    qk_norm=False,
    default_head_dim=None,
    default_max_positions=4096,
    sliding="sliding_window",
    gguf_arch="starcoder2",
    hf_defaults={
        "use_bias": True,
        "norm_epsilon": 1e-5,
        "hidden_act": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    },  # fmt: skip
    hf_aliases={"norm_epsilon": "rms_norm_eps", "use_bias": "attention_bias"},
    activations=tuple(FFN),
    tensors=TENSORS,
    global_tensors=(
        *GLOBAL_TENSORS,
        TensorName("final_norm_bias", "value", "model.norm.bias", "output_norm.bias"),
    ),
    block=BLOCK,
    hf_options=_options,
    gguf_options=_gguf,
)

"""phi (Phi-1, Phi-1.5, Phi-2): one LayerNorm (with a bias) feeds attention and the MLP in
parallel, x + attn(ln(x)) + mlp(ln(x)); q/k/v and the output projection (`dense`) biased, RoPE
over the first `partial_rotary_factor` of each head (NeoX halves), a plain biased GELU MLP
(fc1, fc2), a final LayerNorm with a bias and a biased LM head; `qk_layernorm`: a LayerNorm (with
a bias) over each head of q and k, one [head_dim] weight shared by the heads, before RoPE.
mlx-lm: models/phi.py."""

import dataclasses

from entity.families.base import Family, TensorName
from entity.families.gpt_neox import gguf_rotary
from entity.families.starcoder2 import FFN
from poly.errors import LayerConfigError
from poly.recipe import BlockRecipe

BLOCK = BlockRecipe(norm="layernorm", ffn="gelu_tanh_mlp", mlp_bias=True, parallel=True,
                    shared_norm=True)  # fmt: skip

TENSORS: tuple[TensorName, ...] = (
    TensorName("attn_norm", "gamma", "input_layernorm.weight", "attn_norm.weight"),
    TensorName("attn_norm", "beta", "input_layernorm.bias", "attn_norm.bias"),
    TensorName("attn", "w_q", "self_attn.q_proj.weight", "attn_q.weight"),
    TensorName("attn", "w_k", "self_attn.k_proj.weight", "attn_k.weight"),
    TensorName("attn", "w_v", "self_attn.v_proj.weight", "attn_v.weight"),
    TensorName("attn", "w_o", "self_attn.dense.weight", "attn_output.weight"),
    TensorName("attn", "b_q", "self_attn.q_proj.bias", "attn_q.bias"),
    TensorName("attn", "b_k", "self_attn.k_proj.bias", "attn_k.bias"),
    TensorName("attn", "b_v", "self_attn.v_proj.bias", "attn_v.bias"),
    TensorName("attn", "b_o", "self_attn.dense.bias", "attn_output.bias"),
    TensorName("attn", "q_norm", "self_attn.q_layernorm.weight", "attn_q_norm.weight"),
    TensorName("attn", "q_norm_bias", "self_attn.q_layernorm.bias", "attn_q_norm.bias"),
    TensorName("attn", "k_norm", "self_attn.k_layernorm.weight", "attn_k_norm.weight"),
    TensorName("attn", "k_norm_bias", "self_attn.k_layernorm.bias", "attn_k_norm.bias"),
    TensorName("mlp", "w_up", "mlp.fc1.weight", "ffn_up.weight"),
    TensorName("mlp", "b_up", "mlp.fc1.bias", "ffn_up.bias"),
    TensorName("mlp", "w_down", "mlp.fc2.weight", "ffn_down.weight"),
    TensorName("mlp", "b_down", "mlp.fc2.bias", "ffn_down.bias"),
)
GLOBALS: tuple[TensorName, ...] = (
    TensorName("embeddings", "value", "model.embed_tokens.weight", "token_embd.weight"),
    TensorName("final_norm", "value", "model.final_layernorm.weight", "output_norm.weight"),
    TensorName("final_norm_bias", "value", "model.final_layernorm.bias", "output_norm.bias"),
    TensorName("lm_head", "value", "lm_head.weight", "output.weight"),
    TensorName("lm_head_bias", "value", "lm_head.bias", "output.bias"),
)


def _options(cfg) -> dict:
    act = cfg.get("hidden_act")
    if act not in FFN:  # _check_features names the key first; this guards direct callers
        raise LayerConfigError(f"hidden_act {act!r} is not supported for phi")
    qk = cfg.get("qk_layernorm")
    if type(qk) is not bool:
        raise LayerConfigError(f"qk_layernorm must be true or false, got {qk!r}")
    block = dataclasses.replace(BLOCK, ffn=FFN[act])
    out = {"block": dataclasses.asdict(block), "lm_head_bias": True, "qk_norm": qk}
    return out | ({"attention": {"qk_norm_kind": "layernorm"}} if qk else {})


def _gguf(get) -> dict:
    # llama.cpp's phi2 records no activation: PhiConfig's default, gelu_new (the tanh form)
    return {"block": dataclasses.asdict(BLOCK), "lm_head_bias": True,
            "attention": gguf_rotary(get),
            "rms_norm_eps": float(get("attention.layer_norm_epsilon", 1e-5))}  # fmt: skip


FAMILY = Family(
    model_type="phi",
    causal_lm_class="PhiForCausalLM",
    bias_rule="flag",  # PhiConfig has no attention_bias: q, k, v and dense always carry biases
    qk_norm=False,
    default_head_dim=None,
    default_max_positions=2048,
    sliding="none",
    gguf_arch="phi2",
    # transformers' PhiConfig (a config.json's rope_parameters factor wins over the top level)
    hf_defaults={
        "layer_norm_eps": 1e-5,
        "hidden_act": "gelu_new",
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
        "qk_layernorm": False,
    },  # fmt: skip
    hf_aliases={"layer_norm_eps": "rms_norm_eps"},
    activations=tuple(FFN),
    tensors=TENSORS,
    global_tensors=GLOBALS,
    block=BLOCK,
    hf_options=_options,
    gguf_options=_gguf,
)

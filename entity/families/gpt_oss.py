"""gpt_oss (GPT-OSS): biased attention with a learned sink logit per head, sliding and full
layers alternating (`layer_types`; GGUF: even layers slide), yarn rope, and an MoE with a biased
router (softmax over the top-k logits), biased experts and the clamped SwiGLU (alpha 1.702,
limit 7); experts stored as [E, ...] stacks, or MXFP4 in the released checkpoints and GGUF files.
Its post-attention norm is `post_attention_norm` in GGUF files."""

from entity.families.base import GLOBAL_TENSORS, LLAMA_TENSORS, Family, MoENames, TensorName
from poly.errors import LayerConfigError


def _tensors() -> tuple[TensorName, ...]:
    out = [
        TensorName(t.role, t.component, t.hf, "post_attention_norm.weight")
        if t.role == "mlp_norm"
        else t
        for t in LLAMA_TENSORS
    ]
    return (*out, TensorName("attn", "sinks", "self_attn.sinks", "attn_sinks.weight"))


def _options(cfg) -> dict:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:  # transformers' default: even layers slide
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise LayerConfigError(f"layer_types must name each of the {n} layers")
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    return {"attention": {"sinks": True, "window_layers": sliding}}


def _gguf_options(get) -> dict:
    n, window = int(get("block_count", 0)), get("attention.sliding_window", None)
    out = {"sinks": True, "window_layers": [i for i in range(n) if i % 2 == 0]}
    if window is not None:  # llama.cpp: swa pattern 2, layer 0 slides
        out["sliding_window"] = int(window)
    # transformers' yarn for GPT-OSS does not truncate the correction range (its config.json
    # says truncate: false; the GGUF file cannot say it): the model as trained
    return {"attention": out, "rope_truncate": False}


FAMILY = Family(
    model_type="gpt_oss",
    causal_lm_class="GptOssForCausalLM",
    bias_rule="flag",
    qk_norm=False,
    default_head_dim=64,
    default_max_positions=131072,
    sliding="sliding_window",
    gguf_arch="gpt-oss",
    tensors=_tensors(),
    global_tensors=GLOBAL_TENSORS,
    moe=MoENames(
        prefix="mlp.",
        proj={},
        width_key="intermediate_size",
        norm_topk=True,
        norm_topk_key=False,
        router="router.weight",
        layout="gpt_oss",
        options={
            "gating": "softmax_topk",
            "router_bias": True,
            "expert_bias": True,
            "activation": "swiglu_oai",
        },  # fmt: skip
    ),
    hf_options=_options,
    gguf_options=_gguf_options,
)

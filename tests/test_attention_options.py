"""Each MHA option of poly.nn.mha against transformers' own attention module of a family that
uses it (float32, eager attention, random weights, GQA, head_dim 24 != hidden / heads): partial
half-split rotary (Phi), partial interleaved rotary (GLM-4), q/k RMSNorm over all heads
(OLMo 2), a logit scale (Granite), logit soft-capping with a scale (Gemma 2), sinks (GPT-OSS).
The whole prompt in one call, then the same positions one token a call on the KV cache."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
import transformers

from poly.layer import LayerType, VolumetricLayer
from poly.nn import layout, mha

D, HEADS, KV_HEADS, HEAD_DIM, N = 64, 4, 2, 24, 13
COMMON = dict(hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
              head_dim=HEAD_DIM, max_position_embeddings=64, attn_implementation="eager",
              rope_theta=1000.0, pad_token_id=0)  # fmt: skip

# case -> (transformers module, config class, config keys, poly MHA options, layer index)
CASES = {
    "partial_half_split": ("phi", "PhiConfig", {"partial_rotary_factor": 0.5},
                           {"rotary_dim": 12}, 0),
    "partial_interleaved": ("glm4", "Glm4Config", {"partial_rotary_factor": 0.5},
                            {"rotary_dim": 12, "rope_interleaved": True}, 0),
    "qk_norm_all_heads": ("olmo2", "Olmo2Config", {"rms_norm_eps": 1e-5},
                          {"qk_norm": True, "qk_norm_all": True, "rms_norm_eps": 1e-5}, 0),
    "scale": ("granite", "GraniteConfig", {"attention_multiplier": 0.37},
              {"attn_scale": 0.37}, 0),
    "softcap": ("gemma2", "Gemma2Config",
                {"query_pre_attn_scalar": 20, "attn_logit_softcapping": 1.5,
                 "sliding_window": 64},
                {"attn_scale": 20**-0.5, "attn_softcap": 1.5}, 1),
    "sinks": ("gpt_oss", "GptOssConfig",
              {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
               "sliding_window": 64, "num_local_experts": 2, "num_experts_per_tok": 1},
              {"attn_sinks": True}, 1),
}  # fmt: skip
# transformers' names of each module's output projection
OUT_PROJ = {"phi": "dense"}


def _hf_module(case: str):
    name, cls, keys, _, index = CASES[case]
    mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    prefix = cls.removesuffix("Config")
    config = getattr(transformers, cls)(**{**COMMON, "vocab_size": 32, **keys})
    torch.manual_seed(7)
    attn = getattr(mod, f"{prefix}Attention")(config, layer_idx=index).eval()
    rotary = getattr(mod, f"{prefix}RotaryEmbedding")(config)
    with torch.no_grad():
        for pname, p in attn.named_parameters():
            # random biases, norms, sinks (the defaults 0 / 1 hide mapping mistakes)
            p.copy_(torch.randn(p.shape) * (0.3 if p.ndim == 2 else 0.8))
            if "norm" in pname:
                p.copy_(0.5 + torch.rand(p.shape))
    return attn, rotary


def _hf_out(attn, rotary, x: np.ndarray) -> np.ndarray:
    h = torch.from_numpy(x)[None]  # [1, n, d]
    n = h.shape[1]
    pos = torch.arange(n)[None]
    mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        out = attn(hidden_states=h, position_embeddings=rotary(h, pos), attention_mask=mask)[0]
    return out[0].numpy()


def _poly_layer(case: str, attn) -> VolumetricLayer:
    opts = dict(CASES[case][3])
    layer = VolumetricLayer(type=LayerType.MHA, d_model=D, num_heads=HEADS,
                            num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_seq_len=64,
                            rope_freq_base=1000.0, **opts)  # fmt: skip
    views = layout.views(layer)
    out_proj = getattr(attn, OUT_PROJ.get(CASES[case][0], "o_proj"))
    linears = {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj, "o": out_proj}
    with torch.no_grad():
        for key, lin in linears.items():
            views[f"w_{key}"][...] = lin.weight.numpy()
            if lin.bias is not None:
                views[f"b_{key}"][...] = lin.bias.numpy()
        for key in ("q_norm", "k_norm", "sinks"):
            if views.get(key) is not None:
                views[key][...] = getattr(attn, key).weight.numpy() if "norm" in key else (
                    attn.sinks.numpy())  # fmt: skip
    return layer


@pytest.mark.parametrize("case", list(CASES))
def test_option_matches_transformers_attention(case):
    torch.set_num_threads(1)
    attn, rotary = _hf_module(case)
    x = np.random.default_rng(3).standard_normal((N, D)).astype(np.float32)
    want = _hf_out(attn, rotary, x)
    layer = _poly_layer(case, attn)
    np.testing.assert_allclose(mha.forward(layer, x), want, atol=1e-4, rtol=0)
    layer.state = None  # a fresh cache: 5 positions in one call, then one a call
    steps = [mha.forward(layer, x[:5])] + [mha.forward(layer, x[i : i + 1]) for i in range(5, N)]
    np.testing.assert_allclose(np.concatenate(steps), want, atol=1e-4, rtol=0)


def test_the_options_are_the_ones_transformers_uses():
    """The cases above exercise what they claim: each option changes transformers' output."""
    attn, rotary = _hf_module("partial_interleaved")
    assert rotary.inv_freq.numel() * 2 == 12  # rotary dims 12 of head_dim 24
    attn, _ = _hf_module("sinks")
    assert attn.sinks.abs().sum() > 0
    attn, _ = _hf_module("qk_norm_all_heads")
    assert attn.q_norm.weight.numel() == HEADS * HEAD_DIM

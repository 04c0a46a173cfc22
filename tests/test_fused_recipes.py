"""The fused C step (poly/runtime/fused.py, csrc/decode/) runs every dense family's block recipe
and attention options: a test asserts the path taken (ckernels.decode called for the prompt and
each generated token) and compares it with transformers (the prompt's last logits within 1e-4,
32 greedy tokens) and with our reference path step by step (logits within 1e-4). Prompts are 3x
the sliding windows and the contexts reach past the rows a window's cache keeps (KVCache moves
its rows: the C step reads them at their position less the cache's first)."""

from __future__ import annotations

import numpy as np
import pytest

import entity
from poly.config import AttentionConfig, BlockRecipe
from poly.nn import mha
from poly.runtime import ckernels, fused, kernels
from tests.hf_fixtures import hf_greedy, hf_logits, make_tiny_checkpoint
from tests.test_families_dense import CASES as DENSE
from tests.test_families_gemma import CASES as GEMMA
from tests.tiny_model import random_transformer, tiny_cfg

pytestmark = pytest.mark.skipif(not ckernels.AVAILABLE, reason="C kernels not built")

N_NEW = 32
PROMPT = [5, 17, 42, 99, 123, 7, 250, 3, 64, 128, 200, 11, 33, 77, 1, 180, 222, 9]  # 3 x 6
_ = (DENSE, GEMMA)  # their model types' configs are registered by the import

# name -> (model_type, config overrides)
CASES = {
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", {}),  # window 6, attention and final soft-caps, query_pre_attn_scalar
    "gemma3_text": ("gemma3_text", {}),  # local rope base on sliding layers, linear scaling
    "olmo2": ("olmo2", {}),  # post-norms only, q/k norm over all heads
    "granite": ("granite", {}),  # embedding/residual/attention multipliers, logit scale
    "glm4": ("glm4", {}),  # sandwich norms, interleaved partial rotary
    "starcoder2": ("starcoder2", {}),  # LayerNorm + bias, biased GELU MLP, window 6
    "cohere": ("cohere", {"attention_bias": True}),  # parallel block sharing its norm
    "phi": ("phi", {}),  # parallel, partial rotary, gelu_new, LM head bias
    "gpt_neox": ("gpt_neox", {}),  # parallel residual with two norms, partial rotary
    "gpt_neox_seq": ("gpt_neox", {"use_parallel_residual": False, "hidden_act": "gelu_new"}),
    "mistral_window": ("mistral", {"sliding_window": 6}),
    "phi3_default_rope": ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}),
    # MoE families' attention and multipliers around the MoE FFN (csrc/decode/moe.h)
    "olmoe": ("olmoe", {}),  # q/k norm over all heads
    "granitemoe": ("granitemoe", {}),  # multipliers: embedding, residual, attention, logits
    "gpt_oss": ("gpt_oss", {}),  # sinks, alternating window 6 / full, yarn
    # GPT-OSS-20B's 32 experts, top 4 (the C call's buffer count missed options layers' experts)
    "gpt_oss_32": ("gpt_oss", {"num_local_experts": 32, "num_experts_per_tok": 4}),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("fused_recipes")


def _spy(monkeypatch) -> list:
    calls = []
    real = ckernels.decode

    def spy(*args, **kw):
        calls.append(len(args[5]))  # the call's rows (pos)
        return real(*args, **kw)

    monkeypatch.setattr(ckernels, "decode", spy)
    return calls


def _greedy_against_reference(fast, ref, logits) -> list[int]:
    """N_NEW greedy tokens from `logits` on, each step's fused logits checked against the
    reference path's."""
    tokens = []
    for _ in range(N_NEW):
        tokens.append(int(np.argmax(logits)))
        logits, want = fast.forward(tokens[-1:]), ref.reference_forward(tokens[-1:])
        np.testing.assert_allclose(logits, want, atol=1e-4, rtol=0)
    return tokens


@pytest.mark.parametrize("name", list(CASES))
def test_fused_step_matches_transformers_and_the_reference_path(root, monkeypatch, name):
    arch, over = CASES[name]
    path = make_tiny_checkpoint(root / name, arch, seed=11, config_overrides=over)
    fast, ref = entity.load(path), entity.load(path)
    assert kernels.backend() == "c" and fused.plan(fast) is not None
    calls = _spy(monkeypatch)
    got, want = fast.forward(PROMPT), ref.reference_forward(PROMPT)
    assert sum(calls) == len(PROMPT)  # every prompt row ran in the C step
    np.testing.assert_allclose(got, hf_logits(path, PROMPT)[-1], atol=1e-4, rtol=0)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    tokens = _greedy_against_reference(fast, ref, got)
    assert len(calls) >= 1 + N_NEW and calls[-N_NEW:] == [1] * N_NEW
    assert tokens == hf_greedy(path, PROMPT, N_NEW)


# A rope recomputed per call (transformers' dynamic_rope_update), its tables' rows written
# before each fused call (poly/runtime/fused_rope.py): the 18-token prompt stays below 24
# positions, the generated tokens cross it (dynamic NTK's base grows with the length reached,
# longrope switches to its long factors)
PER_CALL = {
    "llama_dynamic": ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 3.0,
                                                    "rope_theta": 1e4},
                                "max_position_embeddings": 24}),
    "phi3_longrope": ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                                   "original_max_position_embeddings": 24,
                                                   "short_factor": [1.0 + 0.1 * i for i in range(9)],
                                                   "long_factor": [2.0 + 0.3 * i for i in range(9)]},
                               "original_max_position_embeddings": 24}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(PER_CALL))
def test_per_call_rope_takes_the_fused_step(root, monkeypatch, name):
    arch, over = PER_CALL[name]
    path = make_tiny_checkpoint(root / name, arch, seed=13, config_overrides=over)
    fast, ref = entity.load(path, max_seq_len=96), entity.load(path, max_seq_len=96)
    assert fast.config.rope_scaling.rope_type in ("dynamic", "longrope")
    assert fused.plan(fast) is not None  # (was None: the reference path ran)
    calls = _spy(monkeypatch)
    # a prompt crossing 24 in one forward (phi3's window: in calls of 7 rows), every row at the
    # whole prompt's length (first: transformers' dynamic rope keeps the longest length seen)
    long = PROMPT + PROMPT
    got = fast.forward(long)
    assert sum(calls) == len(long)
    np.testing.assert_allclose(got, ref.reference_forward(long), atol=1e-4, rtol=0)
    np.testing.assert_allclose(got, hf_logits(path, long)[-1], atol=1e-4, rtol=0)
    fast.reset(), ref.reset()
    got, want = fast.forward(PROMPT), ref.reference_forward(PROMPT)
    assert sum(calls) == len(long) + len(PROMPT)
    np.testing.assert_allclose(got, hf_logits(path, PROMPT)[-1], atol=1e-4, rtol=0)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    tokens = _greedy_against_reference(fast, ref, got)
    assert calls[-N_NEW:] == [1] * N_NEW
    assert tokens == _hf_steps(path, PROMPT, N_NEW)


def _hf_steps(path, ids: list[int], n: int) -> list[int]:
    """n greedy tokens of transformers' forward, one call per token on its KV cache (phi3's
    generate() takes another token where longrope switches: its forward per token is ours)."""
    import torch

    from tests.hf_fixtures import cached_hf_model

    model, out = cached_hf_model(str(path)), []
    with torch.no_grad():
        r = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            out.append(int(r.logits[0, -1].argmax()))
            r = model(torch.tensor([out[-1:]]), past_key_values=r.past_key_values, use_cache=True)
    return out


def test_batched_rows_with_windows_match_one_by_one(root):
    """forward_batch (prompts as rows of one call, then batched steps) of a sliding-window
    family equals each sequence alone on the reference path."""
    arch, over = CASES["gemma2"]
    path = make_tiny_checkpoint(root / "batch", arch, seed=12, config_overrides=over)
    fast, ref = entity.load(path), entity.load(path)
    prompts = [PROMPT[:9], PROMPT[4:14]]
    states = [fast.new_state() for _ in prompts]
    got = fast.forward_batch(prompts, states)
    seqs = [list(p) for p in prompts]
    for _ in range(20):
        for b, seq in enumerate(seqs):
            ref.reset()
            np.testing.assert_allclose(got[b], ref.reference_forward(seq), atol=1e-4, rtol=0)
        nxt = [int(np.argmax(row)) for row in got]
        for seq, t in zip(seqs, nxt):
            seq.append(t)
        got = fast.forward_batch([[t] for t in nxt], states)


@pytest.mark.parametrize(
    "opts",
    [
        AttentionConfig(sinks=True, sliding_window=5, window_layers=(0, 2)),  # GPT-OSS's
        AttentionConfig(nope_layers=(1,), partial_rotary_factor=0.5, rope_interleaved=True),
        AttentionConfig(qk_norm_all=True, scale=0.3, softcap=4.0),
    ],
)
def test_attention_options_on_the_fused_step(monkeypatch, opts):
    """Options no HF dense family above combines (sinks, NoPE beside interleaved partial
    rotary, q/k norm over all heads): the C step equals the reference path."""
    cfg = tiny_cfg(attention=opts, qk_norm=opts.qk_norm_all, max_seq_len=96,
                   block=BlockRecipe(post_norms=True))  # fmt: skip
    fast = random_transformer(cfg, seed=4)
    ref = random_transformer(cfg, seed=4)
    if opts.sinks:  # sinks of either sign, some above every score (before any plan is made)
        for m in (fast, ref):
            for i in range(cfg.num_layers):
                mha.views(m.attn(i)).sinks[:] = [-1.0, 0.5, 2.0, 6.0]
    assert fused.plan(fast) is not None
    calls = _spy(monkeypatch)
    prompt = [(7 * i + 3) % 120 for i in range(20)]
    got, want = fast.forward(prompt), ref.reference_forward(prompt)
    for _ in range(24):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        t = int(np.argmax(want))
        got, want = fast.forward([t]), ref.reference_forward([t])
    assert len(calls) >= 25

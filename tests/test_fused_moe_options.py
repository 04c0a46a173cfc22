"""GPT-OSS's MoE options inside the fused C decode step (csrc/decode/moe.h): router bias, softmax
over the chosen k logits, expert biases, the clamped SwiGLU (alpha 1.702, limit 7), with float32
and MXFP4 experts, against the Python reference path (poly/nn/moe.py, itself checked against
transformers' GptOssMLP in tests/test_moe_options.py and the whole GPT-OSS in
tests/test_families_moe.py): logits per decode step within 1e-4 and the same greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.mxfp4_moe import build, numpy_mxfp4
from poly.runtime import fused, kernels

pytestmark = pytest.mark.skipif(not kernels.HAVE_C, reason="needs the C extension")
PROMPT = [5, 17, 42, 99, 7, 3]


def _greedy(tf, n: int) -> tuple[np.ndarray, list[int]]:
    tf.reset()
    logits, out, steps = tf.forward(PROMPT), [], []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = tf.forward([out[-1]])
        steps.append(logits)
    return np.stack(steps), out


def _reference(tf, n: int):
    before = kernels.backend()
    kernels.set_backend("numpy")  # no fused plan: every block on the Python path
    try:
        assert fused.plan(tf) is None
        return _greedy(tf, n)
    finally:
        kernels.set_backend(before)


@pytest.mark.parametrize("mxfp4", [False, True], ids=["f32", "mxfp4"])
def test_gpt_oss_moe_options_on_the_fused_step(mxfp4, float_path):
    kernels.set_backend("c")
    # gate rows of std ~8, so the clamp (limit 7) cuts many of them
    tf = build(
        hidden=64, experts=8, width=64, layers=2, top_k=3, mxfp4=mxfp4, seed=3, gate_scale=16.0
    )
    moe = tf.config.moe
    assert moe.router_bias and moe.expert_bias and moe.gating == "softmax_topk"
    assert moe.activation == "swiglu_oai"
    p = fused.plan(tf)
    assert p is not None and len(p.moe) == 2  # both MoE blocks inside the C step
    got, toks = _greedy(tf, 16)
    ref, want = _reference(tf, 16)
    assert toks == want
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_the_options_matter(float_path):
    """The comparison above means something only if the clamp and the options change the
    outputs: the same weights without the limit (1e6), or with SiLU experts, give other logits."""
    import dataclasses

    from poly.weights import Generations

    kernels.set_backend("c")
    tf = build(
        hidden=64, experts=8, width=64, layers=2, top_k=3, mxfp4=False, seed=3, gate_scale=16.0
    )
    a, _ = _greedy(tf, 4)
    for change in ({"swiglu_limit": 1e6}, {"activation": "silu"}):
        for i in range(2):
            tf.mlp(i).moe = dataclasses.replace(tf.config.moe, **change)
        Generations.bump()
        b, _ = _greedy(tf, 4)
        assert np.abs(a - b).max() > 1e-3, change


def test_mxfp4_experts_took_the_c_kernel():
    """Without the MXFP4 kind (the state before it) the plan is refused: the fused step above ran
    on the C kernel's reading of the blocks, not on a dequantized copy."""
    kernels.set_backend("c")
    tf = build(mxfp4=True)
    assert fused.plan(tf) is not None
    with numpy_mxfp4():
        assert fused.plan(tf) is None
    assert fused.plan(tf) is not None

"""The MoE block inside the fused C decode step (csrc/decode/moe.h) against the Python reference
(poly/nn/moe.py, itself checked against transformers in tests/test_moe*.py): the same logits per
step for f32 and quantized experts, a shared expert with norm_topk_prob=False next to a dense
layer, batched rows, and the expert pager told about every expert the C step used."""

from __future__ import annotations

import numpy as np
import pytest

import entity
from benchmarks.make_moe_entity import make_moe_entity
from poly.runtime import batch, fused, kernels
from tests.hf_fixtures import make_tiny_checkpoint

PROMPT = [5, 17, 42, 99, 123, 7]
STEPS = [3, 250, 64, 11, 180, 33, 9, 77]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe_fused")
    out = {"qwen2_moe": make_tiny_checkpoint(root / "q2", "qwen2_moe", tied=False, seed=7)}
    for quant in ("f32", "q8", "q4"):
        out[quant] = make_moe_entity(root / f"syn-{quant}.entity", hidden=128, experts=8,
                                     width=96, layers=2, top_k=3, quant=quant, seed=5)  # fmt: skip
    return out


def _steps(tf) -> np.ndarray:
    """Logits [len(STEPS), V] of decode steps after the prompt."""
    tf.reset()
    tf.forward(PROMPT)
    return np.stack([tf.forward([t]) for t in STEPS])


def _reference(tf) -> np.ndarray:
    before = kernels.backend()
    kernels.set_backend("numpy")  # no fused plan: every block on the Python path
    try:
        assert fused.plan(tf) is None
        return _steps(tf)
    finally:
        kernels.set_backend(before)


@pytest.mark.skipif(not kernels.HAVE_C, reason="needs the C extension")
@pytest.mark.parametrize("name", ["qwen2_moe", "f32", "q8", "q4"])
def test_fused_moe_step_matches_the_python_path(files, name, float_path):
    tf = entity.load(files[name])
    p = fused.plan(tf)
    assert p is not None and len(p.moe) >= 1  # the MoE blocks are inside the C step
    got, ref = _steps(tf), _reference(tf)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(got, ref, atol=2e-5 * scale, rtol=0)
    assert (got.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.skipif(not kernels.HAVE_C, reason="needs the C extension")
def test_batched_moe_rows_equal_each_sequence_alone(files):
    tf = entity.load(files["qwen2_moe"])
    prompts = [[5, 17, 42], [99, 123, 7, 250], [3]]
    states = [tf.new_state() for _ in prompts]
    batch.forward_batch(tf, prompts, states)
    rows = batch.forward_batch(tf, [[11], [180], [64]], states)  # [3, V]: one fused call
    for i, (pr, nxt) in enumerate(zip(prompts, [11, 180, 64])):
        tf.reset()
        tf.forward(pr)
        alone = tf.forward([nxt])
        np.testing.assert_allclose(rows[i], alone, atol=2e-5 * np.abs(alone).max(), rtol=0)


@pytest.mark.skipif(not kernels.HAVE_C, reason="needs the C extension")
def test_expert_pager_sees_the_experts_of_the_c_step(files):
    def stats(use_c: bool) -> dict:
        tf = entity.load(files["f32"], max_resident_experts=3)
        before = kernels.backend()
        kernels.set_backend("c" if use_c else "numpy")
        try:
            assert (fused.plan(tf) is not None) == use_c
            logits = _steps(tf)
        finally:
            kernels.set_backend(before)
        rep = tf.expert_pager.report()
        return {k: rep[k] for k in ("hits", "misses", "evictions", "resident")}, logits

    (c_stats, c_logits), (py_stats, py_logits) = stats(True), stats(False)
    assert c_stats == py_stats and c_stats["resident"] == 3
    assert c_stats["hits"] + c_stats["misses"] >= len(STEPS) * 2 * 3  # top-3 in 2 layers per step
    np.testing.assert_allclose(c_logits, py_logits, atol=2e-5 * np.abs(py_logits).max(), rtol=0)


@pytest.mark.skipif(not kernels.HAVE_C, reason="needs the C extension")
@pytest.mark.parametrize("name", ["f32", "q8", "q4"])
def test_expert_fast_path_equals_the_swiglu_forward(files, name):
    from poly.runtime import experts

    # loaded under the numpy backend: no fused plan, so none of its copies (entity.load makes
    # them under the C backend, and the swiglu forward then reads those, `ckernels.kernel`):
    # both sides read the stored rows
    before = kernels.backend()
    kernels.set_backend("numpy")
    try:
        tf = entity.load(files[name])
    finally:
        kernels.set_backend(before)
    sub = tf.mlp(0).sequential_layers[3]
    for n in (1, 5, 8, 21):  # row kernels below GEMM_ROWS, gemm from there
        x = np.random.default_rng(n).standard_normal((n, 128)).astype(np.float32)
        got, ref = experts.run(sub, x), sub.forward(x)
        assert got is not None and got.shape == (n, 128)
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.skipif(not kernels.HAVE_C, reason="needs the C extension")
def test_expert_fast_path_declines_a_biased_expert(files):
    from poly.nn import layout
    from poly.runtime import experts

    tf = entity.load(files["qwen2_moe"])  # from safetensors: writable masters
    sub = tf.mlp(0).sequential_layers[0]
    x = np.ones((3, tf.config.hidden_size), np.float32)
    assert experts.run(sub, x) is not None
    layout.swiglu(sub).b_down[...] = 0.5
    sub.weights.touch()  # an in-place edit is announced (poly.weights)
    assert experts.run(sub, x) is None  # sub.forward adds the bias

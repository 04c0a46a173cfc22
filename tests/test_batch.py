"""forward_batch: one batched pass per decode step equals running the sequences separately."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from poly import Transformer, TransformerConfig
from poly.errors import LayerConfigError
from poly.model.morph import morph_network
from poly.runtime import kernels
from poly.runtime.batch import forward_batch, greedy_batch
from tests.tiny_model import random_transformer


def _model(seed: int = 0) -> Transformer:
    cfg = TransformerConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=64,
    )
    return random_transformer(cfg, seed)


PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5, 4], [42], [7, 7]]


def _separate(tf: Transformer, prompts, steps) -> list[list[np.ndarray]]:
    """Reference: each sequence alone through model.forward, fed the tokens in `steps`."""
    out = []
    for b, prompt in enumerate(prompts):
        tf.reset()
        rows = [tf.forward(prompt)]
        rows += [tf.forward([int(steps[s][b])]) for s in range(len(steps))]
        out.append(rows)
    return out


@pytest.mark.parametrize("dtype", [None, "int8", "float16"])
def test_batched_steps_equal_separate_runs(dtype):
    tf = _model()
    if dtype is not None:
        morph_network(tf.network, dtype)
    rng = np.random.default_rng(3)
    steps = rng.integers(0, 101, size=(5, len(PROMPTS)))  # [steps, B] fed tokens
    ref = _separate(tf, PROMPTS, steps)
    tf.reset()
    states = [tf.new_state() for _ in PROMPTS]
    got = [forward_batch(tf, PROMPTS, states)]
    got += [forward_batch(tf, [[int(t)] for t in row], states) for row in steps]
    for s, logits in enumerate(got):
        assert logits.dtype == np.float32 and logits.shape == (len(PROMPTS), 101)
        for b in range(len(PROMPTS)):
            np.testing.assert_allclose(logits[b], ref[b][s], rtol=1e-5, atol=1e-5)
    assert [st[0].length for st in states] == [len(p) + len(steps) for p in PROMPTS]


@pytest.mark.parametrize("backend", ["numpy", "numba", "c"])
def test_backends_agree_on_batched_step(backend):
    if backend == "numba" and not kernels.HAVE_NUMBA:
        pytest.skip("numba not installed")
    if backend == "c" and not kernels.HAVE_C:
        pytest.skip("C extension not built")
    tf = _model(seed=1)
    states = [tf.new_state() for _ in PROMPTS]
    forward_batch(tf, PROMPTS, states)
    kernels.set_backend(backend)
    try:
        got = forward_batch(tf, [[3], [4], [5], [6]], copy.deepcopy(states))
    finally:
        kernels.set_backend()
    kernels.set_backend("numpy")
    try:
        ref = forward_batch(tf, [[3], [4], [5], [6]], copy.deepcopy(states))
    finally:
        kernels.set_backend()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["numpy", "c"])
@pytest.mark.parametrize("n", [1, 2, 4, 7, 16, 17])
def test_dense_matmul_matches_float64_formula(backend, n):
    """Every row count (BLAS for one row and for many, the C kernel in between) against a
    float64 numpy product; non-contiguous x falls back to BLAS."""
    if backend == "c" and not kernels.HAVE_C:
        pytest.skip("C extension not built")
    rng = np.random.default_rng(n)
    w = rng.standard_normal((300, 129), dtype=np.float32)  # k not a multiple of 8: tail loop
    x = rng.standard_normal((n, 129), dtype=np.float32)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    kernels.set_backend(backend)
    try:
        got = kernels.dense_matmul(x, w)
        strided = kernels.dense_matmul(np.asfortranarray(x), w, np.empty((n, 300), np.float32))
    finally:
        kernels.set_backend()
    assert got.dtype == np.float32 and got.shape == (n, 300)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(strided, ref, rtol=1e-5, atol=1e-4)


def test_model_cache_is_left_alone():
    tf = _model()
    tf.reset()
    tf.forward([5, 6, 7])
    forward_batch(tf, [[1], [2]])
    assert tf.position == 3


def test_greedy_batch_equals_single_greedy():
    tf = _model(seed=2)
    tokens, seconds = greedy_batch(tf, PROMPTS, 6)
    assert tokens.shape == (len(PROMPTS), 6) and seconds >= 0
    for b, prompt in enumerate(PROMPTS):
        tf.reset()
        logits, seq = tf.forward(prompt), []
        for _ in range(6):
            seq.append(int(np.argmax(logits)))
            logits = tf.forward([seq[-1]])
        assert tokens[b].tolist() == seq


def test_state_count_must_match():
    tf = _model()
    with pytest.raises(LayerConfigError):
        forward_batch(tf, [[1], [2]], [tf.new_state()])

"""POLY_BACKEND=numpy is the pure reference: no call reaches the C extension."""

from __future__ import annotations

import numpy as np
import pytest

from poly import DType, TransformerConfig, morph_network
from poly.quant.qtensor import Q4Matrix
from poly.runtime import ckernels, kernels
from tests.tiny_model import random_transformer

pytestmark = pytest.mark.skipif(not ckernels.AVAILABLE, reason="the C extension is not built")


@pytest.fixture
def numpy_backend():
    kernels.set_backend("numpy")
    yield
    kernels.set_backend()


def _cfg() -> TransformerConfig:
    return TransformerConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=2, max_seq_len=32,
    )  # fmt: skip


def test_numpy_backend_calls_no_c(numpy_backend, monkeypatch):
    tf = random_transformer(_cfg(), seed=2)
    morph_network(tf.network, DType.INT8)
    tf.lm_head = Q4Matrix.quantize(np.ascontiguousarray(tf.lm_head))
    want = random_transformer(_cfg(), seed=2)  # for the shape only
    called = []
    for name in dir(ckernels.EXT):
        if callable(getattr(ckernels.EXT, name)) and not name.startswith("__"):
            monkeypatch.setattr(ckernels.EXT, name, lambda *a, _n=name, **k: called.append(_n))
    logits = tf.forward([1, 2, 3])  # prefill: RoPE, SwiGLU, int8 and Q4 matmuls
    logits = tf.forward([int(np.argmax(logits))])  # a decode step
    batch = tf.forward_batch([[4], [5]], [tf.new_state(), tf.new_state()])
    assert called == []
    assert logits.shape == (want.config.vocab_size,) and np.isfinite(logits).all()
    assert batch.shape == (2, want.config.vocab_size)

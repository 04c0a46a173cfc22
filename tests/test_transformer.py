"""Transformer-level behaviour on a random tiny model: KV continuation, batches, generation."""

import numpy as np
import pytest

from poly import TransformerConfig
from poly.errors import ContextOverflowError, InvalidTokenError
from poly.text.sampling import GenOptions
from tests.tiny_model import random_transformer


@pytest.fixture(scope="module")
def model():
    cfg = TransformerConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=64,
    )
    return random_transformer(cfg)


def test_logits_are_float32_and_continue_the_cache(model):
    model.reset()
    ids = [5, 17, 3, 88, 42, 7, 1]
    full = model.forward_all(ids)
    assert full.dtype == np.float32 and full.shape == (7, 97)
    model.reset()
    model.forward(ids[:5])
    assert model.position == 5
    np.testing.assert_allclose(model.forward(ids[5:6]), full[5], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(model.forward(ids[6:]), full[6], rtol=1e-5, atol=1e-5)
    model.truncate(5)
    np.testing.assert_allclose(model.forward(ids[5:6]), full[5], rtol=1e-5, atol=1e-5)


def test_forward_batch_equals_separate_runs(model):
    seqs = [[1, 2, 3], [9, 8, 7, 6, 5], [42]]
    batch = model.forward_batch(seqs)
    for row, seq in zip(batch, seqs, strict=True):
        model.reset()
        np.testing.assert_allclose(row, model.forward(seq), rtol=1e-5, atol=1e-5)


def test_greedy_generation_is_argmax_of_full_forward(model):
    done = model.generate([3, 1, 4, 1, 5], GenOptions(max_tokens=12, temperature=0.0))
    tokens = [3, 1, 4, 1, 5]
    for _ in range(12):
        model.reset()
        tokens.append(int(np.argmax(model.forward(tokens))))
    assert list(done.tokens) == tokens[5:]
    assert done.prompt_tokens == 5 and done.prefill_tok_s > 0 and done.decode_tok_s > 0


def test_bad_ids_and_overflow_are_typed(model):
    model.reset()
    with pytest.raises(InvalidTokenError):
        model.forward([])
    with pytest.raises(InvalidTokenError):
        model.forward([97])
    with pytest.raises(ContextOverflowError):
        model.forward(list(range(65)))
    assert model.position == 0


def test_memory_report_counts_weights(model):
    rep = model.memory_report()
    assert rep["embeddings"] == 97 * 64 * 4
    assert rep["MultiHeadAttention"] > 0 and rep["SwiGLU"] > 0

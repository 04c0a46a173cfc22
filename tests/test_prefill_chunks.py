"""A prompt longer than PREFILL_CHUNK runs in chunks (the attention scores of a chunk, not of the
whole prompt, are held): the last token's logits stay transformers' own, and an error in a later
chunk leaves the cache where it was before the call."""

from __future__ import annotations

import numpy as np
import pytest

import entity
from poly.errors import ContextOverflowError
from poly.model.prefill import PREFILL_CHUNK
from tests.hf_fixtures import hf_logits, make_tiny_checkpoint


@pytest.fixture(scope="module")
def snap(tmp_path_factory):
    over = {"max_position_embeddings": 4 * PREFILL_CHUNK}
    return make_tiny_checkpoint(tmp_path_factory.mktemp("chunks"), "llama", config_overrides=over)


def test_a_long_prompt_matches_transformers(snap):
    n = 2 * PREFILL_CHUNK + 37  # two full chunks and a short one
    ids = [int(i) for i in np.random.default_rng(0).integers(5, 200, n)]
    tf = entity.load(snap, max_seq_len=n + 1)
    got = tf.forward(ids)
    assert tf.position == n
    want = hf_logits(snap, ids)[-1]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_an_overflow_in_a_later_chunk_rolls_the_cache_back(snap):
    tf = entity.load(snap, max_seq_len=PREFILL_CHUNK + 100)
    tf.forward(list(range(5, 55)))
    with pytest.raises(ContextOverflowError):  # the first chunk fits, the second does not
        tf.forward([5 + i % 150 for i in range(PREFILL_CHUNK + 60)])
    assert tf.position == 50
    more = tf.forward([7, 8])  # the cache still holds the first 50 tokens
    assert tf.position == 52 and np.isfinite(more).all()

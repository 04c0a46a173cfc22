"""Issue #7 acceptance point 4 on the real model: SmolLM2-135M-Instruct's Q4_1 GGUF converted to a
q4 `.entity` keeps its blocks (entity.dotentity.native_blocks), so it runs like the GGUF itself and agrees
with the float32 path on the chat prompt (re-baked to Loom Q4_0 it agreed on 8/64 tokens)."""

from __future__ import annotations

import numpy as np
import pytest

from entity.convert import convert
from entity.dotentity.container import EntityFile
from entity.dotentity.read import load_entity
from entity.gguf.loader import load_gguf
from poly.text.sampling import GenOptions

pytestmark = pytest.mark.real_model

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in two sentences."}]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def q4_entity(smollm2_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("smol-native") / "smol-q4.entity"
    report = convert(smollm2_gguf, out, quant="q4", verify=True)
    assert report.verified and report.exact  # blocks bitwise, vectors exact
    print(f"q4 .entity {out.stat().st_size} bytes (GGUF {smollm2_gguf.stat().st_size})")
    return out


def _greedy(tf, n: int = NEW_TOKENS) -> list[int]:
    """n tokens, not stopping at EOS (so every run compares the same count)."""
    tf.reset()
    opts = GenOptions(max_tokens=n, temperature=0.0, eos_tokens=())
    return list(tf.generate(tf.prompt_ids(CHAT, chat=True), opts).tokens)


def test_blocks_are_native(q4_entity):
    ef = EntityFile(q4_entity, verify=False)
    assert ef.meta("quant")["native"] == ["gguf_q4_1", "gguf_q8_0"]
    assert ef.blobs["blocks.0.mlp.w_up"].ggml_type == 3  # Q4_1
    assert ef.blobs["embeddings"].ggml_type == 8  # Q8_0 token embedding = tied LM head
    assert not any(name.endswith(".packed") for name in ef.blobs)  # nothing re-baked


def test_greedy_agrees_with_float32(smollm2_gguf, q4_entity):
    f32 = load_gguf(smollm2_gguf, keep_quantized=False, max_seq_len=512)
    ref = _greedy(f32)
    got = _greedy(load_entity(q4_entity, max_seq_len=512))
    agree = sum(a == b for a, b in zip(ref, got))
    print(f"q4 .entity vs f32 greedy agreement: {agree}/{NEW_TOKENS}")
    assert len(ref) == len(got) == NEW_TOKENS
    assert agree >= 60


def test_logits_equal_the_gguf_quantized_path(smollm2_gguf, q4_entity, monkeypatch):
    # the busy-machine tuner may give the two prefills different BLAS thread counts (another
    # summation order, ~4e-5 apart): this test compares the weights, not the tuner
    monkeypatch.setenv("POLY_ADAPTIVE_THREADS", "0")
    gguf = load_gguf(smollm2_gguf, keep_quantized=True, max_seq_len=512)
    ours = load_entity(q4_entity, max_seq_len=512)
    ids = gguf.prompt_ids(CHAT, chat=True)
    assert ours.prompt_ids(CHAT, chat=True) == ids
    # the prompt (prefill: dequantize + BLAS), then decode steps (C kernels on the blocks)
    np.testing.assert_allclose(ours.forward_all(ids), gguf.forward_all(ids), rtol=0, atol=1e-5)
    gguf.reset(), ours.reset()
    a, b = gguf.forward(ids), ours.forward(ids)
    for _ in range(4):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
        nxt = [int(np.argmax(a))]
        a, b = gguf.forward(nxt), ours.forward(nxt)

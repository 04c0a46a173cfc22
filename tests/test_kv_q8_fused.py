"""The q8_0 KV cache in the fused C step (csrc/decode/kv_q8.h): the step quantizes each new key
and value row into llama.cpp's q8_0 blocks and attends over them. Against the Python reference
path with the same cache (poly/nn/kvcache.py, whose blocks tests/test_kv_q8.py checks against
gguf's Q8_0 and transformers), each step from the same cache: logits to float rounding (median
step within 2e-5), on every instruction-set build, for head dims 64, 128 (the unrolled value
loops) and 96, and with a sliding window; the C step is asserted to run. Against a float32 cache: close, as quantized keys and values allow. The rows the
step reads a position are 17/32 of a float16 cache's (codes + a float16 scale per 32)."""

from __future__ import annotations

import numpy as np
import pytest

from poly.config import AttentionConfig
from poly.runtime import ckernels, fused
from tests.tiny_model import random_transformer, tiny_cfg

pytestmark = pytest.mark.skipif(not ckernels.AVAILABLE, reason="C kernels not built")

PROMPT = [(7 * i + 3) % 120 for i in range(20)]
STEPS = 60  # past 64 positions: more than one block of positions in the C step's loops
SHAPES = {  # name -> (hidden, heads, kv heads): head_dim 64, 128, 96
    "hd64": (256, 4, 2),
    "hd128": (256, 2, 1),
    "hd96": (192, 2, 1),
}


def _model(name: str, kv: str, **kw):
    hidden, heads, kvh = SHAPES[name]
    cfg = tiny_cfg(hidden=hidden, num_heads=heads, num_kv_heads=kvh, max_seq_len=128, **kw)
    tf = random_transformer(cfg, seed=5)
    tf.kv_cache_dtype = kv
    return tf


def _spy(monkeypatch) -> list:
    calls, real = [], ckernels.decode

    def spy(*args, **kw):
        calls.append(len(args[5]))  # the call's rows
        return real(*args, **kw)

    monkeypatch.setattr(ckernels, "decode", spy)
    return calls


def _run(tf, ref, steps=STEPS) -> list:
    """The prompt, then `steps` greedy tokens on tf (the C step) and ref (the reference path).
    Before each step ref takes copies of tf's caches: a key that lands on a rounding tie of its
    block may take the other code from sums in another order (a 1e-6 difference), after which the
    two caches differ by a code (logits by ~1e-3). Each step's logits' largest difference."""
    got, want = tf.forward(PROMPT), ref.reference_forward(PROMPT)
    diffs = [np.abs(got - want).max()]
    for _ in range(steps):
        t = int(np.argmax(want))
        for i in range(tf.config.num_layers):
            ref.attn(i).state = tf.attn(i).state.clone()
        got, want = tf.forward([t]), ref.reference_forward([t])
        diffs.append(np.abs(got - want).max())
    return diffs


def _close(diffs) -> None:
    # the step's own new rows may still take another code (~1e-3 each); most steps agree to
    # float rounding. The prompt quantizes all its rows unsynced, so several such codes can
    # meet (5.4e-3 with a window on an AVX-512 build). Against the float32 cache these models
    # differ by 0.04-0.06.
    assert diffs[0] < 1e-2 and max(diffs[1:]) < 5e-3 and np.median(diffs) < 2e-5, diffs


@pytest.mark.parametrize("name", list(SHAPES))
def test_fused_q8_matches_the_reference_q8_path(monkeypatch, each_isa, name):
    tf, ref = _model(name, "q8_0"), _model(name, "q8_0")
    assert fused.plan(tf) is not None
    calls = _spy(monkeypatch)
    _close(_run(tf, ref))
    assert sum(calls) == len(PROMPT) + STEPS  # every row ran in the C step
    assert tf.attn(0).state.k.dtype == np.int8


def test_fused_q8_with_a_sliding_window(monkeypatch):
    att = AttentionConfig(sliding_window=12)
    tf, ref = _model("hd64", "q8_0", attention=att), _model("hd64", "q8_0", attention=att)
    calls = _spy(monkeypatch)
    _close(_run(tf, ref, steps=40))
    assert tf.attn(0).state.start > 0 and sum(calls) == len(PROMPT) + 40


def test_fused_q8_near_the_float32_cache():
    q8, f32 = _model("hd64", "q8_0"), _model("hd64", "float32")
    a, b = q8.forward(PROMPT), f32.forward(PROMPT)
    diffs = []
    for _ in range(30):
        diffs.append(np.abs(a - b).max() / np.abs(b).max())
        t = int(np.argmax(b))
        a, b = q8.forward([t]), f32.forward([t])
    assert 0 < max(diffs) < 0.02  # quantized: not equal, yet close


def test_q8_rows_are_17_32_of_float16():
    q8, f16 = _model("hd64", "q8_0"), _model("hd64", "float16")
    for tf in (q8, f16):
        tf.forward(PROMPT[:4])
    c8, c16 = q8.attn(0).state, f16.attn(0).state
    kvd = 2 * 64
    k, v = fused._kv(c8)  # what the C step reads and writes
    assert k.dtype == np.int8 and k.shape == (c8.k.shape[0], kvd + kvd // 32 * 2)
    per_pos = (k.nbytes + v.nbytes) / k.shape[0]
    f16_pos = (c16.k.nbytes + c16.v.nbytes) / c16.k.shape[0]
    assert per_pos == f16_pos / 2 + 2 * (kvd // 32) * 2  # half of float16, plus a scale per block

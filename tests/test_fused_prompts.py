"""Prompts on the fused step (poly/runtime/dispatch.py, fused.prefill_calls): a short prompt as
one call sharing each block's cache, a longer one as equal calls where they win, and a prompt
past the context refused with nothing written."""

from __future__ import annotations

import numpy as np
import pytest

from poly.errors import ContextOverflowError
from poly.runtime import ckernels, dispatch, fused
from tests.test_fused import PROMPT, quantize_all
from tests.tiny_model import random_transformer, tiny_cfg

pytestmark = [
    pytest.mark.skipif(not ckernels.AVAILABLE, reason="poly.runtime.native.ckernels not built"),
    pytest.mark.usefixtures("c_backend"),
]


def test_a_short_prompt_is_one_fused_call_with_the_last_logits(monkeypatch):
    tf = random_transformer(tiny_cfg(max_seq_len=128), seed=4)
    calls = []
    real = ckernels.decode

    def spy(layers, caches, head, x, logits, pos, *rest):
        calls.append((x.shape[0], None if logits is None else logits.shape, pos))
        return real(layers, caches, head, x, logits, pos, *rest)

    monkeypatch.setattr(ckernels, "decode", spy)
    tf.reset()
    got = tf.forward(PROMPT)
    assert calls == [(6, (1, 120), (0, 1, 2, 3, 4, 5))]  # 6 rows at positions 0..5, 1 logits row
    tf.forward(list(range(1, 11)))  # 10 more rows continue the same caches
    assert calls[-1] == (10, (1, 120), tuple(range(6, 16)))
    assert tf.position == 16
    tf.forward(list(range(20, 37)))  # 17 tokens: still one call (up to STEP_ROWS)
    assert calls[-1] == (17, (1, 120), tuple(range(16, 33)))
    tf.forward([5] * 65)  # 65 tokens on a model this narrow: two calls where fused calls win
    if ckernels.SIMD:  # the first without logits (its last block stops at k and v)
        assert calls[3:] == [
            (32, None, tuple(range(33, 65))),
            (33, (1, 120), tuple(range(65, 98))),
        ]
    else:
        assert len(calls) == 3  # the reference path
    assert tf.position == 98
    monkeypatch.setattr(fused, "plan", lambda model: None)
    tf.reset()
    np.testing.assert_allclose(got, tf.forward(PROMPT), rtol=0, atol=1e-5 * np.abs(got).max())


@pytest.mark.parametrize(
    ("hidden", "scheme", "n", "wins"),
    [
        (64, "float32", 512, True),  # as narrow as dispatch.SMALL_WIDTH or narrower: every form
        (64, "gguf_q4_0", 512, True),
        (64, "loom_q4", 320, True),  # dispatch.NARROW_EXCEPT: up to NARROW_EXCEPT_MAX tokens
        (64, "loom_q4", 321, False),
        (1280, "float32", 65, False),  # wider: the block kinds of dispatch.CALLS_WIN alone
        (1280, "float16", 512, True),
        (1280, "gguf_q4_1", 512, True),
        (1280, "gguf_q4_0", 65, False),
        (1280, "gguf_q4_k", 65, False),
        (1280, "loom_q4", 65, False),
    ],
)
def test_which_long_prompts_run_as_fused_calls(hidden, scheme, n, wins):
    cfg = tiny_cfg(
        hidden=hidden, inter=256, num_layers=1, num_heads=hidden // 64, num_kv_heads=hidden // 256
    )
    tf = random_transformer(cfg, seed=4)
    if scheme != "float32":
        quantize_all(tf, scheme)
    assert dispatch.calls_win(tf, fused.plan(tf), n) == (wins and ckernels.SIMD)


def _decode_calls(monkeypatch) -> list:
    """(rows, first position) of each fused call from now on (ckernels.decode spied on)."""
    calls, real = [], ckernels.decode

    def spy(layers, caches, head, x, logits, pos, *rest):
        calls.append((x.shape[0], pos[0]))
        return real(layers, caches, head, x, logits, pos, *rest)

    monkeypatch.setattr(ckernels, "decode", spy)
    return calls


def test_a_long_prompt_runs_as_equal_fused_calls_where_they_win(monkeypatch):
    """Past STEP_ROWS tokens a prompt runs as ceil(n / 64) fused calls of equal size where
    dispatch.calls_win, with the reference path's logits."""
    tf = random_transformer(tiny_cfg(max_seq_len=256), seed=4)
    quantize_all(tf, "float16")
    calls = _decode_calls(monkeypatch)
    monkeypatch.setattr(dispatch, "calls_win", lambda model, plan, n: True)
    prompt = [(7 * i + 3) % 120 for i in range(129)]
    tf.reset()
    got = tf.forward(prompt)
    assert calls == [(43, 0), (43, 43), (43, 86)] and tf.position == 129
    monkeypatch.setattr(fused, "plan", lambda model: None)
    tf.reset()
    np.testing.assert_allclose(got, tf.forward(prompt), rtol=0, atol=2e-5 * np.abs(got).max())


@pytest.mark.parametrize("scheme", ["float32", "float16", "gguf_q4_k", "gguf_q8_0"])
def test_a_long_prompts_calls_but_the_last_skip_the_head(scheme, monkeypatch):
    """The fused calls of a long prompt but its last take no logits (None): their last block
    stops at its k and v, no FFN, no head. The logits and every cache equal, bitwise, those of
    the same calls each running the head (as before), and the reference path's within 2e-5
    (float) or 3e-2 (quantized)."""
    tf = random_transformer(tiny_cfg(hidden=256, inter=512, max_seq_len=256), seed=5)
    if scheme != "float32":
        quantize_all(tf, scheme)
    monkeypatch.setattr(dispatch, "calls_win", lambda model, plan, n: True)
    prompt = [(11 * i + 4) % 120 for i in range(150)]
    heads = []
    real = ckernels.decode

    def spy(layers, caches, head, x, logits, pos, *rest):
        heads.append(logits is not None)
        return real(layers, caches, head, x, logits, pos, *rest)

    def run(fn):
        tf.reset()
        out = fn()
        kv = [np.array(a[:150]) for i in range(3) for a in (tf.attn(i).state.k, tf.attn(i).state.v)]
        return out, kv

    monkeypatch.setattr(ckernels, "decode", spy)
    got, kv = run(lambda: tf.forward(prompt))
    assert heads == [False, False, True] and tf.position == 150
    p, x = fused.plan(tf), tf.embed(np.array(prompt))  # x [150, d]

    def every_call_with_its_head():
        caches = fused._prompt_caches(p, 150)
        return [
            fused._prompt_call(p, np.array(x[r : r + 50], np.float32), caches, True)
            for r in (0, 50, 100)
        ]

    old, kv_old = run(every_call_with_its_head)
    np.testing.assert_array_equal(got, old[-1])
    for a, b in zip(kv, kv_old):
        np.testing.assert_array_equal(a, b)
    monkeypatch.setattr(fused, "plan", lambda model: None)
    ref, kv_ref = run(lambda: tf.forward(prompt))
    tol = 2e-5 if scheme in ("float32", "float16") else 3e-2
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol * np.abs(ref).max())
    for a, b in zip(kv, kv_ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * np.abs(b).max())


def test_a_long_fused_prompt_past_the_context_is_refused_with_nothing_written(monkeypatch):
    monkeypatch.setattr(dispatch, "calls_win", lambda model, plan, n: True)
    tf = random_transformer(tiny_cfg(max_seq_len=100), seed=4)
    tf.reset()
    tf.forward(PROMPT)
    with pytest.raises(ContextOverflowError):
        tf.forward(list(range(1, 100)))
    assert tf.position == 6


def test_a_fused_prompt_past_the_context_is_refused():
    tf = random_transformer(tiny_cfg(max_seq_len=8), seed=4)
    tf.reset()
    tf.forward(PROMPT)
    with pytest.raises(ContextOverflowError, match="6 cached \\+ 3 new tokens > max_seq_len 8"):
        tf.forward([1, 2, 3])
    assert tf.position == 6  # nothing written


@pytest.mark.parametrize("scheme", ["float32", "bfloat16"])
def test_a_prompt_on_gemm_panels_with_x_at_a_padded_stride(scheme, each_isa, monkeypatch):
    """40 rows of width 256 (a multiple of 256: the panels read x copied at a padded stride,
    csrc/gemm/gemm.h gemm_ldx) in one fused call, equal to the reference path."""
    tf = random_transformer(tiny_cfg(hidden=256, inter=512, max_seq_len=64), seed=5)
    if scheme != "float32":
        quantize_all(tf, scheme)
    prompt = [(5 * i + 1) % 120 for i in range(40)]
    tf.reset()
    got = tf.forward(prompt)
    monkeypatch.setattr(fused, "plan", lambda model: None)
    tf.reset()
    np.testing.assert_allclose(got, tf.forward(prompt), rtol=0, atol=2e-5 * np.abs(got).max())


@pytest.mark.parametrize("scheme", ["float32", "float16", "gguf_q4_k", "gguf_q8_0"])
def test_the_last_block_runs_its_ffn_on_the_last_row_only(scheme, monkeypatch):
    """A prompt's logits (the fused step's, and the reference path's) skip the last block's FFN
    for every row but the last (no later block reads them): they equal forward_all's last row,
    which runs every row, and every row's keys and values are cached as forward_all caches them
    (bitwise on the reference path, which runs the same products for them). Float weights within
    1e-5; quantized ones within 3e-2 (one row's decode rows take other int8 codes of x than a
    prompt's panels)."""
    tf = random_transformer(tiny_cfg(hidden=256, inter=512, max_seq_len=128), seed=9)
    if scheme != "float32":
        quantize_all(tf, scheme)
    ids = [(5 * i + 2) % 120 for i in range(12)]

    def run(fn):
        tf.reset()
        out = fn(ids)
        kv = [
            np.array(a[: tf.attn(i).state.length])
            for i in range(3)
            for a in (tf.attn(i).state.k, tf.attn(i).state.v)
        ]
        return out, kv

    every, kv_all = run(tf.forward_all)  # [12, V]: every row through every block
    ref, kv_ref = run(tf.reference_forward)
    scale = np.abs(every[-1]).max()
    # one row takes the decode rows (x's int8 codes of that row in the auto mode), 12 the panels
    tol = 1e-5 if scheme in ("float32", "float16") else 3e-2
    np.testing.assert_allclose(ref, every[-1], rtol=0, atol=tol * scale)
    for a, b in zip(kv_ref, kv_all):
        np.testing.assert_array_equal(a, b)
    assert fused.plan(tf) is not None
    got, kv_fused = run(tf.forward)  # one fused call, its logits of the last row only
    np.testing.assert_allclose(got, every[-1], rtol=0, atol=tol * scale)
    for a, b in zip(kv_fused, kv_all):
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * np.abs(b).max())


def test_a_prompt_reaching_past_long_context_runs_on_the_reference_path(monkeypatch):
    """Past dispatch.LONG_CONTEXT (the cache's length and the prompt's) a longer prompt than
    one call takes runs on the reference path (its attention two GEMMs per 128 queries), even
    where fused calls win; short of it, and for a prompt of one call, the fused calls."""
    tf = random_transformer(tiny_cfg(max_seq_len=256), seed=4)
    monkeypatch.setattr(dispatch, "calls_win", lambda model, plan, n: True)
    monkeypatch.setattr(dispatch, "LONG_CONTEXT", 120)
    calls = _decode_calls(monkeypatch)
    prompt = [(7 * i + 3) % 120 for i in range(100)]
    tf.reset()
    tf.forward(prompt)  # ends at 100: fused calls
    assert calls == [(50, 0), (50, 50)]
    got = tf.forward(prompt[:30])  # one call's worth: fused although it ends at 130
    assert calls[2:] == [(30, 100)]
    tf.reset()
    calls.clear()
    long = tf.forward(prompt + prompt[:30])  # 130 tokens from 0: the reference path
    assert calls == [] and tf.position == 130
    np.testing.assert_allclose(long, got, rtol=0, atol=2e-5 * np.abs(got).max())

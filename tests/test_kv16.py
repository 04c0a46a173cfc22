"""The float16 KV cache option (`Transformer.kv_cache_dtype = "float16"`): the fused C step rounds
keys and values as numpy's astype(float16) does (nearest even, subnormals, overflow), on every
instruction-set build, and attends the stored halves like the Python path does; the cache takes
half the memory."""

from __future__ import annotations

import numpy as np
import pytest

from poly.errors import DTypeError
from poly.nn import mha
from poly.runtime import ckernels, fused
from tests.tiny_model import decode_call, random_transformer, tiny_cfg

pytestmark = [
    pytest.mark.skipif(not ckernels.AVAILABLE, reason="poly.runtime.native.ckernels not built"),
    pytest.mark.usefixtures("c_backend"),
]


def _run(tf, prompt, steps, use_fused, monkeypatch) -> list[np.ndarray]:
    with monkeypatch.context() as m:
        if not use_fused:
            m.setattr(fused, "plan", lambda model: None)
        tf.reset()
        out = [tf.forward(prompt)]
        out += [tf.forward([(5 * i + 1) % 120]) for i in range(steps)]
    return out


@pytest.mark.parametrize("head_dim", (64, 128, 24))  # the unrolled widths, and the scalar loop
def test_float16_cache_matches_the_python_path(head_dim, monkeypatch, each_isa):
    """A 300-token prompt (the Python prefill) then decode steps on the fused step: both paths
    read the same float16 keys, so they agree as closely as with a float32 cache; the logits
    move from the float32 cache's by the rounding of the keys and values only."""
    cfg = tiny_cfg(hidden=128, num_heads=2, num_kv_heads=1, head_dim=head_dim, max_seq_len=400)
    tf = random_transformer(cfg, seed=11)
    prompt = [(7 * i + 3) % 120 for i in range(300)]
    exact = _run(tf, prompt, 3, True, monkeypatch)
    tf.kv_cache_dtype = "float16"
    assert fused.plan(tf) is not None and tf.kv_cache_dtype == np.float16
    ref = _run(tf, prompt, 3, False, monkeypatch)
    got = _run(tf, prompt, 3, True, monkeypatch)
    assert tf.attn(0).state.k.dtype == np.float16
    for r, g, e in zip(ref, got, exact):
        scale = np.abs(r).max()
        np.testing.assert_allclose(g, r, rtol=0, atol=2e-4 * scale)
        assert 0 < np.abs(e - r).max() < 2e-2 * scale  # rounded, not another computation


def test_fused_step_rounds_like_numpy(monkeypatch, each_isa):
    """Block 0's keys and values (they do not depend on the cache) over 15 decades, from values
    that round to zero through subnormals to overflow: the float16 cache holds exactly numpy's
    rounding of what the float32 cache holds, through the 8-lane stores and the scalar tail."""
    cfg = tiny_cfg(hidden=64, num_heads=4, num_kv_heads=2, head_dim=20, max_seq_len=64)
    tf = random_transformer(cfg, seed=5)
    views = mha.views(tf.attn(0))
    kv = views.w_k.shape[0]
    views.w_k *= (10.0 ** np.linspace(-9, 6, kv, dtype=np.float32))[:, None]  # [kv, d] by row
    views.w_v *= (10.0 ** np.linspace(6, -9, kv, dtype=np.float32))[:, None]
    views.b_k[:] = views.b_v[:] = 0  # the random biases would set the smallest values
    prompt = [3, 17, 5, 42, 9, 11, 60, 2, 99]
    assert fused.plan(tf) is not None
    with np.errstate(all="ignore"):
        tf.forward(prompt)  # one fused call: every prompt row writes its keys and values
        tf.forward([8])  # and one decode step
    f32 = tf.attn(0).state
    with np.errstate(over="ignore"):  # the largest round to infinity
        want_k, want_v = f32.k[:10].astype(np.float16), f32.v[:10].astype(np.float16)
    tf.kv_cache_dtype = "f16"
    with np.errstate(all="ignore"):
        tf.forward(prompt)
        tf.forward([8])
    f16 = tf.attn(0).state
    assert f16.k.dtype == np.float16 and f16.length == 10
    got_k, got_v = f16.k[:10].view(np.uint16), f16.v[:10].view(np.uint16)
    np.testing.assert_array_equal(got_k, want_k.view(np.uint16))
    np.testing.assert_array_equal(got_v, want_v.view(np.uint16))
    for want in (want_k, want_v):  # the range was covered
        a = np.abs(want.astype(np.float32))
        assert (a == 0).any() and ((a > 0) & (a < 6.1e-5)).any() and np.isinf(a).any()


def test_the_option_is_checked_and_halves_the_cache():
    tf = random_transformer(tiny_cfg(max_seq_len=64), seed=3)
    tf.forward([1, 2, 3])
    full = tf.memory_report()["kv_cache"]
    for bad in ("bfloat16", "int8", None, 3):
        with pytest.raises(DTypeError):
            tf.kv_cache_dtype = bad
    tf.kv_cache_dtype = "float16"
    assert tf.position == 0  # a new dtype starts from an empty cache
    tf.forward([1, 2, 3])
    assert tf.memory_report()["kv_cache"] * 2 == full
    tf.kv_cache_dtype = np.float32
    tf.forward([1, 2, 3])
    assert tf.memory_report()["kv_cache"] == full


def test_the_extension_refuses_mixed_or_foreign_caches():
    p, caches, x, logits = decode_call()
    for swap in (np.float16, np.int32, np.float64):
        bad = list(caches)
        bad[1] = np.zeros(caches[1].shape, swap)  # block 0's v cache
        with pytest.raises(ValueError):
            ckernels.EXT.decode(p.layers, tuple(bad), p.head, x, logits, (1,), False)
    ckernels.EXT.decode(p.layers, tuple(caches), p.head, x, logits, (1,), False)
    assert np.isfinite(logits).all()


def test_server_pools_hold_float16_and_match_the_contiguous_caches(tmp_path):
    """The server's page pools follow the option: paged decode (pages of 3 positions) gives the
    contiguous float16 caches' logits exactly, and greedy batches equal single sequences."""
    import entity
    from poly.serving import SamplingParams, Scheduler
    from poly.serving.kv import ContiguousKV
    from poly.serving.paged import PagedKV
    from tests.hf_fixtures import make_tiny_checkpoint

    model = entity.load(str(make_tiny_checkpoint(tmp_path / "llama", "llama", seed=3)))
    model.kv_cache_dtype = "f16"
    prompts = [list(model.tokenizer.encode(t)) for t in ("Hello world!", "Once upon a time")]
    p = SamplingParams(max_tokens=16, temperature=0.0, logprobs=3)
    out = []
    for kv in (ContiguousKV(model), PagedKV(model, 200, page_size=3)):
        s = Scheduler(model, kv=kv)
        hs = [s.submit(x, p) for x in prompts]
        while s.step():
            pass
        out.append(
            [[(lp.token_id, lp.logprob) for lp in h.result(0).choices[0].logprobs] for h in hs]
        )
    assert out[0] == out[1]
    for x, got in zip(prompts, out[0]):
        done = model.generate(x, temperature=0.0, top_k=0, max_tokens=16, repetition_penalty=1.0)
        assert [t for t, _ in got] == list(done.tokens)
    assert kv.k[0].dtype == np.float16
    model.kv_cache_dtype = "f32"
    assert PagedKV(model, 10, page_size=3).page_bytes == 2 * kv.page_bytes

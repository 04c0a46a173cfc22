"""Issue 55 item 5: a fresh process's first turn does no one-time work its second does not.

The fused step reads copies of the matrices (poly/runtime/repack.py: rows by 16 or 8, float rows
by 16); they were made by the first forward (SmolLM2 Q4_1: 0.38 s against 0.05 s for the next
prompt). `entity.load` now makes them (`fused.prepare`). Counted here, never timed: the speed is
measured by `lucy bench` (first_turn_ttft_s, second_turn_ttft_s) and benchmarks/first_turn.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from poly.runtime import ckernels, kernels, repack

needs_c = pytest.mark.skipif(not ckernels.AVAILABLE, reason="no C kernels in this build")
ONE_TIME = (
    "interleave16",
    "kquant_interleave8",
    "kquant_interleave8_q6",
    "float_kmajor16",
)  # what makes the fused step's copies


@pytest.fixture
def one_time_calls(monkeypatch):
    """The calls of repack's one-time functions from now on, by name (they run as before)."""
    calls: list[str] = []
    for name in ONE_TIME:
        real = getattr(repack, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*a, **kw)

        monkeypatch.setattr(repack, name, counted)
    return calls


@needs_c
def test_load_leaves_no_repacking_to_the_first_turn(smollm2_gguf, one_time_calls, monkeypatch):
    """The real SmolLM2 Q4_1 GGUF: loading makes every copy (one per matrix, 211), and the
    first turn (a chat prompt, then decode steps) makes none; its logits are the second turn's."""
    import entity

    if kernels.backend() != "c":
        pytest.skip("the C backend is not in use")
    # every copy made here, none read from the on-disk layout cache (tests/test_layout_cache.py)
    monkeypatch.setenv("POLY_LAYOUT_CACHE", "0")
    model = entity.load(smollm2_gguf)
    made_at_load = len(one_time_calls)
    ids = model.prompt_ids("What is the capital of France?", chat=True)
    turns = []
    for _ in range(2):
        model.reset()
        logits = [model.forward(ids)]
        for _ in range(3):
            logits.append(model.forward([int(np.argmax(logits[-1]))]))
        turns.append(np.stack(logits))
    assert made_at_load >= 7 * model.config.num_layers  # q, k, v, o, gate, up, down per block
    assert one_time_calls[made_at_load:] == []  # nothing left for the first turn
    np.testing.assert_array_equal(turns[0], turns[1])


@needs_c
@pytest.mark.parametrize("busy", [False, True])
def test_a_fresh_processs_first_prompt_checks_the_load(busy, monkeypatch):
    """No tuner has found anything yet (a fresh process): the first prompt's fused call runs
    on fewer threads while other processes hold the cores (all threads waited at every
    barrier: 0.7-2.4 s for a first SmolLM2 prompt on 2 loaded cores, 0.1 s on one), and the
    decode steps after it start there too; on a quiet machine all threads run."""
    from poly import TransformerConfig
    from poly.runtime import fused, prefill
    from tests.tiny_model import random_transformer

    cfg = TransformerConfig(hidden_size=64, intermediate_size=96, vocab_size=120, num_layers=2,
                            num_heads=4, num_kv_heads=2, max_seq_len=64)  # fmt: skip
    tf = random_transformer(cfg, seed=3)
    seen = []
    real = ckernels.decode
    monkeypatch.setattr(ckernels, "decode", lambda *a: (seen.append(a[6]), real(*a))[1])
    monkeypatch.setattr(prefill, "room_for", lambda threads: not busy)
    monkeypatch.delenv("POLY_ADAPTIVE_THREADS", raising=False)
    before = kernels.num_threads()
    kernels.set_num_threads(2)
    fused.SHARED.found(0, 0)  # nothing found yet
    try:
        tf.forward([3, 17, 5, 42, 9])
        tf.forward([7])
        advice = fused.SHARED.advice(2)
    finally:
        fused.SHARED.found(0, 0)
        kernels.set_num_threads(before)
    assert seen == ([1, 1] if busy else [2, 2])
    assert advice == (1 if busy else 2)


@needs_c
def test_lucy_bench_prints_both_turns_first_token_times(smollm2_gguf, capsys):
    """`lucy bench` reports the first turn's and the second turn's first-token seconds."""
    from lucy import cli

    args = ["bench", str(smollm2_gguf), "--prompt-tokens", "12", "--new-tokens", "2"]
    assert cli.run([*args, "--runs", "1", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["first_turn_ttft_s"] > 0 and res["second_turn_ttft_s"] > 0
    assert cli.run([*args, "--runs", "1"]) == 0
    table = capsys.readouterr().out
    assert "first_turn_ttft_s" in table and "second_turn_ttft_s" in table

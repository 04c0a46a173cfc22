"""Reliability catalogue B8 (inference API) on a tiny random llama loaded by our GGUF loader.

References are the same model run without tricks: a fresh greedy generation over the same ids
(no KV reuse), so "consistent" is checked against an independent computation, not a constant.
"""

from __future__ import annotations

import gc
import math
import os
import threading

import numpy as np
import pytest

from poly.errors import (
    ContextOverflowError,
    GenerationError,
    InvalidTokenError,
    ModelBusyError,
    NumericalError,
    SamplingParamsError,
)
from poly.text.generation import DoneEvent, generate_text, stream_tokens
from poly.text.sampling import GenOptions, Sampler
from poly.text.session import ChatSession
from tests.fuzz.corpus import expect_error, tiny_model

pytestmark = pytest.mark.timeout(120)
GREEDY = GenOptions(temperature=0.0, max_tokens=6)
CTX = 64


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny matrices: a parallel kernel pool only spins on this shared 2-core machine
    from poly.runtime import kernels

    kernels.set_num_threads(1)
    yield
    kernels.set_num_threads(None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture
def tf(model_dir):
    return tiny_model(model_dir, hidden=32, layers=2, max_seq_len=CTX)


def _greedy_reference(tf, ids, n):
    """Token-by-token argmax without KV reuse across calls: full forward_all each step."""
    seq, out = list(ids), []
    for _ in range(n):
        tf.reset()
        logits = tf.forward_all(seq)[-1]
        tok = int(np.argmax(logits))
        out.append(tok)
        seq.append(tok)
    tf.reset()
    return out


def _fresh_greedy(tf, ids, n=6):
    return list(generate_text(tf, ids, GREEDY.replace(max_tokens=n, eos_tokens=())).tokens)


def test_greedy_matches_no_cache_reference(tf):
    ids = tf.tokenizer.encode("hello world")
    assert _fresh_greedy(tf, ids) == _greedy_reference(tf, ids, 6)


# --- B8-101 empty prompt ---------------------------------------------------------------------


@pytest.mark.parametrize("prompt", [[], ""], ids=["no-ids", "empty-text"])
def test_b8_101_empty_prompt(tf, prompt):
    ids = tf.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    assert ids == []
    expect_error(lambda: generate_text(tf, ids, GREEDY), GenerationError, "invalid_token")
    expect_error(lambda: tf.generate(prompt, GREEDY), GenerationError)
    assert _fresh_greedy(tf, [1, 2, 3]) == _greedy_reference(tf, [1, 2, 3], 6)


# --- B8-104 out-of-vocabulary ids --------------------------------------------------------------


@pytest.mark.parametrize(
    "ids", [[-1], [258], [1, 2, 2**40], [1, -(2**63)], [[1, 2]], [1.5]],
    ids=["negative", "vocab", "huge", "min-int", "nested", "float"],
)  # fmt: skip
def test_b8_104_invalid_ids_leave_cache_unchanged(tf, ids):
    generate_text(tf, [5, 6, 7], GREEDY.replace(max_tokens=1))
    pos = tf.position
    logits_before = tf.forward_all([9])[-1].copy()
    tf.truncate(pos)
    expect_error(lambda: generate_text(tf, ids, GREEDY, start_fresh=False), InvalidTokenError,
                 "invalid_token")  # fmt: skip
    assert tf.position == pos
    np.testing.assert_array_equal(tf.forward_all([9])[-1], logits_before)


@pytest.mark.parametrize("field", ["banned_tokens", "eos_tokens"])
def test_b8_104_option_ids_out_of_vocab(tf, field):
    opts = GREEDY.replace(**{field: (3, 10_000)})
    expect_error(
        lambda: generate_text(tf, [1, 2], opts), SamplingParamsError, "bad_sampling_params"
    )


# --- B8-102 / 103 context ------------------------------------------------------------------------


def test_b8_102_prompt_longer_than_context(tf):
    long = list(range(1, CTX + 5))
    expect_error(lambda: generate_text(tf, long, GREEDY), ContextOverflowError, "context_overflow")
    at_limit = list(range(1, CTX + 1))  # no slot left for a new token
    expect_error(lambda: generate_text(tf, at_limit, GREEDY), ContextOverflowError)
    budget = list(range(1, CTX - 2))  # prompt fits, prompt + max_tokens does not
    expect_error(lambda: generate_text(tf, budget, GREEDY), ContextOverflowError)
    assert _fresh_greedy(tf, [1, 2, 3]) == _greedy_reference(tf, [1, 2, 3], 6)


def test_b8_103_context_fills_during_generation(tf):
    prompt = list(range(1, CTX - 3))
    done = generate_text(
        tf, prompt, GREEDY.replace(max_tokens=50, truncate="output", eos_tokens=())
    )
    assert done.stop_reason == "context" and len(done.tokens) == CTX - len(prompt)
    assert tf.position <= CTX
    assert list(done.tokens) == _greedy_reference(tf, prompt, len(done.tokens))


def test_b8_102_left_truncation_keeps_newest_tokens(tf):
    prompt = list(range(1, CTX + 20))
    opts = GREEDY.replace(max_tokens=4, truncate="left", eos_tokens=())
    done = generate_text(tf, prompt, opts)
    kept = prompt[len(prompt) - (CTX - 4) :]
    assert list(done.tokens) == _greedy_reference(tf, kept, 4)


def test_b8_102_session_drops_oldest_turns(model_dir):
    tf = tiny_model(model_dir, hidden=32, layers=2, max_seq_len=256)
    s = ChatSession(tf, options=GREEDY.replace(max_tokens=2))
    with pytest.raises(ContextOverflowError):
        for i in range(40):
            for _ in s.send(f"turn {i}"):
                pass
    turns = s.turns
    assert turns >= 3
    assert s.drop_oldest_turns(3) == 3 and len(s.history) == 2 * (turns - 3)
    done = list(s.send("again"))[-1]
    msgs = s.history[:-2] + [{"role": "user", "content": "again"}]
    ids = tf.tokenizer.encode(tf.chat_template.render(msgs), add_special_tokens=False)
    assert list(done.tokens) == _greedy_reference(tf, ids, len(done.tokens))


# --- B8-105 sampling parameters -----------------------------------------------------------------

BAD_PARAMS = [
    ("temperature", -1.0), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "0.7"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan), ("top_k", -5), ("top_k", 2.5), ("top_k", True),
    ("min_p", 1.5), ("min_p", -0.1), ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 2.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("seed", 1.5), ("seed", "42"), ("seed", -1), ("min_tokens", -1), ("stop", ("",)), ("stop", 5),
    ("truncate", "middle"), ("no_repeat_ngram", -2),
]  # fmt: skip


@pytest.mark.parametrize("name,value", BAD_PARAMS, ids=[f"{n}={v!r}" for n, v in BAD_PARAMS])
def test_b8_105_invalid_sampling_params(name, value):
    exc = expect_error(
        lambda: GenOptions(**{name: value}), SamplingParamsError, "bad_sampling_params"
    )
    assert name in str(exc)
    expect_error(lambda: GenOptions().replace(**{name: value}), SamplingParamsError)


def test_b8_105_documented_special_values(tf):
    # temperature 0 = greedy, top_k 0 = disabled: both valid and meaning what the docs say
    logits = np.random.default_rng(0).standard_normal(258).astype(np.float32)
    assert Sampler(GenOptions(temperature=0.0), 258).sample(logits) == int(np.argmax(logits))
    s = Sampler(GenOptions(temperature=1.0, top_k=0, seed=3), 258)
    probs = s.probabilities(logits)
    ref = np.exp(logits.astype(np.float64) - logits.max())
    np.testing.assert_allclose(probs, ref / ref.sum(), rtol=1e-6)


def test_b8_105_min_tokens_above_max(tf):
    expect_error(lambda: GenOptions(min_tokens=5, max_tokens=2), SamplingParamsError)


# --- B8-106 NaN / Inf logits ----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("step", [0, 2])
def test_b8_106_non_finite_logits(tf, monkeypatch, bad, step):
    real = tf.forward
    calls = {"n": 0}

    def poisoned(ids):
        out = real(ids).copy()
        if calls["n"] == step:
            out[7] = bad
        calls["n"] += 1
        return out

    monkeypatch.setattr(tf, "forward", poisoned)
    opts = GREEDY.replace(max_tokens=5, eos_tokens=())
    expect_error(lambda: generate_text(tf, [1, 2, 3], opts), NumericalError, "numerical")
    monkeypatch.setattr(tf, "forward", real)
    assert _fresh_greedy(tf, [1, 2, 3]) == _greedy_reference(tf, [1, 2, 3], 6)  # still usable


def test_b8_106_all_nan_sampled_path(tf, monkeypatch):
    monkeypatch.setattr(tf, "forward", lambda ids: np.full(258, np.nan, np.float32))
    opts = GenOptions(temperature=1.0, top_p=0.9, seed=0, max_tokens=3)
    expect_error(lambda: generate_text(tf, [1, 2], opts), NumericalError, "numerical")


# --- B8-107 concurrency ------------------------------------------------------------------------------


def test_b8_107_two_threads_busy_or_serialized(tf):
    ids = [1, 2, 3, 4]
    want = _fresh_greedy(tf, ids, 8)
    results, errors = [], []
    barrier = threading.Barrier(2)

    def worker():
        barrier.wait()
        for _ in range(10):
            try:
                results.append(_fresh_greedy(tf, ids, 8))
            except ModelBusyError as exc:
                assert exc.code == "model_busy"
                errors.append(exc)

    old = os.sys.getswitchinterval()
    os.sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        os.sys.setswitchinterval(old)
    assert len(results) + len(errors) == 20
    assert all(r == want for r in results)  # whoever ran, ran alone


def test_b8_107_stream_holds_lock_until_closed(tf):
    s = stream_tokens(tf, [1, 2, 3], GREEDY.replace(max_tokens=10, eos_tokens=()))
    next(s)
    expect_error(lambda: generate_text(tf, [4, 5], GREEDY), ModelBusyError, "model_busy")
    s.close()
    assert _fresh_greedy(tf, [4, 5]) == _greedy_reference(tf, [4, 5], 6)


def test_b8_107_abandoned_stream_released_by_gc(tf):
    s = stream_tokens(tf, [1, 2, 3], GREEDY.replace(max_tokens=10, eos_tokens=()))
    next(s)
    del s
    gc.collect()
    assert _fresh_greedy(tf, [4, 5]) == _greedy_reference(tf, [4, 5], 6)


def test_b8_107_never_started_stream_released(tf):
    s = stream_tokens(tf, [1, 2, 3], GREEDY)
    s.close()
    assert _fresh_greedy(tf, [4, 5]) == _greedy_reference(tf, [4, 5], 6)


# --- B8-108 interrupted generation ---------------------------------------------------------------


def test_b8_108_keyboard_interrupt_mid_stream(tf):
    n = {"i": 0}

    def stop():
        n["i"] += 1
        if n["i"] == 3:
            raise KeyboardInterrupt
        return False

    with pytest.raises(KeyboardInterrupt):
        generate_text(tf, [1, 2, 3], GREEDY.replace(max_tokens=10), stop=stop)
    assert _fresh_greedy(tf, [7, 8]) == _greedy_reference(tf, [7, 8], 6)


def test_b8_108_interrupted_chat_turn_stays_consistent(model_dir):
    tf = tiny_model(model_dir, hidden=32, layers=2, max_seq_len=256)
    opts = GREEDY.replace(max_tokens=8, eos_tokens=())
    s = ChatSession(tf, options=opts)
    for _ in s.send("first"):
        pass
    stream = s.send("second question")
    for i, _ev in enumerate(stream):
        if i == 2:
            break
    stream.close()  # the user pressed Ctrl-C: partial reply kept
    events = list(s.send("third"))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    # the KV-reusing session must match a fresh run over the same rendered conversation
    msgs = s.history[:-2] + [{"role": "user", "content": "third"}]
    ids = tf.tokenizer.encode(tf.chat_template.render(msgs), add_special_tokens=False)
    assert list(done.tokens) == _greedy_reference(tf, ids, len(done.tokens))


# --- acceptance 4: 1,000 turns with /reset, RSS growth < 20 MB ------------------------------------


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_acceptance_4_thousand_turns_rss(model_dir):
    tf = tiny_model(model_dir, hidden=32, layers=1, max_seq_len=512)
    s = ChatSession(
        tf, system="be brief", options=GenOptions(temperature=0.8, seed=1, max_tokens=3)
    )

    def turn(i):
        for _ in s.send(f"message {i}"):
            pass
        if i % 8 == 7:
            s.reset()  # what /reset does in the chat UI

    for i in range(100):  # warm-up: caches, allocator pools
        turn(i)
    gc.collect()
    start = _rss_mb()
    for i in range(100, 1100):
        turn(i)
    gc.collect()
    grown = _rss_mb() - start
    assert s.turns == 1100
    print(f"RSS growth over 1000 turns: {grown:.2f} MB")
    assert grown < 20, f"RSS grew {grown:.1f} MB over 1000 turns"


def test_acceptance_4_through_the_chat_ui(model_dir):
    """The same loop through the terminal chat UI: typed lines, `/reset` as a slash command."""
    from rich.console import Console

    from lucy.chat_ui import ChatUI

    tf = tiny_model(model_dir, hidden=32, layers=1, max_seq_len=512)
    with open(os.devnull, "w") as sink:
        session = ChatSession(tf, options=GenOptions(temperature=0.8, seed=2, max_tokens=3))
        ui = ChatUI(session, Console(file=sink, width=80), out=sink)

        def turn(i):
            assert ui.handle(f"message {i}")
            if i % 8 == 7:
                assert ui.handle("/reset")

        for i in range(100):
            turn(i)
        gc.collect()
        start = _rss_mb()
        for i in range(100, 1100):
            turn(i)
        gc.collect()
        grown = _rss_mb() - start
    assert session.turns == 1100 and ui.last is not None
    assert grown < 20, f"RSS grew {grown:.1f} MB over 1000 UI turns"

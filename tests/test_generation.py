"""The event stream (stream_tokens / generate_text): stops, limits, errors, reuse."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from poly.errors import (
    ContextOverflowError,
    GenerationError,
    InvalidTokenError,
    ModelBusyError,
    NumericalError,
)
from poly.text.generation import generate_text, stream_tokens
from poly.text.sampling import GenOptions
from tests.gen_fakes import (
    GREEDY,
    IM_END,
    TOK,
    FakeModel,
    reference_greedy,
    run,
    scripted,
)

# --- the stream -----------------------------------------------------------------------------------


def test_greedy_stream_matches_plain_loop_and_metrics():
    m = FakeModel(eos=())
    prompt = TOK.encode("hello there")
    tokens, done = run(stream_tokens(m, prompt, GREEDY.replace(max_tokens=12)))
    want = reference_greedy(prompt, 12, eos=())
    assert [e.token_id for e in tokens] == want == list(done.tokens)
    assert [e.index for e in tokens] == list(range(12))
    assert done.stop_reason == "max_tokens"
    assert done.prompt_tokens == done.prefill_tokens == len(prompt)
    assert m.position == len(prompt) + 11  # the last token is never fed back
    assert m.calls[0] == prompt and all(len(c) == 1 for c in m.calls[1:])
    assert "".join(e.text for e in tokens) == done.text == TOK.decode(want)
    assert done.prefill_s >= 0 and done.decode_s >= 0 and done.decode_tok_s > 0


def test_eos_stops_and_is_not_in_text():
    m = scripted("Hi!")
    tokens, done = run(stream_tokens(m, TOK.encode("q"), GREEDY))
    assert done.stop_reason == "eos"
    assert done.tokens[-1] == IM_END and len(done.tokens) == 4
    assert done.text == "Hi!" and tokens[-1].text == ""


def test_min_tokens_suppresses_eos():
    m = FakeModel(script=[IM_END])  # EOS is always the favourite
    _, done = run(stream_tokens(m, [1, 2], GREEDY.replace(min_tokens=3)))
    assert done.stop_reason == "eos" and len(done.tokens) == 4
    assert IM_END not in done.tokens[:3]


@pytest.mark.parametrize("stop", [("STOP",), ("ST", "OP"), ("OP w",)])
def test_stop_strings_trim_the_text(stop):
    m = scripted("hello STOP world", eos=False)
    tokens, done = run(stream_tokens(m, [1], GREEDY.replace(max_tokens=30, stop=stop)))
    full = "hello STOP world"
    want = full[: min(full.find(s) for s in stop)]
    assert done.stop_reason == "stop_string"
    assert done.text == want == "".join(e.text for e in tokens)


def test_stop_string_prefix_released_when_no_match():
    m = scripted("a SToP", eos=True)
    tokens, done = run(stream_tokens(m, [1], GREEDY.replace(max_tokens=30, stop=("STOP",))))
    assert done.text == "a SToP" == "".join(e.text for e in tokens)
    assert done.stop_reason == "eos"


def test_stop_callback_and_should_stop_object():
    m = FakeModel(eos=())
    seen = []

    def stop():
        return len(seen) >= 3

    for ev in stream_tokens(m, [1, 2, 3], GREEDY, stop=stop):
        seen.append(ev)
    assert len(seen) == 4 and seen[-1].stop_reason == "stopped"
    assert m.position == 3 + 2  # three generated, the third never fed

    flag = SimpleNamespace(should_stop=lambda: True)
    _, done = run(stream_tokens(m, [1, 2, 3], GREEDY, stop=flag))
    assert done.tokens == () and done.stop_reason == "stopped"


def test_stop_callback_releases_held_back_text_into_done():
    m = scripted("abc STOx", eos=False)
    seen = []
    opts = GREEDY.replace(max_tokens=30, stop=("STOP",))
    for ev in stream_tokens(m, [1], opts, stop=lambda: len(seen) >= 7):
        seen.append(ev)
    assert "".join(e.text for e in seen[:-1]) == "abc "  # "STO" may start "STOP": held back
    assert seen[-1].text == "abc STO" and seen[-1].stop_reason == "stopped"


def test_history_ids_are_checked():
    m = FakeModel()
    generate_text(m, [1, 2, 3], GREEDY)
    with pytest.raises(InvalidTokenError):
        stream_tokens(m, [4], GREEDY, start_fresh=False, history=[1, 999])
    with pytest.raises(GenerationError):
        stream_tokens(m, [4], GREEDY, start_fresh=False, history=list(range(50)))


def test_context_overflow_raises_before_any_work():
    m = FakeModel(max_seq_len=32)
    with pytest.raises(ContextOverflowError):
        stream_tokens(m, list(range(20)), GREEDY.replace(max_tokens=13))
    assert m.calls == [] and m.position == 0
    _, done = run(stream_tokens(m, list(range(20)), GREEDY.replace(max_tokens=12)))
    assert len(done.tokens) <= 12


def test_truncate_output_and_left():
    m = FakeModel(max_seq_len=32, eos=())
    _, done = run(
        stream_tokens(m, list(range(20)), GREEDY.replace(max_tokens=50, truncate="output"))
    )
    assert done.stop_reason == "context" and len(done.tokens) == 12
    prompt = list(range(40))
    opts = GREEDY.replace(max_tokens=10, truncate="left")
    _, done = run(stream_tokens(m, prompt, opts))
    assert m.calls[-len(done.tokens)] == prompt[-22:]  # oldest tokens dropped
    assert done.stop_reason == "max_tokens" and done.prompt_tokens == 22


@pytest.mark.parametrize("bad", [[], [1, 258], [-1], [1.5, 2.0], [[1, 2]]])
def test_bad_prompts(bad):
    with pytest.raises(InvalidTokenError):
        stream_tokens(FakeModel(), bad, GREEDY)


def test_non_finite_logits_raise_and_release_the_lock():
    m = FakeModel()
    m.forward = lambda ids: np.full(258, np.nan, dtype=np.float32)
    with pytest.raises(NumericalError):
        generate_text(m, [1, 2], GREEDY)
    del m.forward
    assert generate_text(m, [1, 2], GREEDY).tokens  # the lock was released


@pytest.mark.parametrize("how", ["close", "with", "break"])
def test_closing_mid_stream_keeps_position_consistent(how):
    m = FakeModel(eos=())
    prompt = [5, 6, 7, 8]
    stream = stream_tokens(m, prompt, GREEDY.replace(max_tokens=20))
    got = []
    if how == "with":
        with stream:
            for ev in stream:
                got.append(ev.token_id)
                if len(got) == 3:
                    break
    else:
        for ev in stream:
            got.append(ev.token_id)
            if len(got) == 3:
                break
        if how == "close":
            stream.close()
        else:
            del stream  # garbage collection releases the lock too
    assert m.position == len(prompt) + 2
    assert m.seq == prompt + got[:2]
    assert got == reference_greedy(prompt, 3, eos=())
    assert generate_text(m, prompt, GREEDY).tokens  # not busy any more


def test_second_stream_is_busy_until_first_finishes():
    m = FakeModel(eos=())
    first = stream_tokens(m, [1, 2], GREEDY)
    next(first)
    with pytest.raises(ModelBusyError):
        stream_tokens(m, [3, 4], GREEDY)
    errors = []

    def other():
        try:
            stream_tokens(m, [3, 4], GREEDY)
        except ModelBusyError as e:
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1
    list(first)
    assert generate_text(m, [3, 4], GREEDY).tokens


def test_continue_without_reset_uses_the_cache():
    m = FakeModel(eos=())
    prompt = [9, 8, 7, 6]
    generate_text(m, prompt[:2], GREEDY.replace(max_tokens=1))
    assert m.position == 2
    _, done = run(stream_tokens(m, prompt[2:], GREEDY, start_fresh=False))
    assert m.calls[-len(done.tokens)] == prompt[2:]
    assert list(done.tokens) == reference_greedy(prompt, 8, eos=())
    assert done.prompt_tokens == 4 and done.prefill_tokens == 2


def test_seeded_sampling_is_reproducible():
    opts = GenOptions(temperature=1.0, top_k=0, seed=11, max_tokens=16)
    a = generate_text(FakeModel(eos=()), [1, 2, 3], opts).tokens
    b = generate_text(FakeModel(eos=()), [1, 2, 3], opts).tokens
    c = generate_text(FakeModel(eos=()), [1, 2, 3], opts.replace(seed=12)).tokens
    assert a == b and a != c

"""Stateful fuzzing of the generation API (reliability.md §(c) item 6).

A hypothesis state machine streams, continues, truncates, resets and interrupts one tiny model in
random orders, and after every step checks the KV cache against an independent no-cache forward
pass: ``forward([probe])`` continuing the cache must equal ``forward_all(cache + [probe])`` run
from empty. The cache contract: prompt + every generated token but the last (never fed back).
"""

from __future__ import annotations

import tempfile

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from poly.errors import ContextOverflowError, InvalidTokenError
from poly.text.generation import generate_text, stream_tokens
from poly.text.sampling import GenOptions
from tests.fuzz.corpus import tiny_model
from tests.fuzz.harness import EXAMPLES, FUZZ

CTX = 48
_MODEL = None


def _model():
    global _MODEL
    if _MODEL is None:
        _MODEL = tiny_model(tempfile.mkdtemp(prefix="poly-fuzz-"), hidden=16, max_seq_len=CTX)
    return _MODEL


ids = st.lists(st.integers(0, 257), min_size=1, max_size=8)


class SessionMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tf = _model()
        self.tf.reset()
        self.cache: list[int] = []

    def _run(self, prompt, n, fresh, stop_after=None):
        opts = GenOptions(temperature=0.0, max_tokens=n, eos_tokens=())
        before = [] if fresh else list(self.cache)
        try:
            s = stream_tokens(
                self.tf, prompt, opts, start_fresh=fresh, history=None if fresh else before
            )
        except ContextOverflowError:
            return  # refused up front: nothing changed
        gen = []
        with s:
            for ev in s:
                if hasattr(ev, "token_id"):
                    gen.append(ev.token_id)
                    if stop_after is not None and len(gen) == stop_after:
                        break
        self.cache = before + list(prompt) + gen[:-1]

    @rule(prompt=ids, n=st.integers(1, 5))
    def fresh(self, prompt, n):
        self._run(prompt, n, fresh=True)

    @precondition(lambda self: self.cache)
    @rule(prompt=ids, n=st.integers(1, 5))
    def continue_(self, prompt, n):
        self._run(prompt, n, fresh=False)

    @rule(prompt=ids, n=st.integers(2, 6), k=st.integers(1, 3))
    def interrupted(self, prompt, n, k):
        self._run(prompt, n, fresh=True, stop_after=min(k, n - 1))

    @precondition(lambda self: self.cache)
    @rule(data=st.data())
    def truncate(self, data):
        n = data.draw(st.integers(0, len(self.cache)))
        self.tf.truncate(n)
        self.cache = self.cache[:n]

    @rule()
    def reset(self):
        self.tf.reset()
        self.cache = []

    @rule(bad=st.sampled_from([[], [-1], [258], [1, 10**9]]))
    def invalid(self, bad):
        try:
            generate_text(self.tf, bad, GenOptions(max_tokens=1), start_fresh=False)
        except InvalidTokenError:
            return
        raise AssertionError(f"{bad} accepted")

    @invariant()
    def cache_matches_no_cache_reference(self):
        tf = self.tf
        assert tf.position == len(self.cache)
        if not self.cache or len(self.cache) >= CTX:
            return
        probe = 7
        got = tf.forward([probe]).copy()
        tf.truncate(len(self.cache))
        saved = tf.swap_state(tf.new_state())  # an empty, independent cache
        want = tf.forward_all(self.cache + [probe])[-1]
        tf.swap_state(saved)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


TestSession = SessionMachine.TestCase
TestSession.settings = settings(FUZZ, max_examples=max(10, EXAMPLES // 5), stateful_step_count=12)

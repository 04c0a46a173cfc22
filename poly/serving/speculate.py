"""Speculative decoding in the scheduler (``lucy serve --lookup N`` / ``--draft MODEL``).

It applies when one sequence is decoding and no prompt waits for a prefill (a lone user: the
case where decode reads the weights for one token a pass). That sequence's proposals (prompt
lookup, or a draft model's greedy tokens) and its last token run as the rows of one fused pass
over its KV (``verify``); its own ``Sequence.accept`` then takes the rows in order, as decode
steps would, until a token differs from the proposal or the sequence ends, and the KV is rolled
back to the tokens kept. With a greedy request (temperature 0), the tokens are those of plain
decoding, penalties, stop strings, masks and logprobs included: the rows (at most ``MAX_ROWS``)
take the fused multi-row call that batched decode takes, whose f32 tiles may round the last bits
unlike a one-row step (~1e-6 relative), which changes a greedy choice only at a near-tie, as
batching already can. Sampled requests and batches of several sequences decode as before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from poly.text.generation import model_lock
from poly.text.sampling import GenOptions, Sampler
from poly.text.speculative import (
    DEFAULT_DRAFT_TOKENS,
    DEFAULT_NGRAM,
    Draft,
    adapted_size,
    check_draft,
    lookup_tokens,
)

MAX_ROWS = 16  # rows of one fused decode call (the scheduler's MAX_ROWS)
PROBE = 4  # plain steps that measure a lone sequence's seconds per token
WARM = 2  # first passes not timed (the first multi-row calls repack weights, tune threads)
RETRY = 64  # plain steps after a losing pass; speculative passes between two probes


@dataclass
class SpecCounters:
    checks: int = 0  # passes that checked proposals
    proposed: int = 0
    accepted: int = 0
    tokens: int = 0  # tokens those passes produced (accepted + the target's own)


class ServerSpeculation:
    """The scheduler's proposer: ``lookup`` tokens from the text or a ``draft`` model's."""

    def __init__(self, model, lookup: int | None = None, draft=None,
                 draft_tokens: int | None = None, ngram: int = DEFAULT_NGRAM,
                 always: bool = False):  # fmt: skip
        """``always``: speculate on every lone greedy step, even when measured slower."""
        self.model, self.lookup, self.ngram, self.always = model, lookup, ngram, always
        self.cap = min(lookup or draft_tokens or DEFAULT_DRAFT_TOKENS, MAX_ROWS - 1)
        self.size = self.cap
        self.draft = None
        if draft is not None:
            check_draft(model, draft)
            opts = GenOptions(temperature=0.0)
            eos = tuple(getattr(model, "eos_token_ids", ()) or ())
            self.draft = Draft(draft, Sampler(opts, model.config.vocab_size, eos))
        self.counters = SpecCounters()
        # a pass of k rows costs more than a one-row step (Q4 weights on a busy machine: ~2.5x
        # for 2 rows): speculation stops for RETRY steps when its seconds per token lose
        self.plain_cost: float | None = None
        self.spec_cost: float | None = None
        self._plain_left, self._mark, self._passes = PROBE, None, 0

    @property
    def mode(self) -> str:
        return "draft" if self.draft is not None else "lookup"

    def _propose(self, tokens: list[int], n: int, n_prompt: int) -> list[int]:
        if n < 1:
            return []
        if self.draft is None:
            return lookup_tokens(tokens, n, self.ngram)
        with model_lock(self.draft.model):
            return self.draft.propose(tokens, n, n_prompt, None)[0]

    def step(self, sched) -> bool:
        """One speculative pass when it applies -> whether it ran (else: a plain step)."""
        if any(not a.prefilled for a in sched._active):
            return False
        rows = sched._decode_rows()
        if len(rows) != 1:
            return False
        a, s = rows[0]
        if not s.sampler.options.greedy:
            return False
        if not self.always and self._plain_turn(sched.metrics):
            return False
        left = min(s.budget - len(s.generated), s.max_len - len(s.tokens))
        t0 = time.perf_counter()
        proposal = self._propose(s.tokens, min(self.size, left - 1), s.n_prompt)
        if not proposal:
            return False
        logits = sched.kv.verify(s.kv, [s.tokens[-1], *proposal])  # [k + 1, V]
        sched.metrics.decode_step(1, time.perf_counter() - t0)
        made = self.counters.tokens
        accepted = self._accept(sched, a, s, logits, proposal)
        self._adapt(accepted, len(proposal))
        self._cost((time.perf_counter() - t0) / (self.counters.tokens - made))
        sched._finish_decoded()
        return True

    def _plain_turn(self, m) -> bool:
        """Whether this step decodes plainly: a probe of the plain cost, or a back-off."""
        if self._plain_left > 0:
            if self._mark is None:
                self._mark = (m.decode_s, m.decode_rows)
            self._plain_left -= 1
            return True
        if self._mark is not None:
            ds, rows = m.decode_s - self._mark[0], m.decode_rows - self._mark[1]
            self.plain_cost = ds / rows if rows else self.plain_cost
            self._mark = None
        return False

    def _cost(self, per_token: float) -> None:
        self._passes += 1
        if self.always or self._passes <= WARM:
            return
        old = self.spec_cost
        self.spec_cost = per_token if old is None else 0.7 * old + 0.3 * per_token
        if self.plain_cost is not None and self.spec_cost > self.plain_cost:
            self._plain_left, self.spec_cost = RETRY, None  # and measured again after
        elif self._passes % RETRY == 0:
            self._plain_left = PROBE

    def _accept(self, sched, a, s, logits: np.ndarray, proposal: list[int]) -> int:
        """Row by row as decode steps: the KV is cut to the positions computed before each
        token is taken (a finished sequence frees its pages with that length)."""
        accepted = 0
        for i, row in enumerate(logits):
            s.computed += 1
            sched.kv.set_length(s.kv, s.computed)
            sched._sample(a, s, row)
            self.counters.tokens += 1
            if i == len(proposal) or s.tokens[-1] != proposal[i]:
                break
            accepted += 1
            if s.finish_reason or a.handle.finished:
                break
        c = self.counters
        c.checks, c.proposed, c.accepted = (
            c.checks + 1,
            c.proposed + len(proposal),
            c.accepted + accepted,
        )
        return accepted

    def _adapt(self, accepted: int, proposed: int) -> None:
        """A draft's next proposal size (`adapted_size`); lookup sizes its proposals by the
        match (lookup_tokens)."""
        if self.draft is not None:
            self.size = adapted_size(self.size, self.cap, accepted, proposed)

    def stats(self) -> dict:
        c = self.counters
        return {
            "spec_checks_total": c.checks,
            "spec_proposed_tokens_total": c.proposed,
            "spec_accepted_tokens_total": c.accepted,
            "spec_pass_tokens_total": c.tokens,
            "spec_acceptance_rate": c.accepted / c.proposed if c.proposed else 0.0,
            "spec_tokens_per_pass": c.tokens / c.checks if c.checks else 0.0,
            "spec_gain": self.plain_cost / self.spec_cost
            if self.spec_cost and self.plain_cost
            else 0.0,
        }

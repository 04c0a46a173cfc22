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
    check_draft,
    lookup_tokens,
)

MAX_ROWS = 16  # rows computed exactly as one-row decode steps (the scheduler's MAX_ROWS)


@dataclass
class SpecCounters:
    checks: int = 0  # passes that checked proposals
    proposed: int = 0
    accepted: int = 0
    tokens: int = 0  # tokens those passes produced (accepted + the target's own)


class ServerSpeculation:
    """The scheduler's proposer: ``lookup`` tokens from the text or a ``draft`` model's."""

    def __init__(self, model, lookup: int | None = None, draft=None,
                 draft_tokens: int | None = None, ngram: int = DEFAULT_NGRAM):  # fmt: skip
        self.model, self.lookup, self.ngram = model, lookup, ngram
        self.cap = min(lookup or draft_tokens or DEFAULT_DRAFT_TOKENS, MAX_ROWS - 1)
        self.size = self.cap
        self.draft = None
        if draft is not None:
            check_draft(model, draft)
            opts = GenOptions(temperature=0.0)
            eos = tuple(getattr(model, "eos_token_ids", ()) or ())
            self.draft = Draft(draft, Sampler(opts, model.config.vocab_size, eos))
        self.counters = SpecCounters()

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
        left = min(s.budget - len(s.generated), s.max_len - len(s.tokens))
        proposal = self._propose(s.tokens, min(self.size, left - 1), s.n_prompt)
        if not proposal:
            return False
        t0 = time.perf_counter()
        logits = sched.kv.verify(s.kv, [s.tokens[-1], *proposal])  # [k + 1, V]
        sched.metrics.decode_step(1, time.perf_counter() - t0)
        accepted = self._accept(sched, a, s, logits, proposal)
        self._adapt(accepted, len(proposal))
        sched._finish_decoded()
        return True

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
        """Double after a full acceptance, one past the accepted ones after a rejection (as
        poly.text.speculative.Speculator: rejected rows cost part of a pass)."""
        self.size = min(self.cap, 2 * self.size) if accepted == proposed else max(1, accepted + 1)

    def stats(self) -> dict:
        c = self.counters
        return {
            "spec_checks_total": c.checks,
            "spec_proposed_tokens_total": c.proposed,
            "spec_accepted_tokens_total": c.accepted,
            "spec_pass_tokens_total": c.tokens,
            "spec_acceptance_rate": c.accepted / c.proposed if c.proposed else 0.0,
            "spec_tokens_per_pass": c.tokens / c.checks if c.checks else 0.0,
        }

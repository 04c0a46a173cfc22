"""Speculative decoding: propose several tokens cheaply, check them all in one target pass.

Proposals come from the text itself (prompt lookup: the tokens that followed the first earlier
occurrence of the last n-gram, as transformers' prompt_lookup_num_tokens and llama-cpp-python's
LlamaPromptLookupDecoding)
or from a draft model with the same vocabulary. The target runs the last token and the k
proposals as the k + 1 rows of one forward over its KV cache (one fused call: the weights are
read once), keeps the accepted prefix plus one token of its own, and rolls the cache back.

Greedy: a proposal is kept when it is the target's argmax, so the tokens are those of plain
decoding. Sampling: the standard rule (Leviathan et al. 2023; Chen et al. 2023) keeps the target
distribution: accept d with probability min(1, p(d)/q(d)), else draw from norm(max(0, p - q));
a lookup proposal is a point mass (q(d) = 1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from poly.errors import ModelBusyError, SpeculationError
from poly.text.sampling import Sampler, is_whole_number

# one fused call takes 64 rows: the last accepted token and up to 63 proposals
MAX_PROPOSED = 63
DEFAULT_DRAFT_TOKENS = 8
DEFAULT_NGRAM = 8
LOOKUP_PER_MATCHED = 2  # proposed tokens per token of the matched n-gram


def _check_n(name: str, n) -> int:
    if not is_whole_number(n) or not 1 <= n <= MAX_PROPOSED:
        raise SpeculationError(
            f"{name} must be an integer in 1..{MAX_PROPOSED} (one pass checks the last token and "
            f"up to {MAX_PROPOSED} proposals), got {n!r}"
        )
    return int(n)


@dataclass(frozen=True)
class Speculation:
    """Validated speculative decoding options: up to ``lookup`` N tokens from the text (n-grams
    of ``ngram`` tokens down to 1) or a ``draft`` model proposing ``draft_tokens`` (the start and
    the cap; ``adaptive`` shrinks a draft's after an early rejection and grows it back)."""

    lookup: int | None = None
    ngram: int = DEFAULT_NGRAM
    draft: object = None
    draft_tokens: int | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.lookup is not None:
            object.__setattr__(self, "lookup", _check_n("lookup", self.lookup))
        if not is_whole_number(self.ngram) or not 1 <= self.ngram <= 16:
            raise SpeculationError(f"ngram must be an integer in 1..16, got {self.ngram!r}")
        if self.draft_tokens is not None:
            object.__setattr__(self, "draft_tokens", _check_n("draft_tokens", self.draft_tokens))
            if self.draft is None:
                raise SpeculationError("draft_tokens needs a draft model (draft=...)")
        if self.draft is not None and self.lookup is not None:
            raise SpeculationError("choose one way to propose tokens: lookup or a draft model")
        if not isinstance(self.adaptive, bool):
            raise SpeculationError(f"adaptive must be a bool, got {self.adaptive!r}")

    @classmethod
    def from_options(cls, opts: dict) -> Speculation | None:
        """Pop ``lookup``, ``lookup_ngram``, ``draft``, ``draft_tokens``, ``adaptive`` (the
        ``generate``/``stream`` keywords) from ``opts``; None when none asks for speculation."""
        keys = {"lookup": "lookup", "lookup_ngram": "ngram", "draft": "draft",
                "draft_tokens": "draft_tokens", "adaptive": "adaptive"}  # fmt: skip
        got = {keys[k]: opts.pop(k) for k in list(opts) if k in keys}
        got = {k: v for k, v in got.items() if v is not None}
        if got.get("lookup") == 0:  # 0 = off, as the CLI's default
            got.pop("lookup")
        if "lookup" not in got and "draft" not in got:
            if "draft_tokens" in got:
                raise SpeculationError("draft_tokens needs a draft model (draft=...)")
            return None
        return cls(**got)

    @property
    def mode(self) -> str:
        return "draft" if self.draft is not None else "lookup"


# --- proposals --------------------------------------------------------------------------------


def adapted_size(size: int, cap: int, accepted: int, proposed: int) -> int:
    """A draft's next proposal size: double after a full acceptance (up to `cap`), one past the
    accepted ones after a rejection: each checked row costs a part of a pass, so rows that are
    rejected early are not free."""
    return min(cap, 2 * size) if accepted == proposed else max(1, accepted + 1)


def lookup_tokens(tokens: Sequence[int], n: int, ngram: int = DEFAULT_NGRAM) -> list[int]:
    """The tokens that followed the first earlier occurrence of the longest suffix of ``tokens``
    of at most ``ngram`` tokens (down to 1): 2 per matched token plus one, at most n; [] when
    none occurred before. A longer match is likelier a copy, so it earns a longer proposal (on
    four SmolLM2 edit and summary traces this beat a fixed n, adaptive or not); the first
    occurrence is usually in the prompt, the source being edited, not in the model's rewrite."""
    seq = np.asarray(tokens, dtype=np.int64)
    for size in range(min(ngram, len(seq) - 1), 0, -1):
        windows = sliding_window_view(seq[:-1], size)  # every earlier n-gram with a follower
        hits = np.flatnonzero((windows == seq[len(seq) - size :]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + size
            return seq[start : start + min(n, LOOKUP_PER_MATCHED * size + 1)].tolist()
    return []


def check_draft(target, draft) -> None:
    """SpeculationError unless ``draft`` is another model with the target's vocabulary."""
    if draft is target:
        raise SpeculationError("the draft must be another model object (it has its own KV cache)")
    tv, dv = target.config.vocab_size, getattr(getattr(draft, "config", None), "vocab_size", None)
    if dv is None:
        raise SpeculationError(f"draft must be a poly model, got {type(draft).__name__}")
    if tv != dv:
        raise SpeculationError(f"draft vocabulary {dv} != the model's {tv}: not the same tokenizer")
    ta, da = getattr(target, "tokenizer", None), getattr(draft, "tokenizer", None)
    if ta is None or da is None:
        return
    ids = sorted({*range(0, tv, max(1, tv // 509)), tv - 1, *getattr(target, "eos_token_ids", ())})
    bad = [i for i in ids if i < tv and ta.id_to_token(i) != da.id_to_token(i)]
    if bad:
        raise SpeculationError(
            f"draft tokenizer differs from the model's (token {bad[0]}: "
            f"{da.id_to_token(bad[0])!r} != {ta.id_to_token(bad[0])!r})"
        )


class Draft:
    """A draft model's proposals; its KV cache follows the target's accepted tokens."""

    def __init__(self, model, sampler: Sampler):
        self.model, self.sampler = model, sampler
        self.cached: list[int] = []  # the token ids in the draft's KV cache

    def sync(self, tokens: list[int]) -> np.ndarray:
        """Run the draft up to ``tokens`` (reusing its cache's common prefix) -> last logits."""
        keep = 0
        for a, b in zip(self.cached, tokens[:-1]):
            if a != b:
                break
            keep += 1
        self.model.truncate(keep)
        self.cached = list(tokens)
        return self.model.forward(tokens[keep:])

    def propose(self, tokens: list[int], n: int, n_prompt: int, rng) -> tuple[list[int], list]:
        """n draft tokens and, when sampling, the distribution each was drawn from."""
        if len(tokens) + n > self.model.config.max_seq_len:
            return [], []
        logits, out, qs = self.sync(tokens), [], []
        greedy = self.sampler.options.greedy
        for i in range(n):
            ctx = tokens + out
            if greedy:
                out.append(self.sampler.sample(logits, ctx, n_prompt))
            else:
                q = self.sampler.probabilities(logits, ctx, n_prompt)
                qs.append(q)
                out.append(draw(q, rng))
            if i + 1 < n:
                logits = self.model.forward([out[-1]])
                self.cached.append(out[-1])
        return out, qs


def draw(p: np.ndarray, rng) -> int:
    """One id from the float64 distribution p (not necessarily normalized)."""
    cum = np.cumsum(p)
    i = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
    return min(i, len(p) - 1)


# --- verification -----------------------------------------------------------------------------


def accept(sampler: Sampler, rows: np.ndarray, proposal: list[int], qs: list, tokens: list[int],
           n_prompt: int) -> tuple[list[int], int]:  # fmt: skip
    """(accepted proposals, the target's next token) from the target's logits rows [k + 1, V]:
    row i scores proposal i given tokens + proposal[:i]; row k gives the token after them all.
    ``qs``: the draft's distributions ([] = point masses: lookup, or a greedy draft)."""
    out: list[int] = []
    rng = sampler.rng
    for i, d in enumerate(proposal):
        ctx = tokens + out
        if sampler.options.greedy:
            t = sampler.sample(rows[i], ctx, n_prompt)
            if t != d:
                return out, t
            out.append(d)
            continue
        p = sampler.probabilities(rows[i], ctx, n_prompt)
        q_d = qs[i][d] if qs else 1.0
        if rng.random() * q_d < p[d]:  # probability min(1, p(d) / q(d))
            out.append(d)
            continue
        rest = np.maximum(p - qs[i], 0.0) if qs else p.copy()
        if not qs:
            rest[d] = 0.0
        return out, draw(rest if rest.sum() > 0 else p, rng)
    return out, sampler.sample(rows[len(proposal)], tokens + out, n_prompt)


# --- the per-stream runner --------------------------------------------------------------------


@dataclass
class SpecStats:
    proposed: int = 0
    accepted: int = 0
    passes: int = 0  # target forwards after the prefill (checks and plain steps)
    checks: int = 0  # of those, the ones that checked proposals
    tokens: int = 0  # tokens those forwards produced

    def record(self, proposed: int, accepted: int) -> None:
        self.checks += 1
        self.proposed += proposed
        self.accepted += accepted


class Speculator:
    """One stream's speculative decoding: holds the draft's lock until ``release``."""

    def __init__(self, spec: Speculation, model, sampler: Sampler, lock_of: Callable):
        """``lock_of(model)``: a model's generation lock (poly.text.generation.model_lock)."""
        self.spec, self.model, self.sampler = spec, model, sampler
        self.stats = SpecStats()
        self.draft: Draft | None = None
        self.size = spec.lookup or spec.draft_tokens or DEFAULT_DRAFT_TOKENS
        self._unlock: Callable[[], None] | None = None
        if spec.draft is not None:
            check_draft(model, spec.draft)
            lock = lock_of(spec.draft)
            if not lock.acquire(blocking=False):
                raise ModelBusyError("the draft model is in use by another generation")
            self._unlock = lock.release
            opts = sampler.options
            self.draft = Draft(spec.draft, Sampler(opts, sampler.vocab_size, sampler.eos_tokens))

    def release(self) -> None:
        unlock, self._unlock = self._unlock, None
        if unlock is not None:
            unlock()

    def start(self, tokens: list[int]) -> None:
        """The draft's prefill (timed with the target's)."""
        if self.draft is not None:
            self.draft.model.reset()
            self.draft.cached = []
            self.draft.sync(tokens)

    def _propose(self, tokens: list[int], n: int, n_prompt: int) -> tuple[list[int], list]:
        if n < 1:
            return [], []
        if self.draft is None:
            return lookup_tokens(tokens, n, self.spec.ngram), []
        return self.draft.propose(tokens, n, n_prompt, self.sampler.rng)

    def _adapt(self, n_acc: int, n_prop: int) -> None:
        """A draft's next proposal size (`adapted_size`); lookup sizes its proposals by the
        match instead (lookup_tokens)."""
        if not self.spec.adaptive or self.draft is None:
            return
        cap = self.spec.lookup or self.spec.draft_tokens or DEFAULT_DRAFT_TOKENS
        self.size = adapted_size(self.size, cap, n_acc, n_prop)

    def tokens(self, logits, tokens: list[int], n_prompt: int, left: Callable[[], int]) -> Iterator:
        """Yield generated ids: the first from the prefill's logits, then per target pass the
        accepted proposals and the target's own token. The consumer appends each to ``tokens``
        (the text so far) before asking for the next; ``left()``: tokens still wanted."""
        from poly.runtime.dispatch import forward_rows

        model, st = self.model, self.stats
        yield self.sampler.sample(logits, tokens, n_prompt)
        while True:
            proposal, qs = self._propose(tokens, min(self.size, left() - 1), n_prompt)
            st.passes += 1
            if not proposal:
                new = [self.sampler.sample(model.forward([tokens[-1]]), tokens, n_prompt)]
            else:
                base = len(tokens) - 1  # the cache holds every token but the last
                rows = forward_rows(model, np.asarray([tokens[-1], *proposal], dtype=np.int64))
                acc, nxt = accept(self.sampler, rows, proposal, qs, tokens, n_prompt)
                model.truncate(base + 1 + len(acc))
                st.record(len(proposal), len(acc))
                self._adapt(len(acc), len(proposal))
                new = [*acc, nxt]
            st.tokens += len(new)
            yield from new

    def report(self) -> dict:
        """The stream's numbers: acceptance rate and tokens per target pass."""
        st = self.stats
        return {
            "mode": self.spec.mode,
            "proposed": st.proposed,
            "accepted": st.accepted,
            "acceptance_rate": st.accepted / st.proposed if st.proposed else 0.0,
            "passes": st.passes,
            "checks": st.checks,
            "tokens_per_pass": st.tokens / st.passes if st.passes else 0.0,
            "mean_proposed": st.proposed / st.checks if st.checks else 0.0,
        }

"""Measure a model on text: perplexity, and the KL divergence of its next-token distribution
from a reference model's, as llama.cpp's perplexity tool does (`--kl-divergence`).

The token sequence is cut into windows of `n_ctx` tokens, each run from an empty KV cache; the
second half of each window is scored (the logits at positions n_ctx/2 .. n_ctx-2 predict the
tokens after them), so every scored token sees at least n_ctx/2 tokens of context. With `bos`
set, each window's first token is replaced by it, as llama.cpp does for vocabularies that add one.

Memory stays bounded: one window's logits of each model at a time ([n_ctx/2, vocab] float32),
reduced in row chunks to per-token numbers (negative log-likelihood, KL, top-1 agreement).
`evaluate` fills a `Measure` the caller may pass in, so an interrupted run still has its numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from poly.errors import UsageError

ROW_CHUNK = 64  # rows reduced at a time: bounds the float64 temporaries to ROW_CHUNK x vocab
Progress = Callable[[int, int, str], None]  # (windows done, windows in all, detail)


def window_starts(n_tokens: int, n_ctx: int) -> list[int]:
    """Where each window starts: floor(n_tokens / n_ctx) windows back to back (llama.cpp's
    n_chunk); the tokens past the last whole window are not scored."""
    if n_ctx < 4 or n_ctx % 2:
        raise UsageError(f"context {n_ctx} must be an even number of tokens >= 4")
    if n_tokens < n_ctx:
        raise UsageError(f"the text has {n_tokens} tokens; a context of {n_ctx} needs at least "
                         f"{n_ctx} (one window)")  # fmt: skip
    return [i * n_ctx for i in range(n_tokens // n_ctx)]


def window_logits(
    model, tokens: Sequence[int], n_ctx: int, *, bos: int | None = None
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """For each window: (logits [n_ctx/2 - 1, V] float32 of its scored positions, the token
    ids they predict). The full logits stream, one window at a time."""
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
    first = n_ctx // 2
    for start in window_starts(ids.size, n_ctx):
        window = ids[start : start + n_ctx].copy()
        if bos is not None:
            window[0] = bos
        yield _scored_logits(model, window, first), ids[start + first + 1 : start + n_ctx]


def _scored_logits(model, window: np.ndarray, first: int) -> np.ndarray:
    """Logits of positions first .. n-2 of one window, from an empty KV cache (the head is
    applied to the scored rows only: half the head's work)."""
    from poly.runtime import fused

    model.reset()
    if model.activation_dtype == np.float32:
        fused.plan(model)  # made once: its repacked rows are what the reference path's gemm reads
    try:
        hidden = model.hidden_states(window)
    finally:
        model.reset()  # the next window (or the caller) starts from an empty cache
    # the model's own head: its bias, logit_scale and soft-cap too (Phi-2, Command-R, Gemma 2)
    out = model.logits(np.ascontiguousarray(hidden[first:-1]))
    return np.asarray(out, dtype=np.float32)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities in float64."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@dataclass
class Measure:
    """Per-token numbers of the windows scored so far, one `WindowStats` a window (added in one
    step: an interrupt never leaves half a window in)."""

    scored: list[WindowStats] = field(default_factory=list)

    @property
    def windows(self) -> int:
        return len(self.scored)

    def add(self, logits: np.ndarray, targets: np.ndarray, ref: np.ndarray | None = None) -> None:
        """One window: the model's logits, the ids they predict, and the reference's logits
        of the same positions (or None: perplexity only)."""
        self.scored.append(window_stats(logits, targets, ref))

    def result(self, **extra: Any) -> EvalResult:
        if not self.scored:
            raise UsageError("nothing was measured: no window finished")
        nll = np.concatenate([w.nll for w in self.scored])
        out = EvalResult(tokens=int(nll.size), windows=self.windows, ppl=_ppl(nll), **extra)
        if self.scored[0].kld is not None:
            kld = np.concatenate([w.kld for w in self.scored])
            out.ref_ppl = _ppl(np.concatenate([w.ref_nll for w in self.scored]))
            out.kld_mean = float(kld.mean())
            out.kld_stderr = float(kld.std(ddof=1) / np.sqrt(kld.size)) if kld.size > 1 else 0.0
            p50, p90, p99 = np.percentile(kld, [50, 90, 99])
            out.kld_median, out.kld_p90, out.kld_p99 = float(p50), float(p90), float(p99)
            out.kld_max = float(kld.max())
            out.top1 = float(np.concatenate([w.same_top for w in self.scored]).mean())
        return out


@dataclass(frozen=True)
class WindowStats:
    """Per scored token of one window: the model's negative log-likelihood, and with a
    reference its NLL, KL(reference || model) and whether their top-1 tokens agree."""

    nll: np.ndarray
    ref_nll: np.ndarray | None = None
    kld: np.ndarray | None = None
    same_top: np.ndarray | None = None


def window_stats(logits: np.ndarray, targets: np.ndarray, ref: np.ndarray | None) -> WindowStats:
    """Reduce one window's logits to per-token numbers, ROW_CHUNK rows at a time."""
    parts: list[list[np.ndarray]] = [[], [], [], []]
    for lo in range(0, targets.size, ROW_CHUNK):
        rows = np.arange(min(ROW_CHUNK, targets.size - lo))
        tgt = targets[lo : lo + ROW_CHUNK]
        logp = log_softmax(logits[lo : lo + ROW_CHUNK])
        parts[0].append(-logp[rows, tgt])
        if ref is None:
            continue
        ref_logp = log_softmax(ref[lo : lo + ROW_CHUNK])
        parts[1].append(-ref_logp[rows, tgt])
        parts[2].append((np.exp(ref_logp) * (ref_logp - logp)).sum(axis=-1))
        parts[3].append(logp.argmax(axis=-1) == ref_logp.argmax(axis=-1))
    cat = [np.concatenate(p) if p else None for p in parts]
    return WindowStats(*cat)


def _ppl(nll: np.ndarray) -> float:
    return float(np.exp(nll.mean()))


@dataclass
class EvalResult:
    """What `evaluate` measured. The KL fields are None without a reference; `complete` is
    False when the run stopped before its last window (the numbers cover `windows`)."""

    tokens: int
    windows: int
    ppl: float
    n_ctx: int = 0
    complete: bool = True
    ref_ppl: float | None = None
    kld_mean: float | None = None
    kld_stderr: float | None = None
    kld_median: float | None = None
    kld_p90: float | None = None
    kld_p99: float | None = None
    kld_max: float | None = None
    top1: float | None = None
    bpw: float | None = None

    def to_json(self) -> dict:
        return asdict(self)


def reference_logits(
    reference, tokens: Sequence[int], n_ctx: int, *, bos: int | None = None
) -> Iterator[np.ndarray]:
    """The reference's logits [n_ctx/2 - 1, V] (float32) window by window; keep them (a list)
    to compare several models with one reference run."""
    for logits, _ in window_logits(reference, tokens, n_ctx, bos=bos):
        yield logits


def check_same_vocab(model, reference) -> None:
    """Models compared token by token must share their vocabulary."""
    a, b = model.config.vocab_size, reference.config.vocab_size
    if a != b:
        raise UsageError(f"MODEL and REF have different vocabularies ({a} and {b} tokens)")


def evaluate(
    model,
    tokens: Sequence[int],
    *,
    reference: Any = None,
    n_ctx: int = 512,
    bos: int | None = None,
    progress: Progress | None = None,
    measure: Measure | None = None,
    file_bytes: int | None = None,
) -> EvalResult:
    """Perplexity of `model` on `tokens` and, given a `reference` (a model, or its
    `reference_logits` kept in a sequence), the KL divergence of `model`'s next-token
    distribution from the reference's. `file_bytes` (the checkpoint's size) adds bits per
    weight. `measure` (optional) is filled as windows finish: on an interrupt it holds them."""
    if reference is not None and hasattr(reference, "config"):
        check_same_vocab(model, reference)
    total = len(window_starts(len(tokens), n_ctx))
    measure = measure if measure is not None else Measure()
    refs = _reference_iter(reference, tokens, n_ctx, bos)
    for i, (logits, targets) in enumerate(window_logits(model, tokens, n_ctx, bos=bos)):
        ref = next(refs) if refs is not None else None
        if ref is not None and ref.shape != logits.shape:
            raise UsageError(f"reference window {i} has shape {ref.shape}, not {logits.shape}")
        measure.add(logits, targets, ref)
        if progress is not None:
            progress(i + 1, total, f"window {i + 1}/{total}")
    bpw = None if file_bytes is None else bits_per_weight(file_bytes, model)
    return measure.result(n_ctx=n_ctx, bpw=bpw)


def _reference_iter(reference, tokens, n_ctx, bos) -> Iterator[np.ndarray] | None:
    if reference is None:
        return None
    if hasattr(reference, "config"):
        return reference_logits(reference, tokens, n_ctx, bos=bos)
    return iter(reference)


def parameter_count(model) -> int:
    """The model's parameters: its layers' plus the embeddings, the head when it is not tied
    to them, and the final norm. A bias the checkpoint does not have (all zero here: the
    layer kinds carry a slot for one) is not counted."""
    total = sum(_layer_params(layer) for layer in model.network.walk())
    total += int(np.prod(model.embeddings.shape))
    if not model.tied:
        total += int(np.prod(model.lm_head.shape))
    return total + int(model.config.hidden_size)


def _layer_params(layer) -> int:
    from poly.nn import layout

    table = layout.spec(layer)
    if not table:
        return 0
    held = layout.components(layer)
    total = 0
    for role, shape in table:
        value = held.get(role) if role.startswith("b_") else None
        if role.startswith("b_") and (value is None or not np.any(value)):
            continue
        total += int(np.prod(shape, dtype=np.int64))
    return total


def bits_per_weight(file_bytes: int, model) -> float:
    """The whole file's size in bits per parameter (embeddings included), as the issue's tables
    and llama.cpp's quantize report count it."""
    return float(file_bytes) * 8.0 / parameter_count(model)


def text_tokens(model, text: str, reference=None) -> list[int]:
    """The text as `model`'s tokenizer encodes it (no special tokens added); a `reference`
    with a tokenizer must encode it to the same ids, or the two cannot be compared."""
    if not text.strip():
        raise UsageError("the evaluation text is empty")
    if model.tokenizer is None:
        raise UsageError("MODEL has no tokenizer to encode the text with")
    ids = model.tokenizer.encode(text)
    other = getattr(reference, "tokenizer", None)
    if other is not None:
        theirs = other.encode(text)
        if theirs != ids:
            at = next((i for i, (a, b) in enumerate(zip(ids, theirs)) if a != b), None)
            at = min(len(ids), len(theirs)) if at is None else at
            raise UsageError(f"MODEL and REF tokenize the text differently (from token {at}): "
                             "not the same vocabulary")  # fmt: skip
    return ids

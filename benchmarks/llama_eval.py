"""llama.cpp's side of a perplexity / KL-divergence measurement, through llama-cpp-python.

The windows are llama.cpp's perplexity tool's (examples/perplexity/perplexity.cpp): back-to-back
chunks of n_ctx tokens, each from an empty KV cache, its first token replaced by BOS when the
vocabulary adds one, the logits of positions n_ctx/2 .. n_ctx-2 scoring the token after each;
the same windows as `poly.text.evaluate`, so the two sides compare token for token.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np


def open_llama(path: str | Path, n_ctx: int, threads: int = 2):
    import llama_cpp

    return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                           logits_all=True, verbose=False, n_threads=threads,
                           n_threads_batch=threads)  # fmt: skip


def adds_bos(path: str | Path) -> int | None:
    """llama.cpp's BOS id when the file's vocabulary adds one (perplexity then puts it first
    in every window), else None."""
    llm = open_llama(path, 64, 1)
    try:
        return int(llm.token_bos()) if llm._model.add_bos_token() else None
    finally:
        llm.close()


def window_logits(
    path: str | Path, tokens: Sequence[int], n_ctx: int, bos: int | None = None, threads: int = 2
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(logits [n_ctx/2 - 1, V] float32, the ids they predict) per window, from llama.cpp."""
    ids = np.asarray(tokens, dtype=np.int64)
    first = n_ctx // 2
    llm = open_llama(path, n_ctx, threads)
    try:
        for start in range(0, ids.size - n_ctx + 1, n_ctx):
            window = ids[start : start + n_ctx].copy()
            if bos is not None:
                window[0] = bos
            llm.reset()
            llm.eval(window.tolist())
            scores = np.array(llm.scores[first : n_ctx - 1], dtype=np.float32)
            yield scores, ids[start + first + 1 : start + n_ctx]
    finally:
        llm.close()


def tokenize(path: str | Path, text: str) -> list[int]:
    """The text as llama.cpp tokenizes it for perplexity (its own add-BOS rule)."""
    llm = open_llama(path, 64, 1)
    try:
        return llm.tokenize(text.encode("utf-8"), add_bos=bool(llm._model.add_bos_token()))
    finally:
        llm.close()


def perplexity(path: str | Path, tokens: Sequence[int], n_ctx: int, bos: int | None) -> float:
    """exp(mean negative log-likelihood) over the scored tokens, as llama.cpp's perplexity
    computes it from its logits (log-softmax per row, the target's log-probability)."""
    nll: list[np.ndarray] = []
    for logits, targets in window_logits(path, tokens, n_ctx, bos):
        x = logits.astype(np.float64)
        x -= x.max(axis=1, keepdims=True)
        logp = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
        nll.append(-logp[np.arange(targets.size), targets])
    return float(np.exp(np.concatenate(nll).mean()))

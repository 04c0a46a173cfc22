"""KV storage for the scheduler's sequences: one contiguous cache per sequence and layer.

``ContiguousKV`` keeps poly's own ``KVCache`` per sequence (the single-sequence layout), so the
fused multi-row decode step reads it unchanged. Caches are zero-filled arrays that the OS maps
lazily: resident memory follows the positions actually written.
"""

from __future__ import annotations

import numpy as np

from poly.serving.ranks import run_batch


class ContiguousKV:
    """Per-sequence states from ``model.new_state()``; prefill and decode on them."""

    paged = False

    def __init__(self, model):
        self.model = model
        self.live: dict[int, list] = {}  # id(state) -> state, for the metrics

    def check(self, prompt_len: int, budget: int, n: int) -> None:
        """Raise when a request could never be admitted (nothing to check here)."""

    def reserve(self, prompt: list[int], budget: int, n: int) -> tuple[list, int]:
        """A new empty state for ``prompt`` -> (state, 0 tokens reused)."""
        st = self.model.new_state()
        self.live[id(st)] = st
        return st, 0

    def fork(self, state: list, length: int, budget: int = 0) -> list:
        """A copy of ``state``'s first ``length`` positions (choices of one prompt)."""
        out = [None if c is None else c.clone(length) for c in state]
        self.live[id(out)] = out
        return out

    def free(self, state: list, tokens=None) -> None:
        self.live.pop(id(state), None)
        state[:] = [None] * len(state)

    def prefill(self, state: list, ids: list[int]) -> np.ndarray:
        """Run ``ids`` after ``state``'s cached positions -> logits [V] of the last one."""
        m = self.model
        saved = m.swap_state(state)
        try:
            logits = m.forward(ids)
        finally:
            state[:] = m.swap_state(saved)
        return logits

    def prefill_many(self, states: list[list], chunks: list[list[int]]) -> np.ndarray:
        """Several prompts' next chunks in one pass -> logits [B, V] of each one's last token."""
        return run_batch(self.model, chunks, states)

    def decode(self, tokens: list[int], states: list[list]) -> np.ndarray:
        """One new token per sequence -> logits [B, V] (the fused multi-row step)."""
        return run_batch(self.model, [[t] for t in tokens], states)

    def verify(self, state: list, ids: list[int]) -> np.ndarray:
        """Logits [n, V] of every one of ``ids`` after ``state``'s positions (one fused call)."""
        from poly.runtime.dispatch import forward_rows

        m = self.model
        saved = m.swap_state(state)
        try:
            return forward_rows(m, np.asarray(ids, dtype=np.int64))
        finally:
            state[:] = m.swap_state(saved)

    def set_length(self, state: list, n: int) -> None:
        """Hold the first n positions, n at most the last `verify`'s end (see PagedKV)."""
        for c in state:
            if c is not None:
                c.length = n

    def stats(self) -> dict:
        tokens = 0
        for st in self.live.values():
            c = next((c for c in st if c is not None), None)
            tokens += 0 if c is None else c.length
        return {"kv_sequences": len(self.live), "kv_tokens": tokens}


def make_kv(model, *, kv_pages: int | None = None, max_batch: int = 16, ctx: int | None = None,
            page_size: int = 16, budget_bytes: int = 2 << 30):  # fmt: skip
    """The scheduler's KV store: a paged pool of ``kv_pages`` pages (default: room for
    ``max_batch`` full contexts, at most ``budget_bytes``), or contiguous caches (``kv_pages=0``,
    and by default for a model with sliding-window layers: the pool keeps every position; and
    for a q8_0 KV cache, which the pool does not hold)."""
    from poly.serving.paged import PagedKV, q8_cache, windowed

    if kv_pages == 0 or (kv_pages is None and (windowed(model) or q8_cache(model))):
        return ContiguousKV(model)  # a sliding window's contiguous caches keep the window only
    if kv_pages is None:
        ctx = min(ctx or model.config.max_seq_len, model.config.max_seq_len)
        from poly.nn.mha import kv_dtype

        per_page = sum(2 * page_size * a.num_kv_heads * a.head_dim * kv_dtype(a).itemsize
                       for a in (model.attn(i) for i in range(model.config.num_layers)))  # fmt: skip
        kv_pages = max(1, min(max_batch * -(-ctx // page_size), budget_bytes // per_page))
    return PagedKV(model, kv_pages, page_size)

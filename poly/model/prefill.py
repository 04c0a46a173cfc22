"""A long prompt runs in chunks of PREFILL_CHUNK tokens (as llama.cpp's ubatch): the attention
scores a chunk holds are heads x chunk x context floats, not heads x context^2 (entity.fit
plans them)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from poly.errors import GenerationError

PREFILL_CHUNK = 512


def in_chunks(model, ids: np.ndarray, step: Callable) -> np.ndarray:
    """`step(model, ids)` over `ids` in chunks -> the last one's logits; an error in any chunk
    rolls the KV cache back to where it was before the call."""
    if ids.size <= PREFILL_CHUNK:
        return step(model, ids)
    start = model.position
    try:
        for a in range(0, ids.size - PREFILL_CHUNK, PREFILL_CHUNK):
            step(model, ids[a : a + PREFILL_CHUNK])
        return step(model, ids[a + PREFILL_CHUNK :])
    except BaseException:
        _roll_back(model, start)
        raise


def _roll_back(model, n: int) -> None:
    try:
        model.truncate(n)
    except GenerationError:  # a sliding window already dropped rows before n
        model.reset()

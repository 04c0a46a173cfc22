"""Several independent sequences through one model, each with its own KV state.

When the blocks are plain, the sequences run as one pass: embeddings, projections, FFN and LM
head run as one matmul over all their new rows, attention runs per sequence on its own cache.
One new token each (a decode step) goes through the fused C step when it applies; prompts of any
lengths (a server's waiting requests) share one pass over the weights, which for quantized
matrices is one dequantization instead of one per prompt. Other models run one by one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from poly.errors import LayerConfigError
from poly.model.block import is_recipe_block, run_block
from poly.runtime import ckernels, fused


def _one_by_one(model: Any, sequences, states: list) -> np.ndarray:
    saved = model.swap_state(model.new_state())
    out = []
    try:
        for i, seq in enumerate(sequences):
            model.swap_state(states[i])
            out.append(model.forward(seq))
            states[i] = model.swap_state(model.new_state())
    finally:
        model.swap_state(saved)
    return np.stack(out)  # [B, V]


def _batched_step(model: Any, ids: np.ndarray, states: list) -> np.ndarray:
    x = model.embed(ids)  # [B, H]
    p = fused.plan(model)
    if p is not None:  # one C call for the whole step (poly/fused.py)
        logits = fused.step_rows(p, x, states)
        if logits is not None:
            return logits
    return _blocks(model, x, states, None)


def _segments(model: Any, seqs: list[np.ndarray], states: list) -> np.ndarray:
    """Prompts of any lengths in one pass -> logits [B, V] of each one's last row."""
    stops = np.cumsum([s.size for s in seqs])
    bounds = [(int(b - s.size), int(b)) for s, b in zip(seqs, stops)]
    x = model.embed(np.concatenate(seqs))  # [N, H]
    return _blocks(model, x, states, bounds, stops - 1)


def _blocks(model: Any, x: np.ndarray, states: list, bounds, last=None) -> np.ndarray:
    for li, blk in enumerate(model.network.layers):
        caches = [st[li] for st in states]
        x = run_block(blk, x, caches, bounds, cfg=model.config)
        for st, cache in zip(states, caches):
            st[li] = cache  # KVCaches created on first use
    x = x if last is None else x[last]  # [B, H]
    return model.logits(model.norm_final(x))  # [B, V]


def forward_batch(
    model: Any, sequences: Sequence[Sequence[int]], states: list | None = None
) -> np.ndarray:
    """Logits [B, V]. `states` (from model.new_state()) are updated in place; without them
    every sequence starts at position 0 and the model's own cache is left untouched."""
    if states is None:
        states = [model.new_state() for _ in sequences]
    if len(states) != len(sequences):
        raise LayerConfigError("forward_batch needs one state per sequence")
    seqs = [model.check_ids(s) for s in sequences]
    blocks = model.network.layers
    if not (
        seqs
        and model.activation_dtype == np.float32
        and all(not b.is_disabled and is_recipe_block(b, model.config.block) for b in blocks)
    ):
        return _one_by_one(model, seqs, states)
    if all(s.size == 1 for s in seqs):
        return _batched_step(model, np.concatenate(seqs), states)
    total = sum(s.size for s in seqs)
    p = fused.plan(model) if total <= ckernels.STEP_ROWS else None
    if p is not None:  # few tokens in all: every prompt's tokens are rows of one fused call
        x = model.embed(np.concatenate(seqs))  # [N, H]
        logits = fused.prompt_rows(p, x, states, [s.size for s in seqs])  # [B, V]
        if logits is not None:
            return logits
    return _segments(model, seqs, states)


def greedy_batch(
    model: Any, prompts: Sequence[Sequence[int]], new_tokens: int
) -> tuple[np.ndarray, float]:
    """Greedy-decode `new_tokens` for every prompt together -> (tokens [B, new_tokens], decode
    seconds). Prompts are prefilled one by one (not timed); each step is one batched pass."""
    states = [model.new_state() for _ in prompts]
    logits = forward_batch(model, [list(p) for p in prompts], states)  # [B, V]
    out = np.empty((len(prompts), new_tokens), dtype=np.int64)
    t0 = time.perf_counter()
    for step in range(new_tokens):
        out[:, step] = np.argmax(logits, axis=-1)
        if step + 1 < new_tokens:
            logits = forward_batch(model, [[int(t)] for t in out[:, step]], states)
    return out, time.perf_counter() - t0

"""Several independent sequences through one model, each with its own KV state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def forward_batch(
    model: Any, sequences: Sequence[Sequence[int]], states: list | None = None
) -> np.ndarray:
    """Logits [B, V]. `states` (from model.new_state()) are updated in place; without them
    every sequence starts at position 0 and the model's own cache is left untouched."""
    if states is None:
        states = [model.new_state() for _ in sequences]
    if len(states) != len(sequences):
        raise ValueError("one state per sequence")
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

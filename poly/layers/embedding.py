"""Embedding: token ids -> rows of the [vocab, dim] table; out-of-range ids are an error."""

from __future__ import annotations

import numpy as np

from poly import layout
from poly.errors import InvalidTokenError
from poly.ops import ACTIVATIONS


def lookup(table, ids: np.ndarray) -> np.ndarray:
    """Rows of a float32/f16/bf16 array or a QTensor, as float32 [n, dim]."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    vocab = table.shape[0]
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        bad = int(ids[(ids < 0) | (ids >= vocab)][0])
        raise InvalidTokenError(f"token id {bad} is outside the vocabulary (size {vocab})")
    if isinstance(table, np.ndarray):
        return np.asarray(table[ids], dtype=np.float32)
    return (
        np.stack([table.dequantize(int(i), int(i) + 1)[0] for i in ids])
        if ids.size
        else (np.zeros((0, table.shape[1]), dtype=np.float32))
    )


def forward(layer, x: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
    out = lookup(layout.components(layer)["w"], x)
    return ACTIVATIONS[int(layer.activation)](out)

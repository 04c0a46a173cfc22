"""Embedding: token ids -> rows of the [vocab, dim] table; out-of-range ids are an error."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from poly.errors import InvalidTokenError, LayerConfigError
from poly.layer import LayerKind, LayerType
from poly.nn.dense import DenseViews
from poly.nn.spec import Spec, carve
from poly.ops import ACTIVATIONS


def complete_dims(layer) -> None:
    if layer.vocab_size <= 0 or layer.embedding_dim <= 0:
        raise LayerConfigError("Embedding needs vocab_size and embedding_dim")


def spec(layer) -> Spec:
    return [("w", (layer.vocab_size, layer.embedding_dim))]


def views(layer) -> DenseViews:
    return DenseViews(**carve(layer.weights.master, spec(layer)))


# id(table) -> rows(ids): a tied table's rows read from its LM head's repacked copy
# (`poly.runtime.tied`), so the table's own rows need not stay in memory for its lookups
LAID_TABLES: dict[int, Callable[[np.ndarray], np.ndarray]] = {}


def laid_rows(table, ids: np.ndarray) -> np.ndarray | None:
    """Rows `ids` of `table` from its copy in LAID_TABLES (the same values), or None."""
    rows = LAID_TABLES.get(id(table))
    return None if rows is None else rows(ids)


def lookup(table, ids: np.ndarray, dtype=np.float32) -> np.ndarray:
    """Rows of a float32/f16/bf16 array or a QTensor, as `dtype` [n, dim]."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    vocab = table.shape[0]
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        bad = int(ids[(ids < 0) | (ids >= vocab)][0])
        raise InvalidTokenError(f"token id {bad} is outside the vocabulary (size {vocab})")
    if not ids.size:
        return np.zeros((0, table.shape[1]), dtype=dtype)
    laid = laid_rows(table, ids)  # a tied head's copy serves, when there is one
    if laid is not None:
        return np.asarray(laid, dtype=dtype)
    if isinstance(table, np.ndarray):
        return np.asarray(table[ids], dtype=dtype)
    rows = np.stack([table.dequantize(int(i), int(i) + 1)[0] for i in ids])
    return rows.astype(dtype, copy=False)


def forward(layer, x: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
    store = layer.weights
    table = store.versions[store.active]["w"] if store.active is not None else views(layer).w
    return ACTIVATIONS[int(layer.activation)](lookup(table, x))


KIND = LayerKind(
    LayerType.EMBEDDING, forward, complete_dims, spec, views, matrices=frozenset({"w"})
)

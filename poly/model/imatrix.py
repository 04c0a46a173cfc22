"""The importance matrix: per input channel of every matrix, the mean squared activation over
calibration text (llama.cpp's `llama-imatrix`), which the weighted quantizers
(`poly.quant.weighted`) use to put rounding error where activations are small.

Gathered by running the model's reference path over the calibration chunks with an observer on
the dense matmul hook (`poly.ops.HOOKS`): a product's weight is a view on the layer's float32
master, so each named matrix whose bytes lie inside the weight read sees that product's input
(fused q|k|v and gate|up products feed all their parts). The model must hold float32 matrices
(a float source or an f32 `.entity`). Names are the `.entity` blob names:
`blocks.<i>.<role>.<name>`, `embeddings` (tied: the LM head's input), `lm_head`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from poly import ops
from poly.errors import UsageError
from poly.nn import layout

__all__ = ["matrices", "collect"]

Progress = Callable[[int, int, str], None]


def matrices(tf) -> dict[str, np.ndarray]:
    """Every 2-D weight of ``tf`` by its `.entity` blob name (the LM head as `embeddings` when tied)."""
    out: dict[str, np.ndarray] = {}
    for i in range(tf.config.num_layers):
        for role in ("attn", "mlp"):
            for name, value in layout.components(getattr(tf, role)(i)).items():
                if value is not None and np.ndim(value) == 2:
                    out[f"blocks.{i}.{role}.{name}"] = value
    out["embeddings"] = tf.embeddings
    if not tf.tied:
        out["lm_head"] = tf.lm_head
    return out


def _span(a: np.ndarray) -> tuple[int, int]:
    lo = a.__array_interface__["data"][0]
    return lo, lo + a.nbytes


def collect(
    tf, chunks: Iterable[Sequence[int]], total: int = 0, progress: Progress | None = None
) -> dict[str, np.ndarray]:
    """name -> float32 [in]: mean of x² per input channel over every token of ``chunks`` (each
    chunk a fresh sequence, as llama-imatrix runs them). Matrices no product read (an untied
    model's input embeddings) are absent."""
    mats = matrices(tf)
    bad = [n for n, m in mats.items() if not (isinstance(m, np.ndarray) and m.dtype == np.float32)]
    if bad:
        raise UsageError(f"the importance matrix needs float32 weights; {bad[0]} is not")
    spans = [(*_span(m), n) for n, m in mats.items()]
    sums = {n: np.zeros(m.shape[1], np.float64) for n, m in mats.items()}
    rows = dict.fromkeys(mats, 0)
    inner = ops.HOOKS["dense_matmul"]

    def observe(x, w, out=None):
        lo, hi = _span(w)
        sq = None
        for a, b, name in spans:
            if lo <= a and b <= hi and x.shape[1] == sums[name].size:
                sq = np.einsum("ij,ij->j", x, x, dtype=np.float64) if sq is None else sq
                sums[name] += sq
                rows[name] += x.shape[0]
        return inner(x, w, out)

    tick = progress or (lambda done, total, detail: None)
    ops.HOOKS["dense_matmul"] = observe
    try:
        for k, ids in enumerate(chunks):
            tf.reset()
            tf.forward_all(ids)
            tick(k + 1, total, f"calibration chunk {k + 1}")
    finally:
        ops.HOOKS["dense_matmul"] = inner
        tf.reset()
    return {n: (sums[n] / rows[n]).astype(np.float32) for n in mats if rows[n]}

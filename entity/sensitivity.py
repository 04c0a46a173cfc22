"""Measured sensitivity for the calibrated recipes (`entity.quantize`): the KL divergence of the
next-token distribution from the float model when ONE tensor alone is quantized, on a short
stretch of the calibration text.

- The LM head is the last op: its KL at every candidate type comes exactly from the float
  model's final hidden states (no model run; one product with the dequantized table per type).
- Every block matrix is measured at one type (Q4_0, the weighted rounding of the recipe) by a
  forward from its block's cached input (blocks before it are unchanged, so they are not run
  again): one partial forward per tensor.
- A tied table also feeds the input embeddings: that side is measured once (the head kept in
  float) and added to the head's exact KL.

The other types of a block matrix are scaled from the measured one by the relative weighted
rounding error (KL grows with the squared output error for small changes: exllamav3's measured
KL per layer with the error of each bit width). benchmarks/quant_sensitivity.py checks both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from poly.model.block import is_recipe_block, run_block
from poly.quant.ggml import GGMLType
from poly.quant.weighted import quantize
from poly.text.evaluate import log_softmax

__all__ = ["MEASURE_KIND", "Sensitivity", "measure", "measure_grouped"]

MEASURE_KIND = GGMLType.Q4_0  # the type every block matrix is measured at (32-element blocks)
Progress = Callable[[int, int, str], None]


def _kl(ref_logp: np.ndarray, logits: np.ndarray) -> float:
    """Mean over rows of KL(ref ‖ model), both as float64 log-softmaxes."""
    q = log_softmax(logits)
    return float((np.exp(ref_logp) * (ref_logp - q)).sum(axis=1).mean())


class Sensitivity:
    """The float model's block inputs, final hidden states and reference log-probabilities on
    ``ids``, kept once; `kl` then measures any one tensor replaced by its dequantized values."""

    def __init__(self, tf, ids: Sequence[int], first: int = 0):
        self.tf, self.first = tf, first  # KL over positions first.. (a scored half, as eval)
        tf.reset()
        self.ids = tf.check_ids(ids)
        x = tf.embed(self.ids, tf.activation_dtype)
        self.live = [i for i, blk in enumerate(tf.network.layers) if not blk.is_disabled]
        self.inputs: dict[int, np.ndarray] = {}
        for i in self.live:
            self.inputs[i] = x
            x = self._block(i, x)
        self.hidden = tf.norm_final(x)[first:]
        self.ref = log_softmax(tf.logits(self.hidden))
        tf.reset()

    def _block(self, i: int, x: np.ndarray) -> np.ndarray:
        blk, cfg = self.tf.network.layers[i], self.tf.config
        return run_block(blk, x, cfg=cfg) if is_recipe_block(blk, cfg.block) else blk.forward(x)

    def _from(self, start: int, x: np.ndarray | None = None) -> float:
        """KL of the model's output when the blocks from ``start`` on run again (on ``x``,
        default: the kept input of block ``start``)."""
        tf = self.tf
        tf.reset()
        try:
            x = self.inputs[start] if x is None else x
            for i in self.live:
                if i >= start:
                    x = self._block(i, x)
            return _kl(self.ref, tf.logits(tf.norm_final(x)[self.first :]))
        finally:
            tf.reset()

    def block_kl(self, start: int, w: np.ndarray, deq: np.ndarray) -> float:
        """KL with the block matrix ``w`` (a view on the model's float32 weights, in block
        ``start``) replaced by ``deq``."""
        keep = np.array(w, copy=True)
        w[...] = deq
        try:
            return self._from(start)
        finally:
            w[...] = keep

    def head_kl(self, w: np.ndarray, deq: np.ndarray) -> float:
        """KL with the LM head ``w`` replaced by ``deq``: exact, from the kept hidden states."""
        keep = np.array(w, copy=True)
        w[...] = deq
        try:
            return _kl(self.ref, self.tf.logits(self.hidden))
        finally:
            w[...] = keep

    def input_kl(self, deq: np.ndarray) -> float:
        """KL with the input embeddings replaced by ``deq`` (the head, tied or not, unchanged)."""
        tf = self.tf
        table, head, tied = tf.embeddings, tf.lm_head, tf.tied
        if tied:
            tf.lm_head = np.array(head, copy=True)  # untie for the run: the head stays float
        tf.embeddings = deq
        try:
            x = tf.embed(self.ids, tf.activation_dtype)  # looked up again from the new table
            return self._from(self.live[0], x) if self.live else 0.0
        finally:
            tf.embeddings = table
            tf.lm_head = table if tied else head


def measure(
    tf,
    ids: Sequence[int],
    mats: Mapping[str, np.ndarray],
    imatrix: Mapping[str, np.ndarray],
    kinds: Mapping[str, Sequence[GGMLType]],
    progress: Progress | None = None,
) -> dict[str, dict[str, float]]:
    """name -> {type name: measured KL} for every matrix of ``mats``: block matrices at
    MEASURE_KIND, the head (``lm_head`` or the tied ``embeddings``) at each of ``kinds[name]``
    (a tied table's entries include its input-embedding KL at MEASURE_KIND under the key
    ``"input"``)."""
    sens = Sensitivity(tf, ids)
    tick = progress or (lambda done, total, detail: None)
    out: dict[str, dict[str, float]] = {}
    for k, (name, w) in enumerate(mats.items()):
        imx = imatrix.get(name)
        if name in ("embeddings", "lm_head"):
            head = name == "lm_head" or tf.tied
            res = {}
            for kind in kinds[name] if head else ():
                res[kind.name] = sens.head_kl(w, quantize(np.asarray(w), kind, imx)[1])
            if name == "embeddings":
                res["input"] = sens.input_kl(quantize(np.asarray(w), MEASURE_KIND, imx)[1])
            out[name] = res
        else:
            start = int(name.split(".")[1])
            deq = quantize(np.asarray(w), MEASURE_KIND, imx)[1]
            out[name] = {MEASURE_KIND.name: sens.block_kl(start, w, deq)}
        tick(k + 1, len(mats), f"sensitivity {name}")
    return out


def measure_grouped(
    tf,
    ids: Sequence[int],
    mats: Mapping[str, np.ndarray],
    imatrix: Mapping[str, np.ndarray],
    rel: Mapping[str, float],
) -> dict[str, dict[str, float]]:
    """The cheap measurement (two forwards, not one per tensor), in `measure`'s format: on the
    second half of ``ids`` (every scored position has half the chunk as context, as `lucy eval`
    scores), the KL with every matrix at MEASURE_KIND and the head kept float, shared out over
    the block matrices and the table's input side in proportion to ``rel`` (each one's relative
    weighted error at MEASURE_KIND); the head's own KL at MEASURE_KIND exactly. Puts the head and
    the blocks on one measured scale; the ranking among blocks is the relative error's."""
    sens = Sensitivity(tf, ids, first=len(ids) // 2)
    head = "lm_head" if "lm_head" in mats else "embeddings" if tf.tied else None
    deq = {n: quantize(np.asarray(w), MEASURE_KIND, imatrix.get(n))[1] for n, w in mats.items()}
    out: dict[str, dict[str, float]] = {}
    if head is not None:
        out[head] = {MEASURE_KIND.name: sens.head_kl(mats[head], deq[head])}
    keep = {n: np.array(w, copy=True) for n, w in mats.items() if n.startswith("blocks.")}
    table, lm, tied = tf.embeddings, tf.lm_head, tf.tied
    try:
        for n in keep:
            mats[n][...] = deq[n]
        if tied:
            tf.lm_head = np.array(lm, copy=True)
        tf.embeddings = deq.get("embeddings", table)
        x = tf.embed(sens.ids, tf.activation_dtype)
        body = sens._from(sens.live[0], x) if sens.live else 0.0
    finally:
        for n, w in keep.items():
            mats[n][...] = w
        tf.embeddings = table
        tf.lm_head = table if tied else lm
    shared = [n for n in mats if n != "lm_head"]
    total = sum(max(rel[n], 0.0) for n in shared) or 1.0
    for n in shared:
        share = body * max(rel[n], 0.0) / total
        out.setdefault(n, {})["input" if n == "embeddings" else MEASURE_KIND.name] = share
    return out

"""Calibrated quantization for `convert`: the importance matrix of a float source, the default q4
recipe, and `--bpw`'s per-tensor allocation under a whole-file size budget.

Every chosen type is a GGUF block kind written by `poly.quant.weighted` and stored in the
`.entity` as native blocks (`entity.dotentity.native_blocks`: the blob record carries the
`ggml_type`, so the header names each tensor's type and the C kernels run it).

Sensitivity of tensor t at type k: its measured KL (`entity.sensitivity`: the head exactly at
every type, each block matrix by one partial forward at Q4_0 on the calibration text), scaled
to the other types by the imatrix-weighted squared error of its sampled rows relative to their
weighted energy (E‖ΔW x‖² / E‖W x‖², exllamav2's relative output error). ``measured=False``
allocates by that relative error alone (the cheap proxy; docs/quantization.md compares them).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from entity.calibration_text import DEFAULT_TEXT
from poly.errors import ConversionError, UsageError
from poly.nn import layout
from poly.quant.allocate import Option, allocate
from poly.quant.ggml import QUANT_SIZES, GGMLType
from poly.quant.qtensor import GGUFMatrix
from poly.quant.weighted import quantize, row_bytes

__all__ = ["Recipe", "Planner", "apply_recipe", "check_bpw", "calibration_chunks"]

_T = GGMLType
# --bpw candidates, small to large (K kinds only where the row is whole 256-blocks)
CANDIDATES = (_T.IQ4_NL, _T.Q4_0, _T.Q4_K, _T.Q4_1, _T.Q5_0, _T.Q5_K, _T.Q5_1, _T.Q6_K, _T.Q8_0)
FAST = (
    _T.Q4_0,
    _T.Q4_1,
    _T.Q8_0,
)  # the kinds the fused step's interleave16 kernels run (default q4)
SAMPLE_ROWS = 256  # rows per tensor whose error is measured (evenly spaced)
SENS_TOKENS = 128  # calibration tokens the per-tensor KL is measured on
CHUNK_TOKENS = 512
MAX_CHUNKS = 8
Progress = Callable[[int, int, str], None]


@dataclass
class Recipe:
    """Tensor name -> chosen type, the importance matrix that weighs their rounding, and the
    allocation table (name, params, type, predicted cost) for the report."""

    types: dict[str, GGMLType]
    imatrix: dict[str, np.ndarray]
    bpw: float | None = None
    table: list[tuple[str, int, str, float]] = field(default_factory=list)

    def matrix(self, name: str, w) -> object:
        """``w`` as the chosen type's GGUF blocks (unchanged when the recipe does not name it)."""
        kind = self.types.get(name)
        if kind is None or np.ndim(w) != 2:
            return w
        raw, _ = quantize(np.asarray(w, np.float32), kind, self.imatrix.get(name))
        return GGUFMatrix(raw, int(kind), np.shape(w))


def check_bpw(bpw) -> float:
    """The --bpw value as a float (UsageError: not a finite positive number)."""
    try:
        x = float(bpw)
    except (TypeError, ValueError):
        raise UsageError(f"--bpw must be a number, got {bpw!r}") from None
    if not math.isfinite(x) or x <= 0:
        raise UsageError(f"--bpw must be a positive number of bits per weight, got {bpw}")
    return x


def calibration_chunks(tokenizer, text: str | None, max_len: int = CHUNK_TOKENS) -> list[list[int]]:
    """Token chunks of ``text`` (default: the shipped calibration text), each at most
    CHUNK_TOKENS and ``max_len`` (the model's context) long."""
    ids = list(tokenizer.encode(DEFAULT_TEXT if text is None else text))
    if not ids:
        raise UsageError("the calibration text is empty")
    n = max(2, min(CHUNK_TOKENS, max_len))
    chunks = [ids[a : a + n] for a in range(0, len(ids), n)]
    return [c for c in chunks if len(c) > 1][:MAX_CHUNKS] or [ids]


def _read_text(path: str | os.PathLike | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read calibration text {path}: {exc}") from None


def _fits(kind: GGMLType, n_in: int) -> bool:
    return n_in % QUANT_SIZES[kind][0] == 0


def _sample(w: np.ndarray) -> np.ndarray:
    n = w.shape[0]
    rows = np.linspace(0, n - 1, min(n, SAMPLE_ROWS)).astype(np.int64)
    return np.asarray(w[rows], np.float32)


def _options(w, imx) -> list[Option]:
    """Each candidate's bytes and predicted cost (relative weighted output error)."""
    out_dim, n_in = np.shape(w)
    rows = _sample(w)
    q = np.ones(n_in) if imx is None else np.asarray(imx, np.float64)
    energy = float(np.square(rows, dtype=np.float64).sum(axis=0) @ q) or 1.0
    opts = []
    for kind in _kinds(w):
        _, deq = quantize(rows, kind, imx)
        err = float(np.square(rows - deq, dtype=np.float64).sum(axis=0) @ q)
        opts.append(Option(kind.name, out_dim * row_bytes(kind, n_in), err / energy))
    return opts


class Planner:
    """A float source's matrices and importance matrix, measured once; `recipe` then allocates
    for any budget (convert re-allocates when the written file came out above it)."""

    def __init__(
        self,
        src,
        calibration=None,
        progress: Progress | None = None,
        *,
        measured: bool | str = "group",
        imatrix: dict[str, np.ndarray] | None = None,
    ):
        """``measured``: "group" (the default), the grouped measurement of two forwards
        (`entity.sensitivity.measure_grouped`: it met issue 59's targets on SmolLM2); True, KL
        per tensor (a partial forward each, far slower); False, the relative error alone. ``imatrix``: one kept from an earlier Planner of the same source and text."""
        from entity.load import load
        from poly.model.imatrix import collect, matrices
        from poly.text.evaluate import parameter_count

        text = _read_text(calibration)
        tf = load(src)
        if tf.tokenizer is None:
            raise UsageError("calibration needs the model's tokenizer; the source has none")
        # rows no block kind divides stay with the scheme's own encoding
        self.mats = {n: w for n, w in matrices(tf).items() if _kinds(w)}
        for name, w in self.mats.items():  # before the model runs on them (an IndexError later)
            if not np.isfinite(w).all():
                raise ConversionError(f"{name}: non-finite weights (NaN or Inf) in the source")
        chunks = calibration_chunks(tf.tokenizer, text, tf.config.max_seq_len)
        self.imatrix = (
            imatrix if imatrix is not None else collect(tf, chunks, len(chunks), progress)
        )
        self.tf, self.measured = tf, measured
        self.sens_ids = chunks[0][:SENS_TOKENS]
        self.group_ids = chunks[0]  # the grouped measurement scores its second half
        self.kl: dict[str, dict[str, float]] | None = None  # measured KL (entity.sensitivity)
        vectors = [
            v
            for blk in tf.network.layers
            for sub in blk.sequential_layers
            for v in layout.components(sub).values()
            if v is not None and np.ndim(v) == 1
        ]
        vectors.append(np.asarray(tf.final_norm))  # fmt: skip
        self.vector_bytes = 4 * sum(int(np.size(v)) for v in vectors)
        self.params = parameter_count(tf)  # as `lucy eval` counts bits per weight
        self.header_bytes = len(tf.tokenizer.to_str().encode()) + (1 << 16)
        self.options: dict[str, list[Option]] | None = None  # relative error (the proxy)
        self.kl_options: dict[str, list[Option]] | None = None  # measured KL
        # kind names left out (a benchmark's choice): "KIND" everywhere, "KIND@prefix" only for
        # the tensors whose name starts with prefix
        self.exclude: set[str] = set()

    def _measure(self, progress: Progress | None, measured: bool) -> dict[str, list[Option]]:
        tick = progress or (lambda done, total, detail: None)
        if self.options is None:
            self.options = {}
            for k, (name, w) in enumerate(self.mats.items()):
                self.options[name] = _options(w, self.imatrix.get(name))
                tick(k + 1, len(self.mats), f"rounding error {name}")
        if not measured:
            return self.options
        if self.kl_options is None:
            self.kl_options = self._scaled(self.options, tick)
        return self.kl_options

    def _scaled(self, rel: dict[str, list[Option]], tick: Progress) -> dict[str, list[Option]]:
        """Each option's cost as measured KL: the head's own at every type (or at MEASURE_KIND
        times rel(type) / rel(MEASURE_KIND) when only that was measured), a block matrix's (and
        a tied table's input side) at MEASURE_KIND times the same ratio."""
        from entity.sensitivity import MEASURE_KIND

        if self.kl is None:  # (a benchmark may hand in a kept measurement)
            self.kl = self._measure_kl(rel, tick)
        out = {}
        for name, opts in rel.items():
            m = self.kl[name]
            base = next(o.cost for o in opts if o.kind == MEASURE_KIND.name)
            side = max(m.get("input", m.get(MEASURE_KIND.name, 0.0)), 0.0)  # scaled part
            if name == "lm_head":
                side = 0.0
            own = name == "lm_head" or (name == "embeddings" and self.tf.tied)  # the head's KL
            out[name] = [Option(o.kind, o.nbytes, _kl_cost(m, o, base, own, side)) for o in opts]
        return out

    def _measure_kl(self, rel: dict[str, list[Option]], tick: Progress):
        from entity.sensitivity import MEASURE_KIND, measure, measure_grouped

        if self.measured == "group":
            at = {n: next(o.cost for o in v if o.kind == MEASURE_KIND.name) for n, v in rel.items()}
            return measure_grouped(self.tf, self.group_ids, self.mats, self.imatrix, at)
        kinds = {n: [_T[o.kind] for o in v] for n, v in rel.items()}
        return measure(self.tf, self.sens_ids, self.mats, self.imatrix, kinds, tick)

    def _choose(self, budget: int, kinds, bpw, progress, measured: bool) -> Recipe:
        names = {k.name for k in kinds}
        opts = self._measure(progress, measured)
        opts = {n: [o for o in v if o.kind in names and self._allowed(n, o.kind)]
                for n, v in opts.items()}  # fmt: skip
        choice = allocate(opts, budget)
        table = [
            (n, int(np.prod(np.shape(self.mats[n]))), o.kind, o.cost) for n, o in choice.items()
        ]
        return Recipe({n: _T[o.kind] for n, o in choice.items()}, self.imatrix, bpw, table)

    def _allowed(self, name: str, kind: str) -> bool:
        for rule in self.exclude:
            k, _, prefix = rule.partition("@")
            if k == kind and name.startswith(prefix):
                return False
        return True

    def default(self, progress: Progress | None = None) -> Recipe:
        """The default q4: the fast kinds (Q4_0, Q4_1, Q8_0: the interleave16 kernels of today's q4)
        allocated within the matrix bytes of llama.cpp's Q4_0 recipe (Q4_0 blocks, Q8_0
        embeddings / LM head), the .entity header taken out of them: never larger than that
        file, the bytes moved to the tensors where the imatrix-weighted error is largest."""
        ref = sum(
            np.shape(w)[0] * row_bytes(kind, np.shape(w)[1])
            for name, w in self.mats.items()
            for kind in [_reference_kind(name)]
        )
        least = sum(
            np.shape(w)[0]
            * min(row_bytes(k, np.shape(w)[1]) for k in FAST if _fits(k, np.shape(w)[1]))
            for w in self.mats.values()
        )  # a tiny model's header can outweigh its matrices: then the smallest fast kinds
        # the relative error alone: the measured KL costs a partial forward per tensor
        return self._choose(max(ref - self.header_bytes, least), FAST, None, progress, False)

    def floor_bpw(self) -> float:
        least = sum(
            np.shape(w)[0] * min(row_bytes(k, np.shape(w)[1]) for k in _kinds(w))
            for w in self.mats.values()
        )
        return (least + self.vector_bytes + self.header_bytes) * 8 / self.params

    def recipe(self, bpw: float, extra: int = 0, progress: Progress | None = None) -> Recipe:
        """Types whose whole file fits (bpw + 0.05) · params / 8 bytes (``extra``: bytes the
        last written file came out above the estimate)."""
        if bpw + 0.05 < self.floor_bpw():
            raise UsageError(
                f"--bpw {bpw:g} is below the smallest types for this model "
                f"({self.floor_bpw():.2f} bits per weight)"
            )
        fixed = self.vector_bytes + self.header_bytes + extra
        budget = int((bpw + 0.05) * self.params / 8) - fixed
        return self._choose(budget, CANDIDATES, bpw, progress, self.measured)


def _kl_cost(m: dict[str, float], o: Option, base: float, own: bool, side: float) -> float:
    """One option's predicted KL: the head's own (measured at this type, else at MEASURE_KIND
    scaled by the relative errors) plus the scaled block / input side."""
    from entity.sensitivity import MEASURE_KIND

    ratio = o.cost / base if base else 0.0
    if not own:
        return side * ratio
    head = m[o.kind] if o.kind in m else m.get(MEASURE_KIND.name, 0.0) * ratio
    return max(head, 0.0) + side * ratio


def _reference_kind(name: str) -> GGMLType:
    return _T.Q8_0 if name in ("embeddings", "lm_head") else _T.Q4_0


def _kinds(w) -> list[GGMLType]:
    return [k for k in CANDIDATES if _fits(k, np.shape(w)[1])]


def apply_recipe(blocks, globals_, recipe: Recipe):
    """(blocks, globals_) with every named matrix replaced by its chosen GGUF blocks."""

    def new_blocks():
        for i, comps in blocks:
            yield (
                i,
                {
                    role: {n: recipe.matrix(f"blocks.{i}.{role}.{n}", w) for n, w in parts.items()}
                    for role, parts in comps.items()
                },
            )

    def new_globals():
        emb, head, final = globals_()
        head = None if head is None else recipe.matrix("lm_head", head)
        return recipe.matrix("embeddings", emb), head, final

    return new_blocks(), new_globals

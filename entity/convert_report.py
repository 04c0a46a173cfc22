"""What `convert` reports: per-tensor reconstruction error and the conversion record."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from poly.errors import IntegrityError
from poly.quant.qtensor import QTensor

ROW_CHUNK = 4096  # row chunk of the error statistics (bounded float64 temporaries)
_EXPERT = re.compile(r"\.experts\.\d+\.")  # blocks.<i>.mlp.experts.<e>.<view>


@dataclass(frozen=True)
class TensorStat:
    """Reconstruction error of one tensor: max |a-b| and RMS(a-b)/RMS(a)."""

    name: str
    shape: tuple[int, ...]
    max_abs: float
    rel_rms: float

    @property
    def exact(self) -> bool:
        return self.max_abs == 0.0


@dataclass
class ConvertReport:
    src: str
    dst: str
    quant: str
    source_format: str
    bytes: int = 0
    seconds: float = 0.0
    verified: bool = False
    tensors: list[TensorStat] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # one line each, for the caller to show
    recipe: Any = None  # entity.quantize.Recipe of a calibrated conversion (its types, table)

    @property
    def exact(self) -> bool:
        return self.verified and all(t.exact for t in self.tensors)

    @property
    def max_abs(self) -> float:
        return max((t.max_abs for t in self.tensors), default=0.0)

    @property
    def max_rel_rms(self) -> float:
        return max((t.rel_rms for t in self.tensors), default=0.0)

    def matrices(self) -> list[TensorStat]:
        """The 2-D tensors; a MoE layer's experts fold into one row per layer and view (the
        worst of them), so a 64-expert model reports like a dense one."""
        groups: dict[tuple[str, tuple[int, ...]], list[TensorStat]] = {}
        for t in self.tensors:
            if len(t.shape) == 2:
                groups.setdefault((_EXPERT.sub(".experts.*.", t.name), t.shape), []).append(t)
        return [
            ts[0]
            if len(ts) == 1
            else TensorStat(
                name.replace(".experts.*.", f".experts.*({len(ts)}).", 1),
                shape,
                max(t.max_abs for t in ts),
                max(t.rel_rms for t in ts),
            )
            for (name, shape), ts in groups.items()
        ]

    def format(self) -> str:
        """The error report as text (the CLI prints it; the 4-bit error report for q4)."""
        lines = [
            f"{self.src} -> {self.dst} [{self.quant}] {self.bytes} bytes in {self.seconds:.2f}s",
            *self.notes,
        ]
        if self.verified:
            lines.append(f"{'tensor':40s} {'shape':>14s} {'max_abs':>10s} {'rel_rms':>9s}")
            for t in self.matrices():
                shape = "x".join(map(str, t.shape))
                lines.append(f"{t.name:40s} {shape:>14s} {t.max_abs:10.3g} {t.rel_rms:9.3%}")
            lines.append(f"worst max_abs {self.max_abs:.4g}, worst rel_rms {self.max_rel_rms:.3%}")
        return "\n".join(lines)


def float_rows(x: Any, a: int, b: int) -> np.ndarray:
    if isinstance(x, QTensor):
        return x.dequantize(a, b).astype(np.float64)
    return np.asarray(x[a:b], dtype=np.float64)


def error_stat(name: str, ref: Any, got: Any) -> TensorStat:
    """Compare two tensors (arrays or QTensors) row block by row block."""
    shape = tuple(ref.shape)
    if tuple(got.shape) != shape:
        raise IntegrityError(f"{name}: shape {tuple(got.shape)} != source {shape} (roundtrip)")
    if len(shape) == 1:
        ref, got, rows = np.asarray(ref)[None], np.asarray(got)[None], 1  # [1, n]
    else:
        rows = shape[0]
    max_abs, sq_err, sq_ref = 0.0, 0.0, 0.0
    for a in range(0, rows, ROW_CHUNK):
        r, g = (
            float_rows(ref, a, min(rows, a + ROW_CHUNK)),
            float_rows(got, a, min(rows, a + ROW_CHUNK)),
        )
        diff = r - g
        if diff.size:
            max_abs = max(max_abs, float(np.max(np.abs(diff))))
        sq_err += float(np.sum(diff * diff))
        sq_ref += float(np.sum(r * r))
    rel = math.sqrt(sq_err / sq_ref) if sq_ref > 0 else (0.0 if sq_err == 0 else math.inf)
    return TensorStat(name, shape, max_abs, rel)

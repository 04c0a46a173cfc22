"""Menu [6]: per-layer forward parity of every dtype against float32 (Loom's Lucy suites).

Small random RMSNorm / MHA / SwiGLU layers are morphed to each of the 21 dtypes with
`poly.model.morph.morph_layer`, run forward on the same input, and compared with the float32 output.
Buckets follow Loom's harness (inventory §8).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np

from poly.dtypes import DType
from poly.layer import LayerType, VolumetricLayer
from poly.nn import layout

SEQ, D_MODEL, HEADS, KV_HEADS, INTER = 8, 64, 4, 2, 128
TOL_F32, TOL_OTHER = 1e-5, 1e-3
HEAVY_DRIFT_MAX = 1.0  # beyond this the output is unrelated to the reference

# (upper bound on max|diff| as a multiple of tol or absolute, bucket); first match wins.
BUCKETS = (
    ("tol", 1.0, "INDUSTRY"),
    ("tol", 10.0, "LOWBIT"),
    ("abs", 0.1, "DRIFT"),
    ("abs", HEAVY_DRIFT_MAX, "HEAVY DRIFT"),
)


@dataclass(frozen=True)
class SuiteRow:
    layer: str
    dtype: str
    max_diff: float
    tolerance: float
    bucket: str
    error: str = ""


def bucket(max_diff: float, tol: float) -> str:
    """Loom's bucket for a max |diff| (NaN/Inf = FATAL, exact 0 = EXACT)."""
    if not math.isfinite(max_diff):
        return "FATAL"
    if max_diff == 0.0:
        return "EXACT"
    for kind, bound, name in BUCKETS:
        if max_diff <= (bound * tol if kind == "tol" else bound):
            return name
    return "BROKEN"


def _rmsnorm(rng) -> VolumetricLayer:
    layer = VolumetricLayer(type=LayerType.RMSNORM, input_height=D_MODEL, rms_norm_eps=1e-6)
    layout.rmsnorm(layer).gamma[:] = 1.0 + 0.1 * rng.standard_normal(D_MODEL)
    return layer


def _mha(rng) -> VolumetricLayer:
    layer = VolumetricLayer(
        type=LayerType.MHA, d_model=D_MODEL, num_heads=HEADS, num_kv_heads=KV_HEADS, max_seq_len=64
    )
    master = layer.weights.master
    master[:] = (rng.standard_normal(master.size) / math.sqrt(D_MODEL)).astype(np.float32)
    return layer


def _swiglu(rng) -> VolumetricLayer:
    layer = VolumetricLayer(type=LayerType.SWIGLU, input_height=D_MODEL, output_height=INTER)
    master = layer.weights.master
    master[:] = (rng.standard_normal(master.size) / math.sqrt(D_MODEL)).astype(np.float32)
    return layer


BUILDERS = {"RMSNorm": _rmsnorm, "MHA": _mha, "SwiGLU": _swiglu}


def _forward(layer: VolumetricLayer, x: np.ndarray) -> np.ndarray:
    layer.reset()
    return np.asarray(layer.forward(x.copy()), dtype=np.float32)


def _morphed(layer: VolumetricLayer, dtype: DType) -> VolumetricLayer:
    from poly.model.morph import morph_layer

    target = copy.deepcopy(layer)
    result = morph_layer(target, dtype)
    return result if isinstance(result, VolumetricLayer) else target


def run_layer(name: str, layer: VolumetricLayer, x: np.ndarray, dtypes) -> list[SuiteRow]:
    ref = _forward(layer, x)
    rows = []
    for dt in dtypes:
        tol = TOL_F32 if dt == DType.FLOAT32 else TOL_OTHER
        try:
            out = _forward(_morphed(layer, dt), x)
            with np.errstate(invalid="ignore", over="ignore"):
                diff = float(np.max(np.abs(out - ref)))
            rows.append(SuiteRow(name, dt.label, diff, tol, bucket(diff, tol)))
        except Exception as exc:  # noqa: BLE001 - a failing dtype is a FATAL row, not a crash
            rows.append(SuiteRow(name, dt.label, float("nan"), tol, "FATAL", str(exc)))
    return rows


def run_suite(seed: int = 0, dtypes=None, layers=None) -> list[SuiteRow]:
    """Rows for every (layer, dtype) pair; `layers` restricts to names in BUILDERS."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((SEQ, D_MODEL)).astype(np.float32)  # [seq, d_model]
    dtypes = list(DType) if dtypes is None else list(dtypes)
    rows = []
    for name in layers or BUILDERS:
        rows += run_layer(name, BUILDERS[name](rng), x, dtypes)
    return rows

"""Loom's tile-size rules (inventory §3; Go `poly/tile_detection.go`) as plain functions.

`cpu_tile_sizes` gives one tile per dtype for a layer kind from the L1 data-cache size; the tile is
the row-block size of blocked projections and the key-block size of tiled attention.
`gpu_tile_sizes` reproduces the GPU rules from a supplied limits record (no GPU is touched).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from poly.dtypes import DType
from poly.errors import LayerConfigError

_SYS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")
_SIZE_SUFFIX = {"K": 1024, "M": 1024 * 1024, "G": 1024**3}


@dataclass(frozen=True)
class HardwareInfo:
    """Cache sizes in bytes and CPU count; defaults are Loom's (32 KiB, 256 KiB, 8 MiB)."""

    l1d: int = 32768
    l2: int = 262144
    l3: int = 8388608
    num_cpus: int = 1

    @classmethod
    def probe(cls, cache_dir: Path | str = _SYS_CACHE) -> HardwareInfo:
        """Read Linux sysfs `index*/{level,type,size}`; anything unreadable keeps the default."""
        sizes = {"l1d": cls.l1d, "l2": cls.l2, "l3": cls.l3}
        for i in range(4):
            entry = _read_cache_index(Path(cache_dir) / f"index{i}")
            if entry is None:
                continue
            level, kind, size = entry
            if level == 1 and kind in ("data", "unified"):
                sizes["l1d"] = size
            elif level in (2, 3):
                sizes[f"l{level}"] = size
        if sizes["l1d"] <= 0:
            sizes["l1d"] = 32768
        return cls(num_cpus=os.cpu_count() or 1, **sizes)


def _read_cache_index(path: Path) -> tuple[int, str, int] | None:
    try:
        level = int((path / "level").read_text().strip())
        kind = (path / "type").read_text().strip().lower()
        text = (path / "size").read_text().strip().upper()
    except (OSError, ValueError):
        return None
    mult = _SIZE_SUFFIX.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in _SIZE_SUFFIX else text
    try:
        return level, kind, int(digits) * mult
    except ValueError:
        return None


@functools.cache
def hardware_info() -> HardwareInfo:
    """This machine's HardwareInfo, probed once."""
    return HardwareInfo.probe()


# --- CPU rules (inventory §3.3) ------------------------------------------------------------------

_DENSE_CANDIDATES = (8, 16, 32, 64, 128, 256)
_RESIDUAL_CANDIDATES = (64, 128, 256, 512, 1024, 2048)


def _largest_fit(limit: float, candidates: tuple[int, ...]) -> int:
    """Largest candidate <= limit; the smallest candidate when none fits."""
    fits = [c for c in candidates if c <= limit]
    return fits[-1] if fits else candidates[0]


def _l1_limit(hw: HardwareInfo, dt: DType, width: int) -> float:
    l1 = hw.l1d if hw.l1d > 0 else 32768
    # Go divides in float64: a zero width gives +Inf (largest candidate).
    return math.inf if width <= 0 else l1 / (dt.tile_bytes * width)


def dense_tile(in_dim: int, dt: DType, hw: HardwareInfo) -> int:
    """CalculateOptimalDenseTileSize: tile rows of `in_dim` weights fit in L1."""
    return _largest_fit(_l1_limit(hw, dt, in_dim), _DENSE_CANDIDATES)


def _cap(ts: int, *dims: int) -> int:
    """capMHAProjTileToLayer: a non-positive dim counts as 1."""
    for d in dims:
        ts = min(ts, d if d > 0 else 1)
    return max(ts, 1)


def _tile_mha(dt, hw, d_model, query_dim, kv_dim, **_):
    q = query_dim if query_dim > 0 else d_model  # Loom sizes with QueryDim 0 -> DModel
    out_dim = max(q, kv_dim, d_model)
    return _cap(dense_tile(d_model, dt, hw), d_model, out_dim)


def _tile_swiglu(dt, hw, input_height, output_height, **_):
    ts = dense_tile(input_height, dt, hw)
    return max(min(ts, input_height, output_height), 1)


def _tile_dense(dt, hw, input_height, output_height, **_):
    ts = dense_tile(input_height, dt, hw)
    top = max(input_height, output_height)
    return ts if top <= 0 else max(min(ts, top), 1)


def _tile_residual(dt, hw, **_):
    return _largest_fit(_l1_limit(hw, dt, 3), _RESIDUAL_CANDIDATES)


def _tile_embedding(dt, hw, embedding_dim, **_):
    return _largest_fit(_l1_limit(hw, dt, embedding_dim), _DENSE_CANDIDATES)


def _tile_default(dt, hw, **_):
    return 8


_CPU_RULES: dict[str, Callable[..., int]] = {
    "dense": _tile_dense,
    "mha": _tile_mha,
    "swiglu": _tile_swiglu,
    "rmsnorm": _tile_default,
    "residual": _tile_residual,
    "embedding": _tile_embedding,
    "sequential": _tile_default,
}


def _rule(table: dict[str, Callable[..., object]], kind: str) -> Callable[..., object]:
    rule = table.get(kind.lower()) if isinstance(kind, str) else None
    if rule is None:
        raise LayerConfigError(f"no tile rule for layer kind {kind!r}; known: {sorted(table)}")
    return rule


def cpu_tile_sizes(
    kind: str,
    *,
    d_model: int = 0,
    query_dim: int = 0,
    kv_dim: int = 0,
    input_height: int = 0,
    output_height: int = 0,
    embedding_dim: int = 0,
    hw: HardwareInfo | None = None,
) -> dict[DType, int]:
    """Loom's per-dtype CPU scalar tile for a layer kind, for all 21 dtypes."""
    rule = _rule(_CPU_RULES, kind)
    hw = hw or hardware_info()
    dims = dict(
        d_model=d_model,
        query_dim=query_dim,
        kv_dim=kv_dim,
        input_height=input_height,
        output_height=output_height,
        embedding_dim=embedding_dim,
    )
    return {dt: int(rule(dt, hw, **dims)) for dt in DType}


# --- GPU rules (inventory §3.4) ------------------------------------------------------------------


@dataclass(frozen=True)
class GPULimits:
    """The two WebGPU adapter limits Loom's GPU tile rules read."""

    max_workgroup_storage: int = 32768
    max_invocations: int = 256


def gpu_tile_from_limits(storage: int, invocations: int, head_dim: int) -> int:
    """CalculateOptimalGPUTileSizeFromLimits: K and V float32 rows of head_dim in half the storage."""
    head_dim = head_dim if head_dim > 0 else 64
    tile = (storage // 2) // (head_dim * 2 * 4) if storage > 0 else 32
    if invocations > 0:
        tile = min(tile, invocations)
    return max(min(tile, 64), 8) // 8 * 8


def _multiplier(dt: DType) -> float:
    b = dt.tile_bytes
    return min(4.0 / b, 4.0) if b < 4 else 1.0


def _gpu_mha(dt, lim, base, head_dim):
    sc = gpu_tile_from_limits(lim.max_workgroup_storage // 2, lim.max_invocations, head_dim)
    mc = gpu_tile_from_limits(lim.max_workgroup_storage, lim.max_invocations, head_dim)
    if dt.tile_bytes < 4:
        sc, mc = int(sc * 1.5), int(mc * 1.5)
    return min(sc, 64) // 8 * 8, min(mc, 128) // 8 * 8


def _gpu_swiglu(dt, lim, base, head_dim):
    sc = min(max(int(base * 4 * _multiplier(dt)), 64), 256) // 64 * 64
    mc = lim.max_invocations if 0 < lim.max_invocations <= 256 else 256
    mc = max(mc // 64 * 64, 64)
    if sc >= mc:
        sc = max(mc // 2, 64)
    return sc, mc


def _gpu_dense(dt, lim, base, head_dim):
    # DenseGPUTileSizesFromContext. Loom's refresh gives Dense layers the default rule instead.
    m = _multiplier(dt)
    sc = min(max(int(base * m), 32), 128) // 32 * 32
    mc = max(min(int(lim.max_invocations * m), 256) // 64 * 64, 64)
    return sc, mc


def _gpu_default(dt, lim, base, head_dim):
    m = _multiplier(dt)
    sc = min(max(int(base * m), 32), 64) // 32 * 32
    mc = max(min(int(lim.max_invocations / 4.0 * m), 128) // 64 * 64, 64)
    return sc, mc


_GPU_RULES: dict[str, Callable[..., tuple[int, int]]] = {
    "mha": _gpu_mha,
    "swiglu": _gpu_swiglu,
    "dense": _gpu_default,  # what Loom's refreshRuntimeGPUTileSizes assigns (see docs/dtypes.md)
    "dense_kernel": _gpu_dense,
    "rmsnorm": _gpu_default,
    "residual": _gpu_default,
    "embedding": _gpu_default,
    "sequential": _gpu_default,
}


def gpu_tile_sizes(
    kind: str, *, head_dim: int = 0, limits: GPULimits | None = None
) -> tuple[dict[DType, int], dict[DType, int]]:
    """Loom's (single-core, multi-core) GPU tile maps for a layer kind, for all 21 dtypes."""
    rule = _rule(_GPU_RULES, kind)
    lim = limits or GPULimits()
    base = gpu_tile_from_limits(lim.max_workgroup_storage, lim.max_invocations, 64)
    pairs = {dt: rule(dt, lim, base, head_dim) for dt in DType}
    return {dt: p[0] for dt, p in pairs.items()}, {dt: p[1] for dt, p in pairs.items()}

"""A sequence's KV state in a file: `Transformer.save_state(path)` / `load_state(path)`.

The file is a safetensors file (8-byte little-endian header size, a JSON header, raw arrays):
per attention layer i the cached rows "k.i" / "v.i" [rows, kv_heads, head_dim] in the cache's
dtype (a q8_0 cache: int8 codes, and its float16 scales "ks.i" / "vs.i"), and "tokens" int32 [position] when the caller gave the ids the cache holds. The header's
``__metadata__`` carries the state: each cache's length/start/rope_len, the caller's `meta`
(JSON), and the model's identity (architecture, a digest of its config, the KV shapes and dtype,
a digest sampled from its weights), so a state never loads into another model. No pickle; the
write is atomic; a read (poly/model/state_load.py) checks every declared size against the file
and the model before it allocates anything, and allocates only the model's own caches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import struct
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from poly.errors import (
    InsufficientSpaceError,
    OutputPathError,
    PolyError,
    StateFileError,
    StateMismatchError,
)
from poly.nn.kvcache import KVCache, kv_dtype
from poly.weights import Generations, PlanCache

FORMAT, VERSION = "poly-kv-state", "1"
HEADER_MAX = 16 << 20  # a header past this is not ours (the arrays are outside it)
_ST_DTYPES = {"F32": "float32", "F16": "float16", "F64": "float64", "I32": "int32", "I8": "int8"}
ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_SAMPLE = (32, 32)  # chunks x contiguous values read per weight array for its digest


@dataclass
class SavedState:
    """What `load_state` restored: the cached token ids (None when none were saved), the
    position the caches reached, and the caller's `meta` (a JSON object)."""

    position: int
    tokens: list[int] | None = None
    meta: dict = field(default_factory=dict)


# --- identity -----------------------------------------------------------------------------------


def _plain(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.generic,)):
        return x.item()
    return str(x)


def _config_digest(config) -> str:
    """The config without the context length (a state fits any context holding it) or `extra`."""
    d = dataclasses.asdict(config)
    d.pop("max_seq_len", None)
    d.pop("extra", None)
    text = json.dumps(d, sort_keys=True, default=_plain)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# The arrays that define a stored matrix (poly/quant/qtensor.py); not the copies made from them
# on first use (repacked rows repacked16/kquant_interleave8, GGUF's reordered _raw), which come
# and go.
_DEFINING = ("array", "encoded", "codes", "scales", "zero", "packed", "stored", "order")


def _arrays(obj, depth: int = 0) -> list[np.ndarray]:
    if obj is None:
        return []
    if isinstance(obj, np.ndarray):
        return [obj]
    out = []
    for name in _DEFINING if depth < 2 else ():
        out += _arrays(getattr(obj, name, None), depth + 1)
    return out


def _sample(h, a: np.ndarray) -> None:
    """Hash the shape, dtype and a few contiguous chunks spread over `a` (a few pages, not the
    whole array: a 7B model's weights would take seconds)."""
    h.update(f"{a.dtype.str}{a.shape}".encode())
    if a.size == 0:
        return
    chunks, width = _SAMPLE
    starts = np.linspace(0, max(a.size - width, 0), chunks).astype(np.int64)
    idx = np.minimum(starts[:, None] + np.arange(width), a.size - 1).reshape(-1)
    h.update(np.ascontiguousarray(a.flat[idx]).view(np.uint8).tobytes())


def _weights_digest(model) -> str:
    h = hashlib.sha256()
    for layer in model.network.walk():
        store = layer.weights
        if store is None or not store.size:
            continue
        if store.active is None:
            parts = [store.master]
        else:
            parts = [store.versions[store.active][k] for k in sorted(store.versions[store.active])]
        h.update(f"{layer.type.label}:{store.active}".encode())
        for part in parts:
            for a in _arrays(part):
                _sample(h, a)
    tables = [model.embeddings, None if model.tied else model.lm_head, model.lm_head_bias]
    for part in tables + [model.final_norm]:
        for a in _arrays(part):
            _sample(h, a)
    return h.hexdigest()[:32]


def identity(model) -> dict:
    """What a state must match to load into `model` (cached until a weight or layer changes)."""
    cache = model.__dict__.get("plan_cache")
    if cache is None:
        cache = model.plan_cache = PlanCache()
    weights = cache.get("state_identity", Generations.value, lambda: _weights_digest(model))
    cfg, store = model.config, kv_dtype(model.attn(0), model.activation_dtype)
    layers = [model.attn(i) for i in range(cfg.num_layers)]
    return {
        "architecture": cfg.architecture,
        "config": _config_digest(cfg),
        "kv_dtype": "q8_0" if store == np.int8 else store.name,
        "kv_shapes": [[a.num_kv_heads, a.head_dim, int(a.sliding_window)] for a in layers],
        "weights": weights,
    }


def check_identity(model, saved) -> None:
    if not isinstance(saved, dict):
        raise StateFileError("the state file has no model identity")
    want = identity(model)
    for key, value in want.items():
        if saved.get(key) != value:
            what = {"weights": "weights", "config": "configuration", "kv_dtype": "KV dtype"}
            got = saved.get(key) if key in ("architecture", "kv_dtype") else None
            extra = f": file {got}, model {value}" if got is not None else ""
            raise StateMismatchError(
                f"the state file was saved from another model ({what.get(key, key)} differ"
                f"{'s' if key != 'weights' else ''}{extra})"
            )


# --- saving ---------------------------------------------------------------------------------------


def save(model, path, tokens=None, meta: dict | None = None, caches=None) -> int:
    """Write the model's KV state to `path` atomically; the file's size in bytes. `tokens`: the
    ids the caches hold (exactly `model.position` of them), kept for the caller's history.
    ``caches``: another sequence's caches (one per layer, e.g. a server's) instead of the model's."""
    if caches is None:
        caches = [model.attn(i).state for i in range(model.config.num_layers)]
    first = caches[0] if caches else None
    position = 0 if first is None else int(first.length)
    layers, arrays = [], []
    for i, c in enumerate(caches):
        if not isinstance(c, KVCache) or c.length == 0:
            layers.append(None)
            continue
        if c.length != position:
            raise StateFileError(f"layer {i}'s cache holds {c.length} positions, not {position}")
        rows = c.length - c.start
        layers.append({"length": c.length, "start": c.start, "rope_len": c.rope_len})
        arrays += [(f"{name}.{i}", getattr(c, name)[:rows]) for name in c.arrays()]
    if tokens is not None:
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.size != position:
            raise StateFileError(f"{ids.size} tokens given, the KV cache holds {position}")
        arrays.append(("tokens", ids.astype(np.int32)))
    state = {"model": identity(model), "position": position, "layers": layers}
    state["meta"] = dict(meta or {})
    state["crc32"] = {name: zlib.crc32(_bytes(a)) for name, a in arrays}
    header = _header(state, arrays)
    return _write_atomic(Path(path), header, [a for _, a in arrays])


def _header(state: dict, arrays: list) -> bytes:
    try:
        text = json.dumps(state, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise StateFileError(f"the state's meta is not plain JSON: {exc}") from None
    head: dict[str, Any] = {"__metadata__": {"format": FORMAT, "version": VERSION, "state": text}}
    at = 0
    for name, a in arrays:
        head[name] = {"dtype": ST_NAMES[a.dtype.name], "shape": list(a.shape),
                      "data_offsets": [at, at + a.nbytes]}  # fmt: skip
        at += a.nbytes
    raw = json.dumps(head).encode()
    raw += b" " * (-len(raw) % 8)  # the arrays start 8-aligned
    if len(raw) > HEADER_MAX:
        raise StateFileError(f"the state header takes {len(raw)} bytes (limit {HEADER_MAX})")
    return struct.pack("<Q", len(raw)) + raw


def _write_atomic(out: Path, header: bytes, arrays: list[np.ndarray]) -> int:
    """Temp file in the folder, fsync, rename: the path holds the old file or the whole new one."""
    try:
        if out.exists() and not stat.S_ISREG(os.stat(out).st_mode):
            raise OutputPathError("the state path is not a regular file", path=str(out))
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.tmp-", dir=out.parent)
    except OSError as exc:
        raise _os_error(exc, out) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            for a in arrays:
                f.write(_bytes(a))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
        tmp = None
    except OSError as exc:
        raise _os_error(exc, out) from None
    finally:
        if tmp is not None:  # any failure or interrupt before the rename
            Path(tmp).unlink(missing_ok=True)
    return len(header) + sum(a.nbytes for a in arrays)


def _bytes(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a)).cast("B")


def _os_error(exc: OSError, out: Path) -> PolyError:
    if exc.errno in (28, 27, 122):  # ENOSPC, EFBIG, EDQUOT
        return InsufficientSpaceError(f"not enough space for the state: {exc.strerror}", path=out)
    return OutputPathError(f"cannot write the state: {exc.strerror or exc}", path=str(out))

"""Reading a saved KV state (poly/model/state.py writes it): every size the header declares is
checked against the file and the model before anything is read, and only the model's own caches
are allocated; the model's caches are replaced once the whole file has checked out."""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from poly.config import LIMITS
from poly.errors import ModelNotFoundError, PolyError, StateFileError, StateMismatchError
from poly.model.state import FORMAT, HEADER_MAX, ST_NAMES, VERSION, SavedState, check_identity
from poly.nn.kvcache import cache_for, kv_dtype, window_rows


def load(model, path) -> SavedState:
    """Restore the KV state in `path` into `model` (its caches replace the model's only once the
    whole file has been read and checked; on any error the model is as it was)."""
    caches, saved = read(model, path)
    for i, c in enumerate(caches):
        model.attn(i).state = c
    return saved


def read(model, path) -> tuple[list, SavedState]:
    """The caches (one per layer, sized as `model`'s own) and what else `path` holds, checked
    as `load` does, without touching the model's live caches (a server's sequences)."""
    path = Path(path)
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below; the errors differ per step)
    except FileNotFoundError:
        raise ModelNotFoundError("no such state file", path=str(path)) from None
    except OSError as exc:
        raise StateFileError(
            f"cannot read the state file: {exc.strerror}", path=str(path)
        ) from None
    try:
        with f:
            size = os.fstat(f.fileno()).st_size
            head, base = _read_header(f, size)
            state = _parse_state(head)
            check_identity(model, state.get("model"))
            position, layers = _check_layers(model, state)
            entries = _entries(model, head, layers, position, size - base)
            caches, tokens = _read_arrays(model, f, base, entries, layers, state)
    except PolyError as err:
        if err.path is None:
            err.path = str(path)
        raise
    meta = state.get("meta")
    return caches, SavedState(position, tokens, meta if isinstance(meta, dict) else {})


def _read_header(f, size: int) -> tuple[dict, int]:
    raw = f.read(8)
    if len(raw) < 8:
        raise StateFileError("not a state file (truncated before its header)")
    (n,) = struct.unpack("<Q", raw)
    if n > HEADER_MAX or 8 + n > size:
        raise StateFileError(f"not a state file or truncated (header of {n} bytes, file {size})")
    try:
        head = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError):
        raise StateFileError("not a state file (its header is not JSON)") from None
    if not isinstance(head, dict):
        raise StateFileError("not a state file (its header is not a JSON object)")
    return head, 8 + n


def _parse_state(head: dict) -> dict:
    meta = head.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise StateFileError("not a poly KV state file (no poly-kv-state metadata)")
    if meta.get("version") != VERSION:
        raise StateFileError(f"state file version {meta.get('version')!r} (this poly reads 1)")
    try:
        state = json.loads(meta.get("state"))
    except (TypeError, ValueError):
        raise StateFileError("the state file's metadata is damaged") from None
    if not isinstance(state, dict):
        raise StateFileError("the state file's metadata is damaged")
    return state


def _int(x, lo: int, hi: int, what: str) -> int:
    if type(x) is not int or not lo <= x <= hi:
        raise StateFileError(f"the state file's {what} {x!r} is out of range [{lo}, {hi}]")
    return x


def _check_layers(model, state: dict) -> tuple[int, list]:
    """The position and each layer's (length, start, rope_len) or None, checked against the
    model's caches (rows within what the layer's own cache holds)."""
    cfg = model.config
    position = _int(state.get("position"), 0, LIMITS["max_seq_len"], "position")
    layers = state.get("layers")
    if not isinstance(layers, list) or len(layers) != cfg.num_layers:
        raise StateFileError("the state file's layer list does not match its model")
    out = []
    for i, rec in enumerate(layers):
        attn = model.attn(i)
        if rec is None:
            if position and not model.block(i).is_disabled:
                raise StateFileError(f"the state file has no cache for layer {i}")
            out.append(None)
            continue
        if position > attn.max_seq_len:
            raise StateMismatchError(
                f"the state holds {position} positions, the model's context is "
                f"{attn.max_seq_len} (load it with a longer context)"
            )
        if not isinstance(rec, dict):
            raise StateFileError(f"the state file's layer {i} record is damaged")
        length = _int(rec.get("length"), position, position, f"layer {i} length")
        win = int(attn.sliding_window)
        start = _int(rec.get("start"), 0, length if win else 0, f"layer {i} start")
        if length - start > window_rows(attn.max_seq_len, win):
            raise StateMismatchError(f"layer {i} holds more rows than this model's cache")
        rope = _int(rec.get("rope_len"), 0, LIMITS["max_seq_len"], f"layer {i} rope_len")
        out.append((length, start, rope))
    return position, out


def _entries(model, head: dict, layers: list, position: int, data: int) -> dict:
    """name -> (offset, nbytes, shape, dtype) of every array, each as the model expects it,
    together covering the data exactly (no gap, overlap or tail)."""
    store = kv_dtype(model.attn(0), model.activation_dtype)
    want = {}
    for i, rec in enumerate(layers):
        if rec is not None:
            shape = (rec[0] - rec[1], model.attn(i).num_kv_heads, model.attn(i).head_dim)
            want[f"k.{i}"] = want[f"v.{i}"] = (shape, store)
            if store == np.int8:  # q8_0: a float16 scale per 32 values
                scales = (*shape[:2], shape[2] // 32), np.dtype(np.float16)
                want[f"ks.{i}"] = want[f"vs.{i}"] = scales
    if "tokens" in head:
        want["tokens"] = ((position,), np.dtype(np.int32))
    names = set(head) - {"__metadata__"}
    if names != set(want):
        raise StateFileError(f"the state file's arrays {sorted(names ^ set(want))} do not fit")
    out, spans = {}, []
    for name, (shape, dt) in want.items():
        e = head[name]
        got = (e.get("dtype"), e.get("shape"), e.get("data_offsets")) if isinstance(e, dict) else 0
        nbytes = int(np.prod(shape)) * dt.itemsize
        if got[:2] != (ST_NAMES[dt.name], list(shape)) or not isinstance(got[2], list):
            raise StateFileError(f"the state file's array {name} has another shape or dtype")
        a, b = (_int(x, 0, data, f"{name} offset") for x in (got[2] + [None, None])[:2])
        if b - a != nbytes:
            raise StateFileError(f"the state file's array {name} has a wrong size")
        out[name] = (a, nbytes, shape, dt)
        spans.append((a, b))
    at = 0
    for a, b in sorted(spans):
        if a != at:
            raise StateFileError("the state file's arrays overlap or leave gaps")
        at = b
    if at != data:
        raise StateFileError(f"the state file is truncated or has {data - at} extra bytes")
    return out


def _read_arrays(model, f, base: int, entries: dict, layers: list, state: dict):
    crcs = state.get("crc32") if isinstance(state.get("crc32"), dict) else {}
    caches = []
    for i, rec in enumerate(layers):
        if rec is None:
            caches.append(None)
            continue
        c = cache_for(model.attn(i), None, model.activation_dtype)  # the model's own size
        rows = rec[0] - rec[1]
        for name in (f"{a}.{i}" for a in c.arrays()):
            out = getattr(c, name.split(".")[0])[:rows]
            _read_into(f, base, entries[name], out, crcs.get(name), name)
        c.length, c.start, c.rope_len = rec
        caches.append(c)
    tokens = None
    if "tokens" in entries:
        ids = np.empty(entries["tokens"][2], np.int32)
        _read_into(f, base, entries["tokens"], ids, crcs.get("tokens"), "tokens")
        if ids.size and (ids.min() < 0 or ids.max() >= model.config.vocab_size):
            raise StateFileError("the state file's tokens are outside the vocabulary")
        tokens = ids.tolist()
    return caches, tokens


def _read_into(f, base: int, entry, out: np.ndarray, crc, name: str) -> None:
    if not out.flags.c_contiguous:  # a q8_0 cache's codes/scales: views into its rows
        tmp = np.empty_like(out, order="C")
        _read_into(f, base, entry, tmp, crc, name)
        out[...] = tmp
        return
    f.seek(base + entry[0])
    view = memoryview(out).cast("B")
    if f.readinto(view) != entry[1]:
        raise StateFileError(f"the state file is truncated (array {name})")
    if zlib.crc32(view) != crc:  # a missing checksum fails too
        raise StateFileError(f"the state file is damaged (array {name} fails its checksum)")

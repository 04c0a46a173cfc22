"""A validating safetensors reader of our own (header rules S1-S12 of reliability.md A1).

Tensors come back as read-only numpy views in their stored dtype (BF16 as
``ml_dtypes.bfloat16``); :meth:`SafetensorsFile.tensor_f32` widens one on request. Every dtype
name the reference accepts is validated structurally (sizes, offsets); F64/F32/F16/BF16,
F8_E4M3/F8_E5M2 and the integer/bool kinds can be read; the sub-byte and exotic kinds (F4,
F6_*, F8_E8M0, *FNUZ, C64) raise ``UnsupportedError`` when read.
Sharded checkpoints (``model.safetensors.index.json``) are opened by :func:`open_checkpoint`:
shard names must stay inside the model directory and every tensor must live in exactly one
shard. Pickle checkpoints are never opened (``UnsafeFormatError``).
Every violation raises ``SafetensorsFormatError`` (or ``LimitExceededError`` /
``IntegrityError``) whose ``reason`` attribute is a short stable word ("hole", "overlap" ...).
Tensors are views on the file's bytes in memory of our own (`poly.filesnapshot.FileSnapshot`):
another process rewriting the file cannot crash a running model."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from poly.errors import (
    CheckpointError,
    IntegrityError,
    LimitExceededError,
    ModelFileChangedError,
    PolyError,
    SafetensorsFormatError,
    UnsafeFormatError,
    UnsupportedError,
)
from poly.filesnapshot import FileSnapshot

MAX_HEADER_BYTES = 100_000_000  # the reference cap (S2)
# JSON values of a header ('[', '{', ',' counted on the bytes): ~9 per tensor entry, so ~450k
# tensors; 100 MB of `[],` in __metadata__ was 2.5 GB and 26 s of Python lists.
MAX_HEADER_ITEMS = 1 << 22
MAX_NAME_BYTES = 65536
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.ckpt")

# Bits per element of every dtype name the reference accepts (S5).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
    "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64,
    "U64": 64,
}  # fmt: skip


class _Dtypes(dict):
    """The ml_dtypes kinds (BF16, F8_*) resolved on first use: importing ml_dtypes costs every
    process ~0.2-0.8 s (3 s on a loaded machine), and float32 snapshots never need it."""

    LATE = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}

    def __missing__(self, key: str) -> np.dtype:
        if key not in self.LATE:
            raise KeyError(key)
        import ml_dtypes

        value = self[key] = np.dtype(getattr(ml_dtypes, self.LATE[key]))
        return value

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default


# The dtypes we can view as numpy arrays (little-endian, as the format stores them).
NUMPY_DTYPES: dict[str, np.dtype] = _Dtypes({
    "BOOL": np.dtype(np.bool_), "U8": np.dtype("u1"), "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"), "U16": np.dtype("<u2"), "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"), "I64": np.dtype("<i8"), "U64": np.dtype("<u8"),
    "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
})  # fmt: skip
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def _fail(reason: str, message: str, *, path: Any = None, offset: int | None = None,
          cls: type[PolyError] = SafetensorsFormatError) -> PolyError:  # fmt: skip
    exc = cls(f"{reason}: {message}", path=None if path is None else str(path), offset=offset)
    exc.reason = reason
    return exc


@dataclass(frozen=True)
class TensorInfo:
    """One header entry; ``begin``/``end`` are offsets into the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _fail("duplicate_key", f"{key!r} appears twice in the header")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise _fail("header_json", f"non-standard constant {name}")


def _is_uint(x: Any) -> bool:
    return type(x) is int and 0 <= x < (1 << 63)


def _parse_entry(name: str, entry: Any) -> TensorInfo:
    if not name or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise _fail("name", f"tensor name {ascii(name[:80])} is empty or too long")
    if not isinstance(entry, dict) or set(entry) - {"dtype", "shape", "data_offsets"}:
        # Stricter than the reference: unknown fields are refused (reliability B2 #29).
        raise _fail(
            "unknown_field",
            f"tensor {ascii(name)} entry must hold exactly dtype, shape, data_offsets",
        )
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise _fail("dtype", f"tensor {ascii(name)} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise _fail("shape", f"tensor {ascii(name)} has a bad shape {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_uint(o) for o in offsets):
        raise _fail("offsets", f"tensor {ascii(name)} data_offsets must be 2 non-negative ints")
    begin, end = offsets
    if end < begin:
        raise _fail("offsets", f"tensor {ascii(name)} ends before it begins ({begin}, {end})")
    nbits = DTYPE_BITS[dtype]
    for dim in shape:
        nbits *= dim
    if nbits >= (1 << 66):  # Python ints do not overflow; bound it like the reference (S7)
        raise _fail("overflow", f"tensor {ascii(name)} shape {shape} is too large")
    if nbits % 8:
        raise _fail("misaligned", f"tensor {ascii(name)} has a fractional byte size")
    if nbits // 8 != end - begin:
        raise _fail(
            "size_mismatch",
            f"tensor {ascii(name)}: {dtype}{shape} needs {nbits // 8} bytes, offsets give {end - begin}",
        )
    return TensorInfo(name, dtype, tuple(shape), begin, end)


def parse_header(raw: bytes, path: Any = None) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Validate header bytes (without the 8-byte prefix); returns (tensors, metadata)."""
    items = raw.count(b"[") + raw.count(b"{") + raw.count(b",")  # an upper bound, before parsing
    if items > MAX_HEADER_ITEMS:
        raise _fail("header_too_large", f"header holds up to {items} values (limit "
                    f"{MAX_HEADER_ITEMS})", path=path, cls=LimitExceededError)  # fmt: skip
    try:
        text = raw.decode("utf-8")
        if text.startswith("\ufeff"):
            raise _fail("header_json", "header starts with a byte-order mark")
        header = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except SafetensorsFormatError as exc:
        exc.path = exc.path or (None if path is None else str(path))
        raise
    except UnicodeDecodeError:
        raise _fail("header_utf8", "header is not valid UTF-8", path=path) from None
    except (ValueError, RecursionError) as exc:
        raise _fail("header_json", f"header is not valid JSON ({exc})", path=path) from None
    if not isinstance(header, dict):
        raise _fail("header_json", "header is not a JSON object", path=path)
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _fail("metadata", "__metadata__ must map strings to strings", path=path)
    try:
        infos = {name: _parse_entry(name, entry) for name, entry in header.items()}
    except SafetensorsFormatError as exc:
        exc.path = None if path is None else str(path)
        raise
    _check_coverage(list(infos.values()), path)
    return infos, metadata


def _check_coverage(infos: list[TensorInfo], path: Any) -> None:
    # Back to back from 0 in offset order: rejects holes, overlaps and aliases (S6).
    cursor = 0
    for info in sorted(infos, key=lambda i: (i.begin, i.end)):
        if info.begin < cursor:
            raise _fail(
                "overlap", f"tensor {ascii(info.name)} overlaps the previous one", path=path
            )
        if info.begin > cursor:
            raise _fail(
                "hole", f"gap of {info.begin - cursor} bytes before {ascii(info.name)}", path=path
            )
        cursor = info.end


class SafetensorsFile:
    """One validated ``.safetensors`` file; tensors are read-only views."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = _regular_file_size(self.path)
        with open(self.path, "rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise _fail("header_too_small", f"file has {size} bytes", path=self.path)
            n = int.from_bytes(prefix, "little")
            if n > MAX_HEADER_BYTES:
                raise _fail("header_too_large", f"header length {n} > {MAX_HEADER_BYTES}",
                            path=self.path, cls=LimitExceededError)  # fmt: skip
            if 8 + n > size:
                raise _fail("header_length", f"header length {n} exceeds the file", path=self.path)
            raw = fh.read(n)
        self.infos, self.metadata = parse_header(raw, self.path)
        self.data_start = 8 + n
        data_len = max((i.end for i in self.infos.values()), default=0)
        if self.data_start + data_len > size:
            raise _fail("truncated", f"data needs {data_len} bytes, file has {size - self.data_start}",
                        path=self.path, cls=IntegrityError)  # fmt: skip
        if self.data_start + data_len < size:
            raise _fail("trailing_bytes", f"{size - self.data_start - data_len} bytes after the last tensor",
                        path=self.path)  # fmt: skip
        self._map: np.ndarray | None = None
        self._size = size
        self._lazy: tuple[tuple[int, int], ...] = ()
        self.snapshot: FileSnapshot | None = None

    def offset(self, name: str) -> int:
        """Where tensor `name`'s bytes start in the file."""
        return self.data_start + self.infos[name].begin

    def lazy(self, names) -> None:
        """Tensors `names` stay mapped from the file (paged MoE experts); the next read maps
        the file again with them left out of the bytes read in."""
        self._lazy = tuple((self.offset(n), self.infos[n].nbytes) for n in names)
        self._map = self.snapshot = None

    def names(self) -> list[str]:
        return list(self.infos)

    def _mapped(self) -> np.ndarray:
        if self._map is None:  # our own copy: a file rewritten under a mapping raises SIGBUS
            try:
                snap = FileSnapshot(self.path, lazy=self._lazy)
            except OSError as exc:
                raise CheckpointError(f"cannot read {self.path}: {exc.strerror}",
                                      path=str(self.path)) from None  # fmt: skip
            if snap.size != self._size:
                raise ModelFileChangedError("the file changed since its header was read",
                                            path=str(self.path))  # fmt: skip
            self._map, self.snapshot = snap.array(), snap
        return self._map

    def tensor(self, name: str) -> np.ndarray:
        """The stored tensor as a read-only view into the file (no copy)."""
        info = self.infos.get(name)
        if info is None:
            raise CheckpointError(f"tensor {name!r} is not in this file", path=str(self.path))
        dtype = NUMPY_DTYPES.get(info.dtype)
        if dtype is None:
            raise UnsupportedError(f"tensor {name!r} has dtype {info.dtype}, which cannot be read",
                                   path=str(self.path))  # fmt: skip
        start = self.data_start + info.begin
        raw = self._mapped()[start : start + info.nbytes]
        return raw.view(dtype).reshape(info.shape)  # the header shape, e.g. [out, in]

    def tensor_f32(self, name: str) -> np.ndarray:
        """The tensor widened to float32 (a new array); only float dtypes are accepted."""
        info = self.infos.get(name)
        if info is not None and info.dtype not in FLOAT_DTYPES:
            raise UnsupportedError(
                f"tensor {name!r} has non-float dtype {info.dtype}", path=str(self.path)
            )
        return np.asarray(self.tensor(name), dtype=np.float32)


def _regular_file_size(path: Path) -> int:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise CheckpointError(f"cannot open {path}: {exc.strerror}", path=str(path)) from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path} is not a regular file", path=str(path))
    return st.st_size


class Checkpoint:
    """All tensors of a snapshot dir, single file or sharded; names map to their shard."""

    def __init__(self, files: list[SafetensorsFile]):
        self.files = files
        self.where: dict[str, SafetensorsFile] = {}
        for f in files:
            for name in f.infos:
                if name in self.where:
                    raise _fail("duplicate_tensor", f"tensor {ascii(name)} is in {self.where[name].path.name} "
                                f"and {f.path.name}", path=f.path, cls=IntegrityError)  # fmt: skip
                self.where[name] = f

    def names(self) -> list[str]:
        return list(self.where)

    def info(self, name: str) -> TensorInfo:
        return self.where[name].infos[name]

    def tensor(self, name: str) -> np.ndarray:
        return self.where[name].tensor(name)

    def tensor_f32(self, name: str) -> np.ndarray:
        return self.where[name].tensor_f32(name)

    def lazy(self, names) -> None:
        """Tensors `names` stay mapped from their files (`SafetensorsFile.lazy`)."""
        for f in self.files:
            f.lazy([n for n in names if self.where[n] is f])


def _shard_path(root: Path, shard: Any) -> Path:
    if not isinstance(shard, str) or not shard or os.path.isabs(shard) or "\\" in shard:
        raise _fail("path_escape", f"shard name {shard!r} is not a plain relative name", path=root,
                    cls=CheckpointError)  # fmt: skip
    candidate = (root / shard).resolve()
    blobs = _hub_blobs(root)
    inside = candidate.is_relative_to(root.resolve()) or (
        blobs is not None and candidate.is_relative_to(blobs)
    )
    if not inside or ".." in Path(shard).parts:
        raise _fail("path_escape", f"shard {shard!r} resolves outside the model directory",
                    path=root, cls=CheckpointError)  # fmt: skip
    return root / shard


def _hub_blobs(root: Path) -> Path | None:
    """The `blobs/` dir of the HF cache repo ``root`` is a snapshot of
    (`models--org--name/snapshots/<rev>`), whose files are symlinks to `../../blobs/<hash>`:
    the normal place for a shard to resolve to. None outside a cache."""
    snap = root.resolve()
    repo = snap.parent.parent
    if snap.parent.name == "snapshots" and repo.name.startswith("models--"):
        return repo / "blobs"
    return None


def _open_index(root: Path) -> Checkpoint:
    index_path = root / INDEX_FILE
    try:
        if index_path.stat().st_size > MAX_HEADER_BYTES:
            raise _fail("index", "index file too large", path=index_path, cls=LimitExceededError)
        index = json.loads(index_path.read_bytes().decode("utf-8"), object_pairs_hook=_no_duplicates,
                           parse_constant=_reject_constant)  # fmt: skip
    except (OSError, ValueError, RecursionError) as exc:
        raise _fail("index", f"cannot parse {INDEX_FILE}: {exc}", path=index_path) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise _fail("index", "weight_map must be a non-empty object", path=index_path)
    shards = {shard: _shard_path(root, shard) for shard in dict.fromkeys(weight_map.values())}
    for shard, p in shards.items():
        if not p.is_file():
            raise _fail("shard_missing", f"shard {shard!r} listed in the index is missing",
                        path=p, cls=IntegrityError)  # fmt: skip
    ckpt = Checkpoint([SafetensorsFile(p) for p in shards.values()])
    for name, shard in weight_map.items():
        if ckpt.where.get(name) is None or ckpt.where[name].path != shards[shard]:
            raise _fail("index_mismatch", f"tensor {ascii(name)} is not in shard {shard!r}",
                        path=index_path, cls=IntegrityError)  # fmt: skip
    extra = set(ckpt.where) - set(weight_map)
    if extra:
        raise _fail("index_mismatch", f"tensors in shards but not in the index: {sorted(extra)[:5]}",
                    path=index_path, cls=IntegrityError)  # fmt: skip
    return ckpt


def open_checkpoint(model_dir: str | Path) -> Checkpoint:
    """Open the safetensors weights of a snapshot dir (index, model.safetensors or *.safetensors)."""
    root = Path(model_dir)
    if (root / INDEX_FILE).is_file():
        return _open_index(root)
    single = root / SINGLE_FILE
    files = [single] if single.is_file() else sorted(root.glob("*.safetensors"))
    if files:
        return Checkpoint([SafetensorsFile(p) for p in files])
    pickles = [name for name in PICKLE_FILES if (root / name).exists()]
    if pickles:
        raise UnsafeFormatError(
            f"only pickle-based weights ({', '.join(pickles)}) found; they are never loaded. "
            "Convert them to safetensors in an isolated environment with a trusted tool first",
            path=str(root),
        )
    raise CheckpointError(f"no .safetensors weights in {root}", path=str(root))

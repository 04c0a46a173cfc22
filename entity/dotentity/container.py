"""The `.entity` v2 container: a checksummed msgpack header followed by 64-byte aligned blobs.

Layout (little-endian; full description in docs/formats.md):

    0   8   magic b"ENTITY\\0\\0"
    8   2   u16 format version (2)
    10  2   u16 flags (0)
    12  8   u64 header length N
    20  N   msgpack map; its last entry is "header_crc32": uint32 (always 0xce + 4 bytes),
            the crc32 of file bytes [0, 20+N-4)
    ...     blobs, the first at align64(20+N), each next at align64(previous end), zero padding
            between them, the file ends exactly at the end of the last blob.

Every blob record carries the crc32 of its bytes. The container knows nothing about transformers:
`write` and `blobs` decide which blobs and header keys a model needs; `read` loads a model.

This module opens, verifies and maps files (`EntityFile`) and writes them (`EntityWriter`); the
prefix, the header schema and their checks are in `header` (MAGIC, PREFIX, read_prefix, ... are
also importable from here, the container's API).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

# ISA-L's crc32: zlib's checksum, several times faster (round 2, session 35)
from isal.isal_zlib import crc32

from entity.atomic import (
    atomic_output,
    check_output,
    open_locked_temp,
    sweep_stale_temps,
    temp_name,
    wrap_os_error,
)
from entity.dotentity.header import (
    ALIGN,
    BLOB_DTYPES,
    CRC_TAIL,
    FORMAT_VERSION,
    MAGIC,
    META_KEYS,
    PREFIX,
    BlobRecord,
    Header,
    align,
    check_layout,
    crc_of_range,
    decode_header,
    fail,
    peek_fields,
    read_prefix,
)
from entity.dotentity.native_blocks import check_record
from poly.errors import (
    EntityFormatError,
    IntegrityError,
    LimitExceededError,
    ModelFileChangedError,
    UnsupportedError,
)
from poly.filesnapshot import FileSnapshot
from poly.runtime import layout_cache

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "ALIGN",
    "BLOB_DTYPES",
    "BlobRecord",
    "EntityFile",
    "EntityWriter",
    "EntityVersionError",
    "read_prefix",
]

_EXPERT = re.compile(r"blocks\.\d+\.mlp\.experts\.\d+(\..*)?")
MAX_HEADER_LEN = 64 << 20  # tokenizer.json of a 150k vocab is ~10 MB
_CHUNK = 16 << 20


class EntityVersionError(EntityFormatError, UnsupportedError):
    """A `.entity` whose version this reader does not know."""

    code = "entity_version"
    exit_code = 5


# --- reading ----------------------------------------------------------------------------------


class EntityFile:
    """A validated `.entity` v2 file, read into memory of our own (`poly.filesnapshot.FileSnapshot`).

    ``verify``: True checks every blob checksum at open (on the bytes read); "once" does too, but
    not again for a file `poly.runtime.layout_cache` saw verified (the same path, inode, size,
    mtime and first 64 KB); "lazy" checks a blob the first time `array` returns it; False trusts
    the blobs (the header checksum, layout and padding are always checked). ``lazy_experts``:
    MoE expert blobs stay mapped from the file (paged in and out by `poly.runtime.expert_cache`).
    """

    def __init__(
        self, path: str | os.PathLike, *, verify: bool | str = True, lazy_experts: bool = False
    ):
        if verify not in (True, False, "lazy", "once"):
            raise ValueError("verify must be True, False, 'lazy' or 'once'")
        self.path = str(path)
        self._verify = verify
        self._checked: set[str] = set()
        try:
            f = open(self.path, "rb")
        except OSError as exc:
            raise fail(f"cannot open: {exc.strerror}", self.path) from exc
        with f:
            self.size = os.fstat(f.fileno()).st_size
            self.header, self.flags = self._read_header(f)
            self.blobs = {b.path: b for b in self.header.blobs}
            self._check_padding(f)
            lazy = [r for r in self.header.blobs if lazy_experts and _EXPERT.match(r.path)]
            self._mm = self._snapshot(lazy) if self.size else None
            self._buf = self._mm.array() if self._mm is not None else None
            if self._verify_all(verify):
                for rec in lazy:  # paged experts from the file: they stay out of the RSS
                    self._verify_record(f, rec)
                for rec in self.header.blobs:
                    if rec.path not in self._checked:
                        self._check_in_memory(rec)
                if verify == "once" and self._mm is not None:
                    layout_cache.mark_verified(self._mm)

    def _verify_all(self, verify: bool | str) -> bool:
        if verify == "once":
            return self._mm is None or not layout_cache.verified(self._mm)
        return verify is True

    def _snapshot(self, lazy: list[BlobRecord]) -> FileSnapshot:
        """The file read into memory of our own (``lazy`` records stay mapped from the file): a
        mapping's pages vanish when the file is rewritten or truncated (SIGBUS)."""
        try:
            snap = FileSnapshot(self.path, lazy=tuple((r.offset, r.length) for r in lazy))
        except OSError as exc:
            raise fail(f"cannot read: {exc.strerror}", self.path) from exc
        if snap.size != self.size:
            raise ModelFileChangedError("the file changed as it was opened", path=self.path)
        return snap

    def _check_in_memory(self, rec: BlobRecord) -> None:
        if crc32(self._buf[rec.offset : rec.offset + rec.length]) != rec.checksum:
            raise IntegrityError(f"checksum mismatch in blob {rec.path!r}", path=self.path)
        self._checked.add(rec.path)
        self._mm.evict(rec.offset, rec.length)  # still mapped (a deferred open): out of the RSS

    def _read_header(self, f) -> tuple[Header, int]:
        raw, flags, hlen = read_raw_header(f, self.size, self.path)
        header = decode_header(raw[PREFIX.size :], self.path)
        self.header_len = hlen
        self.data_start = align(PREFIX.size + hlen)
        check_layout(header.blobs, self.data_start, self.size, self.path)
        if not header.blobs:  # the writer pads the header to ALIGN even without blobs
            f.seek(PREFIX.size + hlen)
            if f.read(ALIGN).strip(b"\x00"):
                raise fail("trailing bytes after the header", self.path, PREFIX.size + hlen)
        return header, flags

    def _check_padding(self, f) -> None:
        # Zero padding only: hidden data between blobs is refused.
        pos = PREFIX.size + self.header_len
        for rec in sorted(self.header.blobs, key=lambda r: r.offset):
            gap = rec.offset - pos
            if gap:
                f.seek(pos)
                if f.read(gap).strip(b"\x00"):
                    raise fail("non-zero padding before blob", self.path, pos)
            pos = rec.offset + rec.length

    def _verify_record(self, f, rec: BlobRecord) -> None:
        if crc_of_range(f, rec.offset, rec.length) != rec.checksum:
            raise IntegrityError(f"checksum mismatch in blob {rec.path!r}", path=self.path)
        self._checked.add(rec.path)

    @property
    def mapping(self) -> FileSnapshot | None:
        """The file's bytes the blob arrays are views on (madvise target; see `FileSnapshot`)."""
        return self._mm

    def __contains__(self, name: str) -> bool:
        return name in self.blobs

    def meta(self, key: str) -> Any:
        return self.header.value(key, self.path)

    def array(self, name: str) -> np.ndarray:
        """Zero-copy read-only view of blob ``name`` with its dtype and shape."""
        rec = self.blobs.get(name)
        if rec is None:
            raise fail(f"blob {name!r} missing", self.path)
        if self._verify == "lazy" and name not in self._checked:
            self._check_in_memory(rec)
        dt = BLOB_DTYPES[rec.dtype]
        if rec.length == 0:
            return np.zeros(rec.shape, dtype=dt)
        return self._buf[rec.offset : rec.offset + rec.length].view(dt).reshape(rec.shape)

    def verify(self) -> None:
        """Check every blob checksum now (IntegrityError on the first mismatch)."""
        with open(self.path, "rb") as f:
            for rec in self.header.blobs:
                self._verify_record(f, rec)


# --- writing ----------------------------------------------------------------------------------


def _blob_bytes(arr: np.ndarray) -> tuple[str, memoryview]:
    arr = np.asarray(arr)
    dt = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
    name = dt.name if dt.name in ("bfloat16", *BLOB_DTYPES) else None  # numpy's names are ours
    if name is None or BLOB_DTYPES[name] != dt:
        raise EntityFormatError(f"cannot store dtype {arr.dtype} in a blob")
    le = np.ascontiguousarray(arr, dtype=BLOB_DTYPES[name]).reshape(-1)  # [n]
    return name, memoryview(le.view(np.uint8))


class EntityWriter:
    """Streams blobs to a scratch payload file, then writes prefix + header + payload atomically.

    Peak memory is one blob (the caller's array) plus the header; disk use is twice the file
    while `finish` copies the payload into the output temp file.
    """

    def __init__(self, path: str | os.PathLike, *, force: bool = False, inputs=()):
        self.path = Path(os.path.abspath(os.fspath(path)))
        self.force = force
        self.inputs = list(inputs)
        check_output(self.path, force=force, inputs=self.inputs)  # fail before any slow work
        # Temp files of killed writers go first, or a retry on a nearly full disk cannot fit.
        sweep_stale_temps(self.path.parent)
        self._payload_path = temp_name(self.path.with_name(self.path.name + ".payload"))
        try:
            self._payload = os.fdopen(open_locked_temp(self._payload_path), "w+b")
        except OSError as exc:
            raise wrap_os_error(exc, self.path) from exc
        self._records: list[dict[str, Any]] = []
        self._names: set[str] = set()
        self._pos = 0

    def add(self, name: str, arr: np.ndarray, *, ggml_type: int | None = None) -> None:
        """Append one blob (any dtype of `BLOB_DTYPES`; shape kept). ``ggml_type``: the blob is
        GGUF block rows, uint8 [out, row_bytes], of that kind (`entity.dotentity.native_blocks`)."""
        if name in self._names:
            raise EntityFormatError(f"duplicate blob path {name!r}")
        dtype, mv = _blob_bytes(arr)
        if ggml_type is not None:
            check_record(ggml_type, dtype, list(np.shape(arr)))  # never write what we cannot read
        pad = align(self._pos) - self._pos
        try:
            self._payload.write(b"\x00" * pad)
            self._payload.write(mv)
        except OSError as exc:
            self.close()
            raise wrap_os_error(exc, self.path) from exc
        self._pos += pad
        rec = {"path": name, "offset": self._pos, "length": mv.nbytes, "dtype": dtype}
        rec.update(shape=[int(d) for d in np.shape(arr)], checksum=crc32(mv))
        if ggml_type is not None:
            rec["ggml_type"] = int(ggml_type)
        self._records.append(rec)
        self._names.add(name)
        self._pos += mv.nbytes

    def _pack_header(self, meta: dict[str, Any], data_start: int) -> bytes:
        blobs = [dict(r, offset=r["offset"] + data_start) for r in self._records]
        fields = {"format_version": FORMAT_VERSION, **meta, "blobs": blobs}
        packer = msgpack.Packer(use_bin_type=True)
        body = packer.pack_map_header(len(fields) + 1)
        body += b"".join(packer.pack(k) + packer.pack(v) for k, v in fields.items())
        body += CRC_TAIL
        prefix = PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(body) + 4)
        crc = crc32(prefix + body)
        return prefix + body + crc.to_bytes(4, "big")

    def _header_for(self, meta: dict[str, Any]) -> bytes:
        # Offsets live in the header, whose size depends on them: iterate to the fixed point
        # (data_start only grows, so this converges in a few steps).
        data_start = align(len(self._pack_header(meta, 0)))
        while True:
            head = self._pack_header(meta, data_start)
            nxt = align(len(head))
            if nxt == data_start:
                return head
            data_start = nxt

    def finish(self, meta: dict[str, Any]) -> Path:
        """Write the file. ``meta`` holds every header key but format_version/blobs/checksum."""
        missing = set(META_KEYS) - set(meta)
        extra = set(meta) - set(META_KEYS)
        if missing or extra:
            raise EntityFormatError(
                f"header keys: missing {sorted(missing)}, unknown {sorted(extra)}"
            )
        try:
            head = self._header_for(meta)
            decode_header(head[PREFIX.size :], str(self.path), defer=False)  # all readable
            self._payload.flush()
            size = align(len(head)) + self._pos
            with atomic_output(
                self.path, force=self.force, inputs=self.inputs, expected_size=size
            ) as out:
                out.write(head)
                out.write(b"\x00" * (align(len(head)) - len(head)))
                _copy_all(self._payload, out, self._pos)
        finally:
            self.close()
        return self.path

    def close(self) -> None:
        """Drop the scratch payload (idempotent; called by `finish` and on errors). Unlinked
        before it is closed, so it is never unlocked while it exists."""
        try:
            os.unlink(self._payload_path)
        except OSError:
            pass
        if not self._payload.closed:
            try:
                self._payload.close()  # flushing a full disk fails again: the file goes anyway
            except OSError:
                pass

    def __enter__(self) -> EntityWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _copy_all(src, dst, length: int) -> None:
    src.seek(0)
    dst.flush()
    copied = 0
    try:
        while copied < length:
            n = os.copy_file_range(src.fileno(), dst.fileno(), length - copied)
            if n == 0:
                break
            copied += n
    except (AttributeError, OSError) as exc:
        if getattr(exc, "errno", None) in (28, 27):  # ENOSPC, EFBIG: a real write failure
            raise
        src.seek(copied)
        dst.seek(0, os.SEEK_END)
        while copied < length:
            chunk = src.read(min(_CHUNK, length - copied))
            if not chunk:
                break
            dst.write(chunk)
            copied += len(chunk)
    if copied != length:
        raise EntityFormatError(f"payload copy stopped at {copied} of {length} bytes")
    dst.seek(0, os.SEEK_END)


def read_raw_header(f, size: int, path: str | None) -> tuple[bytes, int, int]:
    """Prefix + header bytes of a v2 file, length-capped and CRC-checked: (raw, flags, hlen)."""
    version, flags, hlen = read_prefix(f, path)
    if version != FORMAT_VERSION:
        raise EntityVersionError(
            f"unsupported .entity version {version} (this reader: 1 via entity.dotentity.v1, 2)",
            path=path,
            offset=8,
        )
    if hlen > size - PREFIX.size:
        raise fail(f"header length {hlen} exceeds the file", path, 12)
    if hlen > MAX_HEADER_LEN:
        raise LimitExceededError(f"header length {hlen} > {MAX_HEADER_LEN}", path=path)
    f.seek(0)
    raw = f.read(PREFIX.size + hlen)
    if hlen < len(CRC_TAIL) + 4 or raw[-len(CRC_TAIL) - 4 : -4] != CRC_TAIL:
        raise IntegrityError("header checksum entry missing or damaged", path=path)
    want = int.from_bytes(raw[-4:], "big")  # msgpack uint32 is big-endian
    if crc32(raw[:-4]) != want:
        raise IntegrityError("header checksum mismatch (file damaged)", path=path)
    return raw, flags, hlen


def peek_header(path: str | os.PathLike, keys: tuple[str, ...]) -> dict[str, Any]:
    """Only the top-level header fields ``keys`` of a v2 file (for listings): the header is
    length-capped and CRC-checked, the other fields are skipped without being built (a huge
    blob table or tokenizer costs no memory). Raises the typed errors of `EntityFile`."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        raw, _, _ = read_raw_header(f, os.fstat(f.fileno()).st_size, path)
    return peek_fields(raw[PREFIX.size :], keys, path)

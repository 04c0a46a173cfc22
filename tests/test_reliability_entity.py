"""Reliability catalogue B6 (.entity v2 and Loom v1): damaged containers -> typed errors.

Header edits are re-packed with a correct header checksum so that the msgpack, schema and layout
checks themselves are exercised (a checksum alone would hide them).
"""

from __future__ import annotations

import struct
import zlib

import msgpack
import numpy as np
import pytest

from entity.dotentity.container import ALIGN, CRC_TAIL, MAGIC, PREFIX, EntityFile, align
from entity.dotentity.header import META_KEYS
from entity.dotentity.read import load_entity
from entity.dotentity.write import save_entity
from poly.errors import (
    EntityFormatError,
    IntegrityError,
    LimitExceededError,
    PolyError,
    UnsupportedError,
)
from tests.fuzz.corpus import ENTITY_ARRAYS, entity_valid, expect_error, tiny_model

VALID = entity_valid()


def _header(data: bytes = VALID) -> dict:
    hlen = PREFIX.unpack(data[:20])[3]
    return msgpack.unpackb(data[20 : 20 + hlen], raw=False)


def _payload(data: bytes = VALID) -> tuple[bytes, int]:
    """The data section and its start offset."""
    head = _header(data)
    start = min(b["offset"] for b in head["blobs"])
    return data[start:], start


def seal(body: bytes, version: int = 2, flags: int = 0, hlen: int | None = None) -> bytes:
    """Prefix + ``body`` + the header_crc32 entry, checksum correct."""
    body = body + CRC_TAIL
    n = len(body) + 4 if hlen is None else hlen
    prefix = PREFIX.pack(MAGIC, version, flags, n)
    return prefix + body + zlib.crc32(prefix + body).to_bytes(4, "big")


def pack_pairs(
    pairs: list[tuple], blob_offsets_rel: bool = True, payload: bytes | None = None
) -> bytes:
    """A header from (key, value) pairs (duplicates allowed), then the valid payload, with blob
    offsets moved to wherever the data section starts now."""
    data, old_start = _payload() if payload is None else (payload, None)

    def build(start: int) -> bytes:
        packer = msgpack.Packer(use_bin_type=True)
        body = packer.pack_map_header(len(pairs) + 1)
        for k, v in pairs:
            if k == "blobs" and blob_offsets_rel and isinstance(v, list) and old_start is not None:
                v = [
                    dict(b, offset=b["offset"] - old_start + start) if isinstance(b, dict) else b
                    for b in v
                ]
            body += packer.pack(k) + packer.pack(v)
        return seal(body)

    start = align(len(build(0)))
    while True:
        head = build(start)
        if align(len(head)) == start:
            return head + b"\0" * (start - len(head)) + data
        start = align(len(head))


def pairs(**changes) -> list[tuple]:
    head = _header()
    head.pop("header_crc32")
    for k, v in changes.items():
        if v is ...:
            head.pop(k)
        else:
            head[k] = v
    return list(head.items())


def blobs(**changes) -> list[dict]:
    """The blob records with blob 'a' changed."""
    return [dict(b, **changes) if b["path"] == "a" else b for b in _header()["blobs"]]


def test_repacked_valid_file_opens(tmp_path):
    # the re-packing helper itself produces readable files (so the cases below test one thing)
    p = tmp_path / "x.entity"
    p.write_bytes(pack_pairs(pairs()))
    ef = EntityFile(p)
    np.testing.assert_array_equal(ef.array("a"), ENTITY_ARRAYS["a"])


HLEN_AT = 12
CASES = [
    ("B6-79-magic", b"ENTITX\0\0" + VALID[8:], EntityFormatError),
    ("B6-79-version-3", VALID[:8] + struct.pack("<H", 3) + VALID[10:], UnsupportedError),
    ("B6-79-version-0", VALID[:8] + struct.pack("<H", 0) + VALID[10:], UnsupportedError),
    ("B6-80-hlen-huge", VALID[:12] + struct.pack("<Q", 2**63) + VALID[20:], EntityFormatError),
    ("B6-80-hlen-past-eof", VALID[:12] + struct.pack("<Q", len(VALID)) + VALID[20:], EntityFormatError),
    ("B6-81-array32", seal(b"\xdd\xff\xff\xff\xff"), EntityFormatError),
    ("B6-81-map32", seal(b"\xdf\xff\xff\xff\xff"), EntityFormatError),
    ("B6-81-deep", seal(b"\x91" * 5000 + b"\xc0"), EntityFormatError),
    ("B6-81-0xc1", seal(b"\xc1"), EntityFormatError),
    ("B6-81-trailing", seal(msgpack.packb({"a": 1}) + b"\x01"), EntityFormatError),
    ("B6-81-truncated", seal(msgpack.packb({"a": 1})[:-1]), EntityFormatError),
    ("B6-82-duplicate", pack_pairs(pairs() + [("quant", {"scheme": "f32"})]), EntityFormatError),
    ("B6-83-ext", pack_pairs(pairs(source=msgpack.ExtType(5, b"x"))), EntityFormatError),
    ("B6-83-timestamp", pack_pairs(pairs(source=msgpack.Timestamp(1, 0))), EntityFormatError),
    ("B6-83-int-key", pack_pairs(pairs(source={1: "x"})), EntityFormatError),
    ("B6-84-unknown-key", pack_pairs(pairs() + [("extra", 1)]), EntityFormatError),
    ("B6-84-missing-key", pack_pairs(pairs(network=...)), EntityFormatError),
    ("B6-84-bool-for-int", pack_pairs(pairs(blobs=blobs(length=True))), EntityFormatError),
    ("B6-84-str-for-int", pack_pairs(pairs(blobs=blobs(length="40"))), EntityFormatError),
    ("B6-84-nan", pack_pairs(pairs(source={"x": float("nan")})), EntityFormatError),
    ("B6-84-inf", pack_pairs(pairs(generation_config={"temperature": float("inf")})), EntityFormatError),
    ("B6-87-size", pack_pairs(pairs(blobs=blobs(length=36))), EntityFormatError),
    ("B6-87-shape", pack_pairs(pairs(blobs=blobs(shape=[2, 4]))), EntityFormatError),
    ("B6-87-negative-shape", pack_pairs(pairs(blobs=blobs(shape=[-2, -5]))), EntityFormatError),
    ("B6-89-unaligned", pack_pairs(pairs(blobs=blobs(offset=_header()["blobs"][0]["offset"] + 4))), EntityFormatError),
    ("B6-89-overlap", pack_pairs(pairs(blobs=[dict(b, offset=_header()["blobs"][0]["offset"]) for b in _header()["blobs"]])), EntityFormatError),
    ("B6-89-duplicate-path", pack_pairs(pairs(blobs=[dict(b, path="a") for b in _header()["blobs"]])), EntityFormatError),
    ("B6-89-trailing", VALID + b"\0" * 64, EntityFormatError),
    ("B6-89-truncated", VALID[:-1], EntityFormatError),
    ("B6-89-hidden-padding", VALID[:-64 - 3] + b"\x01" + VALID[-64 - 2:], PolyError),
    ("B6-90-header-bit", VALID[:30] + bytes([VALID[30] ^ 1]) + VALID[31:], IntegrityError),
    ("B6-90-blob-byte", VALID[:-1] + bytes([VALID[-1] ^ 0xFF]), IntegrityError),
    ("B6-90-crc-entry", VALID[:20] + VALID[20:].replace(CRC_TAIL, b"\xa0" * len(CRC_TAIL), 1), IntegrityError),
]  # fmt: skip


@pytest.mark.parametrize("data,cls", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_container_case(tmp_path, data, cls):
    p = tmp_path / "x.entity"
    p.write_bytes(data)
    code = "entity_version" if cls is UnsupportedError else None if cls is PolyError else cls.code
    exc = expect_error(lambda: EntityFile(p), cls, code)
    assert isinstance(exc, (EntityFormatError, IntegrityError, LimitExceededError))
    assert exc.path == str(p)


def test_b6_80_header_cap_before_reading(tmp_path, monkeypatch):
    # a header length over the cap (but inside the file) is refused before it is read
    import entity.dotentity.container as ef_mod

    monkeypatch.setattr(ef_mod, "MAX_HEADER_LEN", 64)
    p = tmp_path / "x.entity"
    p.write_bytes(VALID)
    expect_error(lambda: EntityFile(p), LimitExceededError, "limit_exceeded")


def test_b6_81_nil_bomb_memory_is_bounded(tmp_path):
    # 4 MB of msgpack nils in an array: parsing must fail typed without a big blow-up
    import resource

    body = b"\xdd" + struct.pack(">I", 4_000_000) + b"\xc0" * 4_000_000
    p = tmp_path / "x.entity"
    p.write_bytes(seal(body))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    expect_error(lambda: EntityFile(p), EntityFormatError, "bad_entity", seconds=5)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 400


def test_b6_90_lazy_and_explicit_verify(tmp_path):
    p = tmp_path / "x.entity"
    p.write_bytes(VALID[:-1] + bytes([VALID[-1] ^ 1]))
    ef = EntityFile(p, verify="lazy")  # layout is fine; the damaged blob is found on use
    expect_error(lambda: [ef.array(n) for n in ef.blobs], IntegrityError, "integrity")
    expect_error(EntityFile(p, verify=False).verify, IntegrityError, "integrity")


# --- model level (q4 blobs of a tiny model) --------------------------------------------------


@pytest.fixture(scope="module")
def q4_entity(tmp_path_factory):
    d = tmp_path_factory.mktemp("q4")
    tf = tiny_model(d, hidden=32)
    return save_entity(tf, d / "m.entity", quant="q4"), tf


def _rewrite_blob(src, dst, name: str, fn):
    """Copy ``src`` with blob ``name`` replaced by ``fn(array)`` (record and checksum rebuilt)."""
    from entity.dotentity.container import EntityWriter

    ef = EntityFile(src)
    w = EntityWriter(dst)
    for rec in ef.header.blobs:
        arr = np.array(ef.array(rec.path))
        w.add(rec.path, fn(arr) if rec.path == name else arr)
    meta = {k: ef.meta(k) for k in META_KEYS}
    return w.finish(meta)


def test_q4_model_loads(q4_entity):
    path, tf = q4_entity
    out = load_entity(path)
    assert out.config == tf.config and np.isfinite(out.forward([1, 2, 3])).all()


MODEL_CASES = [
    ("B6-86-scale-count", "blocks.0.attn.w_q.scales", lambda a: a[:-1]),
    ("B6-87-packed-size", "blocks.0.attn.w_q.packed", lambda a: a.reshape(-1)[:-1]),
    ("B6-88-scale-nan", "blocks.0.attn.w_q.scales", lambda a: np.where(np.arange(a.size).reshape(a.shape) == 0, np.nan, a).astype(a.dtype)),
    ("B6-88-scale-inf", "blocks.0.mlp.w_up.scales", lambda a: np.full_like(a, np.inf)),
    ("B6-91-norm-as-int8", "blocks.0.attn_norm.gamma", lambda a: a.astype(np.int8)),
    ("B6-91-embeddings-f64", "embeddings", lambda a: a.astype(np.float64)),
    ("B6-91-embeddings-shape", "embeddings", lambda a: a[:-1]),
    ("B6-91-final-norm-f16", "final_norm", lambda a: a.astype(np.float16)),
]  # fmt: skip


@pytest.mark.parametrize("name,fn", [c[1:] for c in MODEL_CASES], ids=[c[0] for c in MODEL_CASES])
def test_model_case(q4_entity, tmp_path, name, fn):
    src, _ = q4_entity
    blobs = EntityFile(src).blobs
    if name not in blobs:  # the stored form of a table may be split (e.g. embeddings.codes)
        name = min(b for b in blobs if b.startswith(name + "."))
    bad = _rewrite_blob(src, tmp_path / "bad.entity", name, fn)
    expect_error(lambda: load_entity(bad), EntityFormatError)


def test_b6_85_q4_block_size_is_fixed(q4_entity):
    # the block size is not a free parameter of the file: the header records 32 and the reader
    # derives the layout from the shapes; a different block in the header changes nothing.
    src, _ = q4_entity
    assert EntityFile(src).meta("quant")["q4_block"] == 32


# --- Loom v1 ---------------------------------------------------------------------------------


def _v1(header: bytes, blob: bytes = b"") -> bytes:
    return MAGIC + struct.pack("<HHQ", 1, 0, len(header)) + header + blob


V1_CASES = [
    ("B6-80-v1-hlen", MAGIC + struct.pack("<HHQ", 1, 0, 2**40) + b"{}"),
    ("B6-81-v1-json", _v1(b"{not json")),
    ("B6-82-v1-duplicate", _v1(b'{"a": 1, "a": 2}')),
    ("B6-84-v1-nan", _v1(b'{"a": NaN}')),
    ("B6-84-v1-empty", _v1(b"{}")),
]


@pytest.mark.parametrize("data", [c[1] for c in V1_CASES], ids=[c[0] for c in V1_CASES])
def test_v1_case(tmp_path, data):
    from entity.dotentity.v1 import read_entity_v1

    p = tmp_path / "x.entity"
    p.write_bytes(data)
    expect_error(lambda: read_entity_v1(p), EntityFormatError)
    expect_error(lambda: load_entity(p), EntityFormatError)


def test_align_constant():
    assert ALIGN == 64 and align(1) == 64

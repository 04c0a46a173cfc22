"""The .entity v2 container and the atomic output helper: layout, integrity, bad inputs."""

from __future__ import annotations

import random
import struct
import zlib

import ml_dtypes
import msgpack
import numpy as np
import pytest

from entity.dotentity.container import (
    ALIGN,
    MAGIC,
    PREFIX,
    EntityFile,
    EntityVersionError,
    EntityWriter,
)
from poly.errors import (
    EntityFormatError,
    IntegrityError,
)

# The same complete header meta as the fuzz corpus's valid .entity files.
from tests.fuzz.corpus import ENTITY_META as META


def _arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "a.f32": rng.standard_normal((5, 7)).astype(np.float32),
        "b.i8": rng.integers(-128, 128, size=(33,), dtype=np.int8),
        "c.u8": rng.integers(0, 256, size=(4, 16), dtype=np.uint8),
        "d.bf16": rng.standard_normal((3, 3)).astype(ml_dtypes.bfloat16),
        "e.f16": rng.standard_normal((65,)).astype(np.float16),
    }


def _write(path, arrays, meta=META, **kw):
    w = EntityWriter(path, **kw)
    for name, arr in arrays.items():
        w.add(name, arr)
    return w.finish(meta)


@pytest.fixture
def small(tmp_path):
    arrays = _arrays(np.random.default_rng(0))
    path = _write(tmp_path / "m.entity", arrays)
    return path, arrays


def test_roundtrip_layout_and_zero_copy(small):
    path, arrays = small
    data = path.read_bytes()
    magic, version, flags, hlen = PREFIX.unpack(data[:20])
    assert (magic, version, flags) == (MAGIC, 2, 0)
    # Independent parse of the header with plain msgpack.
    header = msgpack.unpackb(data[20 : 20 + hlen], raw=False)
    assert header["format_version"] == 2
    assert zlib.crc32(data[: 20 + hlen - 4]) == header["header_crc32"]
    ef = EntityFile(path)
    end = 0
    for rec in header["blobs"]:
        assert rec["offset"] % ALIGN == 0
        assert rec["checksum"] == zlib.crc32(data[rec["offset"] : rec["offset"] + rec["length"]])
        end = max(end, rec["offset"] + rec["length"])
    assert end == len(data)
    for name, arr in arrays.items():
        got = ef.array(name)
        assert got.dtype == arr.dtype and got.shape == arr.shape
        assert np.array_equal(got.view(np.uint8), arr.view(np.uint8))
        assert not got.flags.writeable and not got.flags.owndata  # a view on the mapping
    for key, value in META.items():
        assert ef.meta(key) == value


def test_deterministic_bytes(tmp_path):
    arrays = _arrays(np.random.default_rng(1))
    a = _write(tmp_path / "a.entity", arrays).read_bytes()
    b = _write(tmp_path / "b.entity", arrays).read_bytes()
    assert a == b


def _expect_typed(path, verify=True):
    try:
        ef = EntityFile(path, verify=verify)
    except (IntegrityError, EntityFormatError):
        return
    pytest.fail(f"damaged file accepted: {ef.header.blobs[:1]}")


def test_every_single_byte_flip_is_detected(small, tmp_path):
    path, _ = small
    data = path.read_bytes()
    bad = tmp_path / "bad.entity"
    rng = random.Random(5)
    for pos in range(len(data)):
        flipped = bytearray(data)
        flipped[pos] ^= rng.randrange(1, 256)
        bad.write_bytes(bytes(flipped))
        _expect_typed(bad)


def test_every_truncation_is_a_format_error(small, tmp_path):
    path, _ = small
    data = path.read_bytes()
    bad = tmp_path / "cut.entity"
    for n in range(len(data)):
        bad.write_bytes(data[:n])
        with pytest.raises(EntityFormatError):
            EntityFile(bad)
    bad.write_bytes(data + b"\0")
    with pytest.raises(EntityFormatError, match="trailing"):
        EntityFile(bad)


def test_lazy_and_off_verification(small, tmp_path):
    path, arrays = small
    data = bytearray(path.read_bytes())
    ef = EntityFile(path)
    rec = ef.blobs["a.f32"]
    data[rec.offset + 3] ^= 0x40
    bad = tmp_path / "lazy.entity"
    bad.write_bytes(bytes(data))
    lazy = EntityFile(bad, verify="lazy")
    assert np.array_equal(lazy.array("b.i8"), arrays["b.i8"])
    with pytest.raises(IntegrityError):
        lazy.array("a.f32")
    EntityFile(bad, verify=False).array("a.f32")  # trusted on request
    with pytest.raises(IntegrityError):
        EntityFile(bad, verify=False).verify()


def _rewrite_header(path, out, edit, packer=None):
    """Re-encode the header after `edit(obj)` with a correct checksum (a well-formed liar);
    `packer` packs the values (`use_bin_type=False`: bytes as msgpack strings, any bytes)."""
    data = path.read_bytes()
    hlen = PREFIX.unpack(data[:20])[3]
    obj = msgpack.unpackb(data[20 : 20 + hlen], raw=False)
    del obj["header_crc32"]
    payload = data[-(len(data) - _data_start(hlen)) :]
    raw = edit(obj)
    if raw is not None:  # an abusive value under key "x", then the checksum entry
        body = msgpack.Packer().pack_map_header(2) + msgpack.packb("x") + raw
    else:
        packer = packer or msgpack.Packer()
        body = packer.pack_map_header(len(obj) + 1)
        body += b"".join(packer.pack(k) + packer.pack(v) for k, v in obj.items())
    body += msgpack.packb("header_crc32") + b"\xce"
    prefix = struct.pack("<8sHHQ", MAGIC, 2, 0, len(body) + 4)
    crc = zlib.crc32(prefix + body)
    head = prefix + body + crc.to_bytes(4, "big")
    start = -(-len(head) // ALIGN) * ALIGN
    out.write_bytes(head + b"\0" * (start - len(head)) + payload)


def _data_start(hlen):
    return -(-(20 + hlen) // ALIGN) * ALIGN


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda h: h.update(extra_key=1), "extra_key"),
        (lambda h: h.update(eos_token_ids=[True]), "eos_token_ids"),
        (lambda h: h.update(generation_config={"t": float("nan")}), "non-finite"),
        (lambda h: h["blobs"][0].update(dtype="q9"), "unknown dtype"),
        (lambda h: h["blobs"][0].update(shape=[999]), "length"),
        (lambda h: h["blobs"][1].update(path=h["blobs"][0]["path"]), "duplicate"),
        (lambda h: h["blobs"].reverse(), None),  # order in the list does not matter
        (lambda h: h["blobs"][0].__delitem__("checksum"), r"blobs\.0\.checksum: missing"),
        (lambda h: h["blobs"][0].update(checksum=1 << 32), r"checksum: must be an integer in"),
        (lambda h: h["blobs"][0].update(ggml_type=None), None),  # nil: no native blocks
        (lambda h: h.update(network=None), "network: must be a map, got None"),  # nil is a value
        (lambda h: h.update(tokenizer=None), None),
        (lambda h: h.update(tokenizer=b"{}"), "tokenizer: must be a string or nil"),  # bin
        # a big wrong value is shown cut short, not whole
        (
            lambda h: h.update(tokenizer={str(i): i for i in range(10**5)}),
            r"got \{'0': 0, .{0,40} \[",
        ),
    ],
)
def test_schema_and_layout_checks(small, tmp_path, edit, match):
    path, _ = small
    out = tmp_path / "liar.entity"
    _rewrite_header(path, out, edit)
    if match is None:
        EntityFile(out)
        return
    with pytest.raises(EntityFormatError, match=match):
        EntityFile(out)


def test_deferred_fields_are_checked_when_read(small, tmp_path):
    """An open keeps the tokenizer text and the network spec as bytes (nothing in an open reads
    the spec; the text is hashed, not decoded); `meta` decodes them with the header's checks."""
    path, _ = small
    ef = EntityFile(path)
    assert type(ef.header.network) is bytes and type(ef.header.tokenizer) is bytes
    assert ef.meta("network") == META["network"] and ef.meta("tokenizer") == META["tokenizer"]
    cases = {
        "nan": (dict(network={"depth": float("nan")}), "network", "non-finite"),
        "ext": (dict(network={"x": msgpack.ExtType(0, b"")}), "network", "ext type"),
        "utf8": (dict(tokenizer=b"\xff{}"), "tokenizer", "utf-8"),
    }
    as_str = msgpack.Packer(use_bin_type=False)  # bytes packed as a msgpack string
    for name, (change, key, match) in cases.items():
        out = tmp_path / f"{name}.entity"
        _rewrite_header(path, out, lambda h, c=change: h.update(c), as_str)
        liar = EntityFile(out)  # the header's checksum and the rest of its schema hold
        with pytest.raises(EntityFormatError, match=match):
            liar.meta(key)
        if key == "network":  # the writer checks all it writes
            with pytest.raises(EntityFormatError, match=match):
                EntityWriter(tmp_path / f"copy-{name}.entity").finish(META | change)


def test_offsets_must_cover_the_data_exactly(small, tmp_path):
    path, _ = small
    out = tmp_path / "gap.entity"
    # Shift a blob's offset by one alignment unit: a hole, then a mismatch with the next blob.
    _rewrite_header(path, out, lambda h: h["blobs"][1].update(offset=h["blobs"][1]["offset"] + 64))
    with pytest.raises(EntityFormatError, match="offset"):
        EntityFile(out)


def test_msgpack_abuse(small, tmp_path):
    path, _ = small
    out = tmp_path / "abuse.entity"
    cases = [
        b"\xdd\xff\xff\xff\xff",  # array32 of 2^32-1 elements
        b"\xc1",  # reserved byte
        b"\x91" * 3000 + b"\xc0",  # deep nesting
        b"\x82\xa1a\x01\xa1a\x02",  # duplicate key
        b"\x81\x01\x02",  # int key
        b"\x81\xa1a\xd4\x05\x00",  # ext type
    ]
    for raw in cases:
        _rewrite_header(path, out, lambda h, raw=raw: raw)
        with pytest.raises(EntityFormatError):
            EntityFile(out)


def test_version_and_magic(small, tmp_path):
    path, _ = small
    data = bytearray(path.read_bytes())
    out = tmp_path / "v.entity"
    out.write_bytes(bytes(data[:8] + struct.pack("<H", 3) + data[10:]))
    with pytest.raises(EntityVersionError):
        EntityFile(out)
    out.write_bytes(b"GGUF" + bytes(data[4:]))
    with pytest.raises(EntityFormatError, match="magic"):
        EntityFile(out)


def test_nonzero_padding_is_refused(small, tmp_path):
    path, _ = small
    ef = EntityFile(path)
    recs = sorted(ef.blobs.values(), key=lambda r: r.offset)
    gap_pos = recs[0].offset + recs[0].length  # 5x7 float32 = 140 bytes, padded to 192
    data = bytearray(path.read_bytes())
    assert recs[1].offset > gap_pos
    data[gap_pos] = 1
    out = tmp_path / "pad.entity"
    out.write_bytes(bytes(data))
    with pytest.raises(EntityFormatError, match="padding"):
        EntityFile(out)


def test_the_checksum_is_zlibs_crc32_over_chunks():
    """The fast crc32 (ISA-L's) is zlib's, chained over chunks as the reader runs it."""
    from entity.dotentity import container

    data = np.random.default_rng(0).integers(0, 256, 3_000_001, dtype=np.uint8).tobytes()
    view, crc = memoryview(data), 0
    for i in range(0, len(data), 1 << 20):
        crc = container.crc32(view[i : i + (1 << 20)], crc)
    assert crc == zlib.crc32(data) and container.crc32(b"") == 0

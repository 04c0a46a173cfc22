"""The validating safetensors reader: agreement with the reference library on good files,
typed errors on every bad-input class of reliability.md B2."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from entity.hf.safetensors_io import SafetensorsFile, open_checkpoint
from poly.errors import (
    CheckpointError,
    IntegrityError,
    LimitExceededError,
    SafetensorsFormatError,
    UnsafeFormatError,
    UnsupportedError,
)


def _raw(path: Path, header: dict | bytes, data: bytes = b"", prefix: bytes | None = None) -> Path:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes((prefix if prefix is not None else struct.pack("<Q", len(body))) + body + data)
    return path


def _entry(dtype="F32", shape=(2,), begin=0, end=8) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def test_roundtrip_agrees_with_reference(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g),
        "f16": torch.randn(4, 2, generator=g).half(),
        "bf16": torch.randn(7, generator=g).bfloat16(),
        "f64": torch.randn(2, 2, generator=g).double(),
        "i8": torch.randint(-100, 100, (6,), generator=g, dtype=torch.int8),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    ours = SafetensorsFile(path)
    assert ours.metadata == {"format": "pt"}
    with safe_open(str(path), framework="pt") as ref:
        assert sorted(ours.names()) == sorted(ref.keys())
        for name in ref.keys():
            want = ref.get_tensor(name)
            got = ours.tensor(name)
            assert got.shape == tuple(want.shape)
            if want.dtype == torch.bfloat16:
                assert got.dtype == ml_dtypes.bfloat16
                # bit-exact: bf16 bits are the top half of the float32 bits
                np.testing.assert_array_equal(
                    got.view(np.uint16), want.view(torch.int16).numpy().view(np.uint16)
                )
                np.testing.assert_array_equal(ours.tensor_f32(name), want.float().numpy())
            else:
                np.testing.assert_array_equal(got, want.numpy())
    from poly.filesnapshot import FileSnapshot
    from poly.runtime.shard import mapping_of

    assert isinstance(mapping_of(ours.tensor("f32")), FileSnapshot)  # a view of the file's bytes
    assert not ours.tensor("f32").flags.writeable
    with pytest.raises(UnsupportedError):
        ours.tensor_f32("i8")


def test_unknown_field_is_stricter_than_reference(tmp_path):
    # Decision (reliability B2 #29): we refuse unknown fields; the reference ignores them.
    header = {"a": dict(_entry(), extra=1)}
    path = _raw(tmp_path / "x.safetensors", header, b"\0" * 8)
    with safe_open(str(path), framework="np") as ref:
        assert list(ref.keys()) == ["a"]
    with pytest.raises(SafetensorsFormatError) as info:
        SafetensorsFile(path)
    assert info.value.reason == "unknown_field"


def test_identical_duplicate_key_refused_although_reference_accepts(tmp_path):
    entry = json.dumps(_entry())
    body = ('{"a": ' + entry + ', "a": ' + entry + "}").encode()
    path = _raw(tmp_path / "d.safetensors", body, b"\0" * 8)
    with safe_open(str(path), framework="np") as ref:
        assert list(ref.keys()) == ["a"]
    with pytest.raises(SafetensorsFormatError) as info:
        SafetensorsFile(path)
    assert info.value.reason == "duplicate_key"


HUGE = 1 << 62
BAD_FILES = [
    ("header_too_small", b"", b"", b"\x01\x02"),
    ("header_too_large", b"{}", b"", struct.pack("<Q", 2**64 - 1)),
    ("header_too_large", b"{}", b"", struct.pack("<Q", 100_000_001)),
    ("header_length", b"{}", b"", struct.pack("<Q", 1000)),
    ("header_utf8", b'{"\xff": 1}', b"", None),
    ("header_json", b"\xef\xbb\xbf{}", b"", None),
    ("header_json", b"{not json", b"", None),
    ("header_json", b"[]", b"", None),
    ("header_json", b"{}\x00\x00", b"", None),
    ("header_json", b'{"a": NaN}', b"", None),
    ("header_json", b"[" * 50000 + b"]" * 50000, b"", None),
    ("header_json", b'{"a": ' + b"9" * 5000 + b"}", b"", None),
    ("dtype", {"a": _entry(dtype="F128")}, b"\0" * 8, None),
    ("dtype", {"a": _entry(dtype="f32")}, b"\0" * 8, None),
    ("shape", {"a": _entry(shape=(2.0,))}, b"\0" * 8, None),
    ("shape", {"a": _entry(shape=(True, 2))}, b"\0" * 8, None),
    ("shape", {"a": _entry(shape=(-2,))}, b"\0" * 8, None),
    ("shape", {"a": _entry(shape=(2**64,))}, b"\0" * 8, None),
    ("offsets", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4, 8]}}, b"\0" * 8, None),
    ("offsets", {"a": _entry(begin=-1, end=7)}, b"\0" * 8, None),
    ("offsets", {"a": _entry(begin=8, end=0)}, b"\0" * 8, None),
    ("overlap", {f"t{i}": _entry() for i in range(1000)}, b"\0" * 8, None),
    ("hole", {"a": _entry(), "b": _entry(begin=12, end=20)}, b"\0" * 20, None),
    ("hole", {"a": _entry(begin=4, end=12)}, b"\0" * 12, None),
    ("size_mismatch", {"a": _entry(shape=(3,))}, b"\0" * 8, None),
    ("overflow", {"a": _entry(shape=(HUGE, HUGE, 4))}, b"\0" * 8, None),
    ("misaligned", {"a": _entry(dtype="F4", shape=(3,), end=1)}, b"\0", None),
    ("truncated", {"a": _entry()}, b"\0" * 5, None),
    ("trailing_bytes", {"a": _entry()}, b"\0" * 9, None),
    ("metadata", {"__metadata__": {"k": 1}, "a": _entry()}, b"\0" * 8, None),
    ("metadata", {"__metadata__": {"k": {"n": "x"}}, "a": _entry()}, b"\0" * 8, None),
    ("name", {"": _entry()}, b"\0" * 8, None),
]
ERROR_CLASS = {"header_too_large": LimitExceededError, "truncated": IntegrityError}


@pytest.mark.parametrize("reason,header,data,prefix", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_files(tmp_path, reason, header, data, prefix):
    path = tmp_path / "bad.safetensors"
    if reason == "header_too_small":
        path.write_bytes(prefix)
    else:
        _raw(path, header, data, prefix)
    with pytest.raises(ERROR_CLASS.get(reason, SafetensorsFormatError)) as info:
        SafetensorsFile(path)
    assert info.value.reason == reason
    assert info.value.path == str(path)


def test_not_a_regular_file(tmp_path):
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="not a regular file"):
        SafetensorsFile(fifo)


def _shards(tmp_path: Path, weight_map: dict[str, str]) -> Path:
    save_file({"a": torch.ones(2)}, str(tmp_path / "s1.safetensors"))
    save_file({"b": torch.zeros(3)}, str(tmp_path / "s2.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tmp_path


def test_sharded_index(tmp_path):
    ckpt = open_checkpoint(_shards(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"}))
    assert sorted(ckpt.names()) == ["a", "b"]
    np.testing.assert_array_equal(ckpt.tensor_f32("b"), np.zeros(3, np.float32))


@pytest.mark.parametrize(
    "weight_map,reason",
    [
        ({"a": "../s1.safetensors", "b": "s2.safetensors"}, "path_escape"),
        ({"a": "/etc/passwd", "b": "s2.safetensors"}, "path_escape"),
        ({"a": "s1.safetensors", "b": "s3.safetensors"}, "shard_missing"),
        ({"a": "s2.safetensors", "b": "s2.safetensors"}, "index_mismatch"),
        ({"a": "s1.safetensors", "b": "s2.safetensors", "c": "s2.safetensors"}, "index_mismatch"),
    ],
)
def test_bad_index(tmp_path, weight_map, reason):
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(_shards(tmp_path, weight_map))
    assert info.value.reason == reason


def test_listed_shard_holds_unlisted_tensor(tmp_path):
    save_file({"a": torch.ones(2), "extra": torch.ones(1)}, str(tmp_path / "s1.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors"}})
    )
    with pytest.raises(IntegrityError) as info:
        open_checkpoint(tmp_path)
    assert info.value.reason == "index_mismatch" and "extra" in str(info.value)


def test_tensor_in_two_shards(tmp_path):
    save_file({"a": torch.ones(2)}, str(tmp_path / "s1.safetensors"))
    save_file({"a": torch.ones(2)}, str(tmp_path / "s2.safetensors"))
    with pytest.raises(IntegrityError) as info:
        open_checkpoint(tmp_path)
    assert info.value.reason == "duplicate_tensor"


def test_symlinked_shard_outside_dir(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"a": torch.ones(2)}, str(outside / "evil.safetensors"))
    model = tmp_path / "model"
    model.mkdir()
    os.symlink(outside / "evil.safetensors", model / "s1.safetensors")
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors"}})
    )
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(model)
    assert info.value.reason == "path_escape"


def test_pickle_only_dir_is_refused_unread(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(
        b"\x80\x04\x95garbage that must never be unpickled"
    )
    with pytest.raises(UnsafeFormatError):
        open_checkpoint(tmp_path)


def test_empty_dir(tmp_path):
    with pytest.raises(CheckpointError, match="no .safetensors"):
        open_checkpoint(tmp_path)

"""Reliability catalogue B2 (safetensors and sharded indexes): each bad input -> a typed error.

Every case asserts the error class, its stable ``.code`` and the short ``.reason`` word, and a
generous time bound (pathological loops or allocations, not speed).
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from entity.hf.safetensors_io import SafetensorsFile, open_checkpoint
from poly.errors import (
    CheckpointError,
    IntegrityError,
    LimitExceededError,
    SafetensorsFormatError,
    UnsafeFormatError,
)
from tests.fuzz.corpus import ST_ARRAYS, expect_error, st_entries, st_pack, st_valid

HEADER, DATA = st_entries(ST_ARRAYS)


def _with(name: str, **changes) -> bytes:
    header = json.loads(json.dumps(HEADER))
    header[name].update(changes)
    return st_pack(header, DATA)


def _raw(text: str, data: bytes = DATA) -> bytes:
    return st_pack(None, data, raw_header=text.encode("utf-8", "surrogatepass"))


ENTRY_A = json.dumps(HEADER["a"])
# (catalogue id, bytes, error class, reason)
CASES = [
    ("B2-9", b"\x01\x00\x00", SafetensorsFormatError, "header_too_small"),
    ("B2-10", struct.pack("<Q", 100_000_001) + b"{}", LimitExceededError, "header_too_large"),
    ("B2-10", struct.pack("<Q", 2**64 - 1) + b"{}", LimitExceededError, "header_too_large"),
    ("B2-11", struct.pack("<Q", 4096) + b"{}", SafetensorsFormatError, "header_length"),
    ("B2-12", st_pack(None, raw_header=b'{"\xff": 1}'), SafetensorsFormatError, "header_utf8"),
    ("B2-12", st_pack(None, raw_header=b"\xef\xbb\xbf{}"), SafetensorsFormatError, "header_json"),
    ("B2-13", _raw("{not json"), SafetensorsFormatError, "header_json"),
    ("B2-13", _raw("[]", b""), SafetensorsFormatError, "header_json"),
    ("B2-13", _raw("{}\x00\x00\x00", b""), SafetensorsFormatError, "header_json"),
    (
        "B2-14",
        _raw(f'{{"a": {ENTRY_A}, "a": {ENTRY_A}}}', DATA[:24]),
        SafetensorsFormatError,
        "duplicate_key",
    ),  # fmt: skip
    ("B2-15", _raw('{"x": NaN}', b""), SafetensorsFormatError, "header_json"),
    ("B2-15", _raw('{"x": Infinity}', b""), SafetensorsFormatError, "header_json"),
    ("B2-15", _raw('{"x": %s}' % ("9" * 5000), b""), SafetensorsFormatError, "header_json"),
    ("B2-16", _raw("[" * 100_000 + "]" * 100_000, b""), SafetensorsFormatError, "header_json"),
    ("B2-17", _with("a", dtype="F128"), SafetensorsFormatError, "dtype"),
    ("B2-17", _with("a", dtype="f32"), SafetensorsFormatError, "dtype"),
    ("B2-18", _with("a", shape=[2.0, 3]), SafetensorsFormatError, "shape"),
    ("B2-18", _with("a", shape=[True, 3]), SafetensorsFormatError, "shape"),
    ("B2-18", _with("a", shape=[-2, -3]), SafetensorsFormatError, "shape"),
    ("B2-18", _with("a", shape=[2**64, 3]), SafetensorsFormatError, "shape"),
    ("B2-19", _with("a", data_offsets=[0, 24, 24]), SafetensorsFormatError, "offsets"),
    ("B2-19", _with("a", data_offsets=[-1, 23]), SafetensorsFormatError, "offsets"),
    ("B2-22", _with("a", data_offsets=[24, 0]), SafetensorsFormatError, "offsets"),
    ("B2-23", _with("a", shape=[2, 2]), SafetensorsFormatError, "size_mismatch"),
    ("B2-24", _with("a", shape=[2**62, 4]), SafetensorsFormatError, "overflow"),
    (
        "B2-25",
        st_pack({"f": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, b"\0\0"),
        SafetensorsFormatError,
        "misaligned",
    ),  # fmt: skip
    ("B2-26", st_pack(HEADER, DATA[:-1]), IntegrityError, "truncated"),
    (
        "B2-27",
        st_pack(HEADER, DATA + b"PK\x03\x04polyglot"),
        SafetensorsFormatError,
        "trailing_bytes",
    ),
    (
        "B2-28",
        st_pack({"__metadata__": {"k": 1}, **HEADER}, DATA),
        SafetensorsFormatError,
        "metadata",
    ),
    (
        "B2-28",
        st_pack({"__metadata__": {"k": {"n": "x"}}, **HEADER}, DATA),
        SafetensorsFormatError,
        "metadata",
    ),  # fmt: skip
    ("B2-29", _with("a", extra=1), SafetensorsFormatError, "unknown_field"),
    ("B2-30", st_pack({"": HEADER["a"]}, DATA[:24]), SafetensorsFormatError, "name"),
    ("B2-30", st_pack({"n" * 70_000: HEADER["a"]}, DATA[:24]), SafetensorsFormatError, "name"),
]


def _alias_bomb(n: int) -> bytes:
    # safetensors abuse attempt 3: many names on the same byte range
    entry = {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}
    return st_pack({f"t{i}": entry for i in range(n)}, b"abcd")


def _hole() -> bytes:
    header = json.loads(json.dumps(HEADER))
    header["b"]["data_offsets"] = [28, 32]
    header["c"]["data_offsets"] = [32, 40]
    return st_pack(header, DATA + b"\0" * 4)


CASES += [
    ("B2-20", _alias_bomb(100_000), SafetensorsFormatError, "overlap"),
    ("B2-21", _hole(), SafetensorsFormatError, "hole"),
]


@pytest.mark.parametrize(
    "data,cls,reason", [c[1:] for c in CASES], ids=[f"{c[0]}-{c[3]}" for c in CASES]
)
def test_catalogue_case(tmp_path, data, cls, reason):
    p = tmp_path / "model.safetensors"
    p.write_bytes(data)
    exc = expect_error(lambda: SafetensorsFile(p), cls, cls.code, seconds=5.0)
    assert exc.reason == reason, str(exc)
    assert exc.path == str(p)


def test_valid_file_matches_numpy(tmp_path):
    p = tmp_path / "model.safetensors"
    p.write_bytes(st_valid({"format": "pt"}))
    f = SafetensorsFile(p)
    for name, arr in ST_ARRAYS.items():
        np.testing.assert_array_equal(f.tensor(name), arr)
    assert f.metadata == {"format": "pt"}


def test_reference_library_reads_our_valid_bytes(tmp_path):
    # differential: the builder is checked against the reference reader
    from safetensors.numpy import load_file

    p = tmp_path / "model.safetensors"
    p.write_bytes(st_valid())
    ref = load_file(str(p))
    for name, arr in ST_ARRAYS.items():
        np.testing.assert_array_equal(ref[name], arr)


def test_b2_30_control_and_surrogate_names_are_displayable(tmp_path):
    # lone surrogate / escape sequence in a name: stored, but error messages use ascii()
    header = {"\x1b]0;pwn\x07\ud800": dict(HEADER["a"], shape=[2, 2])}
    p = tmp_path / "model.safetensors"
    p.write_bytes(_raw(json.dumps(header, ensure_ascii=True), DATA[:24]))
    exc = expect_error(lambda: SafetensorsFile(p), SafetensorsFormatError, "bad_safetensors")
    msg = str(exc)
    msg.encode("utf-8")  # no lone surrogate reaches the terminal
    assert "\x1b" not in msg and "\x07" not in msg


def test_b2_31_nan_inf_data_is_accepted_by_the_format(tmp_path):
    arr = np.array([np.nan, np.inf, -np.inf, 1.0], np.float32)
    header, data = st_entries({"x": arr})
    p = tmp_path / "model.safetensors"
    p.write_bytes(st_pack(header, data))
    got = SafetensorsFile(p).tensor_f32("x")
    assert np.array_equal(np.isnan(got), np.isnan(arr)) and np.isinf(got).sum() == 2


def _sharded(tmp_path, weight_map: dict, shards: dict[str, dict[str, np.ndarray]]):
    for fname, arrays in shards.items():
        header, data = st_entries(arrays)
        (tmp_path / fname).write_bytes(st_pack(header, data))
    idx = {"metadata": {}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    return tmp_path


A = {"a": ST_ARRAYS["a"]}
B = {"b": ST_ARRAYS["b"]}


@pytest.mark.parametrize("shard", ["../../x.safetensors", "/etc/passwd", "sub/../../x"])
def test_b2_33_index_path_escape(tmp_path, shard):
    outside = tmp_path / "x.safetensors"
    header, data = st_entries(A)
    outside.write_bytes(st_pack(header, data))
    root = tmp_path / "deep" / "model"
    root.mkdir(parents=True)
    _sharded(root, {"a": shard}, {})
    exc = expect_error(lambda: open_checkpoint(root), CheckpointError, "checkpoint_error")
    assert exc.reason == "path_escape"


def test_b2_33_symlinked_shard_outside_is_refused(tmp_path):
    outside = tmp_path / "secret.safetensors"
    header, data = st_entries(A)
    outside.write_bytes(st_pack(header, data))
    root = tmp_path / "model"
    root.mkdir()
    os.symlink(outside, root / "s1.safetensors")
    _sharded(root, {"a": "s1.safetensors"}, {})
    exc = expect_error(lambda: open_checkpoint(root), CheckpointError, "checkpoint_error")
    assert exc.reason == "path_escape"


@pytest.mark.parametrize(
    "weight_map,shards,reason",
    [
        ({"a": "s1.safetensors", "b": "s2.safetensors"}, {"s1.safetensors": A}, "shard_missing"),
        (
            {"a": "s1.safetensors", "b": "s2.safetensors"},
            {"s1.safetensors": {**A, **B}, "s2.safetensors": B},
            "duplicate_tensor",
        ),
        ({"a": "s1.safetensors"}, {"s1.safetensors": {**A, **B}}, "index_mismatch"),
        ({"a": "s1.safetensors", "b": "s1.safetensors"}, {"s1.safetensors": A}, "index_mismatch"),
    ],
    ids=["missing", "in-two-shards", "not-in-index", "absent-in-shard"],
)
def test_b2_34_shard_consistency(tmp_path, weight_map, shards, reason):
    _sharded(tmp_path, weight_map, shards)
    exc = expect_error(lambda: open_checkpoint(tmp_path), IntegrityError, "integrity")
    assert exc.reason == reason


def test_b2_35_header_dtype_wins(tmp_path):
    # mixed dtypes across tensors are allowed: each is read with its own header dtype
    _sharded(tmp_path, {"a": "s1.safetensors", "c": "s1.safetensors"},
             {"s1.safetensors": {"a": ST_ARRAYS["a"], "c": ST_ARRAYS["c"]}})  # fmt: skip
    ck = open_checkpoint(tmp_path)
    assert ck.tensor("c").dtype == np.float16 and ck.tensor("a").dtype == np.float32


def test_pickle_only_dir_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"PK\x03\x04" + b"\0" * 30)
    expect_error(lambda: open_checkpoint(tmp_path), UnsafeFormatError, "unsafe_format")

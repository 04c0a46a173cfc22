"""Reliability catalogue B1 (any input path): every bad path -> a typed error, nothing read forever."""

from __future__ import annotations

import os
import pickle  # noqa: S403 - only to *write* hostile test files, never to load them
import socket
import zipfile

import numpy as np
import pytest

from entity.load import load
from poly.errors import CheckpointError, FormatError, PolyError, UnsafeFormatError
from tests.fuzz.corpus import expect_error, gguf_model

pytestmark = pytest.mark.timeout(30)


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/poly-pickle-ran",))


def _pickle_bytes(protocol: int) -> bytes:
    return pickle.dumps(_Boom(), protocol=protocol)


def test_b1_1_missing_path(tmp_path):
    exc = expect_error(lambda: load(tmp_path / "nope.gguf"), PolyError)
    assert exc.code in ("not_found", "checkpoint_error")


def test_b1_1_directory_without_config(tmp_path):
    expect_error(lambda: load(tmp_path), PolyError, "not_found")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files regardless of permissions")
def test_b1_1_unreadable(tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(gguf_model())
    p.chmod(0)
    expect_error(lambda: load(p), CheckpointError)


def test_b1_2_fifo_is_refused_without_blocking(tmp_path):
    p = tmp_path / "m.gguf"
    os.mkfifo(p)
    expect_error(lambda: load(p), CheckpointError, "checkpoint_error")


@pytest.mark.parametrize("dev", ["/dev/zero", "/dev/urandom", "/dev/null"])
def test_b1_2_devices(dev):
    if not os.path.exists(dev):
        pytest.skip(f"{dev} missing")
    expect_error(lambda: load(dev), CheckpointError, "checkpoint_error")


def test_b1_2_socket(tmp_path):
    path = tmp_path / "s.gguf"
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(path))
        expect_error(lambda: load(path), CheckpointError, "checkpoint_error")
    finally:
        s.close()


def test_b1_3_empty_file(tmp_path):
    for name in ("m.gguf", "m.entity", "m.safetensors"):
        p = tmp_path / name
        p.write_bytes(b"")
        expect_error(lambda p=p: load(p), FormatError, "bad_format")


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
@pytest.mark.parametrize("ext", [".safetensors", ".gguf", ".entity", ".bin"])
def test_b1_4_pickle_binary_protocols(tmp_path, protocol, ext):
    marker = "/tmp/poly-pickle-ran"
    if os.path.exists(marker):
        os.unlink(marker)
    p = tmp_path / f"m{ext}"
    p.write_bytes(_pickle_bytes(protocol))
    expect_error(lambda: load(p), UnsafeFormatError, "unsafe_format")
    assert not os.path.exists(marker)


@pytest.mark.parametrize("protocol", [0, 1])
def test_b1_4_pickle_text_protocols(tmp_path, protocol):
    # protocol 0/1 have no magic: refused because they match no allowed structure
    p = tmp_path / "m.safetensors"
    p.write_bytes(_pickle_bytes(protocol))
    exc = expect_error(lambda: load(p), CheckpointError)
    assert exc.code in ("unsafe_format", "bad_format")
    assert not os.path.exists("/tmp/poly-pickle-ran")


def test_b1_5_zip_npz_h5(tmp_path):
    z = tmp_path / "pytorch_model.bin"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("archive/data.pkl", _pickle_bytes(2))
    expect_error(lambda: load(z), UnsafeFormatError, "unsafe_format")
    npz = tmp_path / "w.npz"
    np.savez(npz, a=np.zeros(3))
    expect_error(lambda: load(npz), UnsafeFormatError, "unsafe_format")
    h5 = tmp_path / "w.h5"
    h5.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 100)
    expect_error(lambda: load(h5), FormatError)


def test_b1_6_content_decides_not_extension(tmp_path):
    p = tmp_path / "model.safetensors"
    p.write_bytes(gguf_model())
    tf = load(p)  # GGUF by content, parsed by the GGUF parser
    assert tf.source["format"] == "gguf"
    q = tmp_path / "model.gguf"
    q.write_bytes(b"\x10\0\0\0\0\0\0\0" + b'{"a": 1}        ')
    expect_error(lambda: load(q), FormatError)  # safetensors-looking bytes, never the GGUF parser


def test_b1_7_symlink_loop(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    os.symlink(b, a)
    os.symlink(a, b)
    expect_error(lambda: load(a), PolyError)


def test_b1_7_dangling_symlink(tmp_path):
    a = tmp_path / "a.gguf"
    os.symlink(tmp_path / "missing", a)
    expect_error(lambda: load(a), PolyError)


def test_b1_3_tiny_prefixes_of_every_format(tmp_path):
    from tests.fuzz.corpus import entity_valid

    for data in (gguf_model(), entity_valid()):
        for n in range(1, 40):
            p = tmp_path / "m.bin"
            p.write_bytes(data[:n])
            expect_error(lambda p=p: load(p), CheckpointError)


def test_static_guard_no_code_execution_on_load_path():
    """reliability.md §(c) static guard: no unpickling, no unsandboxed Jinja, no remote code."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    banned = re.compile(
        r"^\s*(import pickle|from pickle|import dill|import joblib)"
        r"|torch\.load\(|allow_pickle\s*=\s*True|trust_remote_code\s*=\s*True"
        r"|(?<![A-Za-z])Environment\(|\beval\(|\bexec\(",
        re.M,
    )
    hits = []
    for package in ("poly", "entity", "lucy"):
        for path in sorted((repo / package).rglob("*.py")):
            for m in banned.finditer(path.read_text(encoding="utf-8")):
                hits.append(f"{path.relative_to(repo)}: {m.group(0).strip()}")
    assert hits == []

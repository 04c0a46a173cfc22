"""Reliability catalogue B5 (GGUF): hand-built bad files -> typed errors with stable codes.

Reader cases use the in-memory builders of tests/fuzz/corpus.py; loader cases (hyper-parameters,
tokenizer metadata, templates, block scales) use a tiny complete F32 llama built the same way.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from entity.gguf.loader import load_gguf
from entity.gguf.reader import GGUFFile
from poly.errors import (
    GGUFFormatError,
    PolyError,
    TemplateError,
    TemplateSecurityError,
    TokenizerError,
    UnsupportedError,
)
from tests.fuzz.corpus import (
    ARRAY,
    F32,
    GGML_F32,
    GGML_Q4_0,
    GGUF_KVS,
    GGUF_TENSORS,
    I8,
    STRING,
    U8,
    U32,
    expect_error,
    gguf_model,
    gguf_pack,
    gguf_valid,
    gstr,
)

W = GGUF_TENSORS[0]
HEAD = b"GGUF" + struct.pack("<I", 3)


def _kv_raw(key: bytes, vtype: int, payload: bytes) -> bytes:
    # one raw KV after a header claiming 1 kv and 0 tensors, plus slack bytes
    return HEAD + struct.pack("<QQ", 0, 1) + gstr(key) + struct.pack("<I", vtype) + payload


def _tensor(name="t", gtype=GGML_F32, dims=(4,), raw=b"\0" * 16, offsets=None):
    return gguf_pack([], [(name, gtype, list(dims), raw)], offsets=offsets)


def _raw_tensor_info(name: bytes, n_dims: int, dims: list[int], gtype: int, off: int) -> bytes:
    body = gstr(name) + struct.pack("<I", n_dims) + struct.pack(f"<{len(dims)}Q", *dims)
    body += struct.pack("<IQ", gtype, off)
    return HEAD + struct.pack("<QQ", 1, 0) + body + b"\0" * 64


READER_CASES = [
    ("B5-56-magic", b"GGUX" + gguf_valid()[4:]),
    ("B5-56-truncated", gguf_valid()[:23]),
    ("B5-57-v0", gguf_valid(version=0)),
    ("B5-57-v1", gguf_valid(version=1)),
    ("B5-57-v4", gguf_valid(version=4)),
    ("B5-57-endianness", gguf_valid(version=3 << 16)),
    ("B5-57-FUGG", b"FUGG" + gguf_valid()[4:]),
    ("B5-58-n_tensors", HEAD + struct.pack("<QQ", 2**63, 0) + b"\0" * 300),
    ("B5-58-n_kv", HEAD + struct.pack("<QQ", 0, 2**63) + b"\0" * 300),
    ("B5-58-65540-tensors", HEAD + struct.pack("<QQ", 65540, 0) + b"\0" * 332),
    ("B5-59-key-2^64", HEAD + struct.pack("<QQQ", 0, 1, 2**64 - 1) + b"\0" * 64),
    ("B5-59-key-empty", _kv_raw(b"", U8, b"\x01")),
    ("B5-59-key-65536", _kv_raw(b"k" * 65536, U8, b"\x01")),
    ("B5-60-duplicate", gguf_pack(GGUF_KVS + GGUF_KVS[:1], [W])),
    ("B5-61-type-13", _kv_raw(b"a.b", 13, b"\0" * 16)),
    ("B5-61-type-neg", _kv_raw(b"a.b", 0xFFFFFFFF, b"\0" * 16)),
    ("B5-61-nested", _kv_raw(b"a.b", ARRAY, struct.pack("<IQ", ARRAY, 1) + b"\0" * 16)),
    ("B5-62-string", _kv_raw(b"a.b", STRING, struct.pack("<Q", 1000) + b"short")),
    ("B5-62-string-2^63", _kv_raw(b"a.b", STRING, struct.pack("<Q", 2**63) + b"x" * 64)),
    ("B5-63-array-2^63", _kv_raw(b"a.b", ARRAY, struct.pack("<IQ", U8, 2**63) + b"\0" * 64)),
    ("B5-63-array-bytes", _kv_raw(b"a.b", ARRAY, struct.pack("<IQ", U32, 100) + b"\0" * 64)),
    ("B5-64-utf8-value", _kv_raw(b"a.b", STRING, gstr(b"\xff\xfe"))),
    ("B5-64-utf8-key", _kv_raw(b"a.\xff", U8, b"\x01")),
    ("B5-65-align-0", gguf_pack(GGUF_KVS + [("general.alignment", U32, 0)], [W])),
    ("B5-65-align-13", gguf_pack(GGUF_KVS + [("general.alignment", U32, 13)], [W])),
    ("B5-65-align-2^31", gguf_pack(GGUF_KVS + [("general.alignment", U32, 1 << 31)], [W])),
    ("B5-65-align-string", gguf_pack(GGUF_KVS + [("general.alignment", STRING, "32")], [W])),
    ("B5-70-name-64", _tensor(name="n" * 64)),
    ("B5-70-name-100k", _tensor(name="n" * 100_000)),
    ("B5-70-duplicate", gguf_pack([], [W, W])),
    ("B5-71-n_dims-5", _raw_tensor_info(b"t", 5, [1] * 5, GGML_F32, 0)),
    ("B5-71-n_dims-max", _raw_tensor_info(b"t", 0xFFFFFFFF, [1], GGML_F32, 0)),
    ("B5-72-negative", _raw_tensor_info(b"t", 1, [2**64 - 1], GGML_F32, 0)),
    ("B5-72-overflow", _raw_tensor_info(b"t", 2, [2**62, 4], GGML_F32, 0)),
    ("B5-72-zero-and-huge", _raw_tensor_info(b"t", 2, [0, 2**63], GGML_F32, 0)),
    ("B5-73-type-99", _tensor(gtype=99)),
    ("B5-73-type-neg", _tensor(gtype=0xFFFFFFFF)),
    ("B5-74-q4_0-33", _tensor(gtype=GGML_Q4_0, dims=(33,), raw=b"\0" * 18)),
    ("B5-75-misaligned", gguf_pack([], [W, GGUF_TENSORS[1]], offsets=[0, 50])),
    ("B5-75-overlap", gguf_pack([], [W, GGUF_TENSORS[1]], offsets=[0, 0])),
    ("B5-75-minus-1", gguf_pack([], [W], offsets=[2**64 - 1])),
    ("B5-76-data-short", gguf_valid()[:-1]),
]


@pytest.mark.parametrize("data", [c[1] for c in READER_CASES], ids=[c[0] for c in READER_CASES])
def test_reader_case(tmp_path, data):
    p = tmp_path / "x.gguf"
    p.write_bytes(data)
    exc = expect_error(lambda: GGUFFile(p), GGUFFormatError, "bad_gguf", seconds=2.0)
    assert exc.path == str(p) and exc.offset is not None


def test_valid_reader_file_matches_gguf_py(tmp_path):
    # differential: our builder's valid bytes read the same through the reference reader
    from gguf import GGUFReader

    p = tmp_path / "x.gguf"
    p.write_bytes(gguf_valid())
    ours, ref = GGUFFile(p), GGUFReader(str(p))
    for t in ref.tensors:
        if t.tensor_type == GGML_F32:
            np.testing.assert_array_equal(ours.tensor_array(t.name).reshape(-1), t.data.reshape(-1))
    assert set(ours.tensors) == {t.name for t in ref.tensors}


def test_b5_72_zero_dim_alone(tmp_path):
    # ggml loads a zero-element tensor; we refuse it as a format error (never a crash)
    p = tmp_path / "x.gguf"
    p.write_bytes(_tensor(dims=(0,), raw=b""))
    try:
        GGUFFile(p)
    except GGUFFormatError as exc:
        assert exc.code == "bad_gguf"


def test_b5_77_nonzero_padding_is_not_read_as_data(tmp_path):
    # bytes in the alignment padding never reach a tensor (documented: accepted, not validated)
    data = bytearray(gguf_pack([], [GGUF_TENSORS[1], W]))
    p = tmp_path / "x.gguf"
    p.write_bytes(bytes(data))
    gg = GGUFFile(p)
    pad_at = gg.tensors["b"].offset + gg.tensors["b"].nbytes
    data[pad_at] = 0xAB
    p.write_bytes(bytes(data))
    gg = GGUFFile(p)
    np.testing.assert_array_equal(
        gg.tensor_array("w").reshape(-1), np.arange(12, dtype=np.float32) / 7
    )


# --- loader level (tiny F32 llama) ----------------------------------------------------------


def _load(tmp_path, data: bytes):
    p = tmp_path / "m.gguf"
    p.write_bytes(data)
    return lambda: load_gguf(p)


def test_tiny_model_loads(tmp_path):
    tf = _load(tmp_path, gguf_model())()
    assert tf.config.num_layers == 1 and np.isfinite(tf.forward([0, 1])).all()


LOADER_CASES = [
    ("B5-66-scores-int8", {"tokenizer.ggml.scores": (ARRAY, (I8, [0] * 6))}, TokenizerError),
    ("B5-66-token_type-len", {"tokenizer.ggml.token_type": (ARRAY, (U32, [1, 1]))}, TokenizerError),
    (
        "B5-66-tokens-not-strings",
        {"tokenizer.ggml.tokens": (ARRAY, (F32, [0.0] * 6))},
        TokenizerError,
    ),
    ("B5-67-block_count-600", {"llama.block_count": (U32, 600)}, GGUFFormatError),
    ("B5-67-block_count-2", {"llama.block_count": (U32, 2)}, PolyError),
    ("B5-67-heads-0", {"llama.attention.head_count": (U32, 0)}, GGUFFormatError),
    ("B5-67-kv-heads-3", {"llama.attention.head_count_kv": (U32, 3)}, GGUFFormatError),
    ("B5-67-arch", {"general.architecture": (STRING, "mamba")}, UnsupportedError),
    ("B5-68-eos-id", {"tokenizer.ggml.eos_token_id": (U32, 6)}, TokenizerError),
    ("B5-68-bos-id", {"tokenizer.ggml.bos_token_id": (U32, 2**31)}, TokenizerError),
]


@pytest.mark.parametrize(
    "changes,cls", [c[1:] for c in LOADER_CASES], ids=[c[0] for c in LOADER_CASES]
)
def test_loader_case(tmp_path, changes, cls):
    expect_error(_load(tmp_path, gguf_model(changes)), cls, None if cls is PolyError else cls.code)


def test_b5_69_template_ssti_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    payload = f"{{{{ lipsum.__globals__['os'].popen('touch {marker}').read() }}}}"
    load = _load(tmp_path, gguf_model({"tokenizer.chat_template": (STRING, payload)}))
    try:
        tf = load()
        tf.chat_template.render([{"role": "user", "content": "hi"}])
    except TemplateSecurityError as exc:
        assert exc.code == "unsafe_template"
    else:
        pytest.fail("SSTI template rendered")
    assert not marker.exists()


def test_b5_73_unsupported_quant_type(tmp_path):
    # a real ggml type the dequantiser cannot handle (or that the file layout refuses)
    kvs, tensors = [], [("t", 16, [256], b"\0" * 66)]  # IQ2_XXS: known size, no numpy dequantiser
    p = tmp_path / "x.gguf"
    p.write_bytes(gguf_pack(kvs, tensors))
    gg = GGUFFile(p)
    try:
        gg.dequantize("t")
    except UnsupportedError as exc:
        assert exc.code == "unsupported"
    # else: the gguf package can dequantize it, which is fine


def test_b5_78_nan_weights_never_become_tokens(tmp_path):
    # NaN in the weights (a NaN block scale dequantizes to NaN rows): generation raises
    # NumericalError instead of sampling from NaN logits (B8-106), and the model stays usable.
    from poly.errors import NumericalError
    from poly.text.generation import generate_text
    from poly.text.sampling import GenOptions
    from tests.fuzz.corpus import gguf_model_parts

    kvs, tensors = gguf_model_parts()
    tensors = [
        (
            n,
            t,
            d,
            np.full(len(raw) // 4, np.nan, np.float32).tobytes()
            if n == "output_norm.weight"
            else raw,
        )
        for n, t, d, raw in tensors
    ]
    p = tmp_path / "m.gguf"
    p.write_bytes(gguf_pack(kvs, tensors))
    tf = load_gguf(p)
    opts = GenOptions(max_tokens=2, temperature=0.0)
    expect_error(lambda: generate_text(tf, [0, 1], opts), NumericalError, "numerical")
    expect_error(lambda: generate_text(tf, [0, 1], opts.replace(temperature=1.0, seed=1)),
                 NumericalError, "numerical")  # fmt: skip


def test_a_broken_template_is_refused_at_the_first_render_not_the_open(tmp_path):
    # a model's template compiles at its first render: the open imports no jinja2 (~25 ms)
    load = _load(tmp_path, gguf_model({"tokenizer.chat_template": (STRING, "{% for %}")}))
    tf = load()
    assert tf.chat_template.source == "{% for %}"
    exc = expect_error(lambda: tf.chat_template.render([{"role": "user", "content": "hi"}]),
                       TemplateError)  # fmt: skip
    assert exc.code == "bad_template"

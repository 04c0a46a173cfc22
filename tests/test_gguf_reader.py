"""Malformed GGUF files: every one gives GGUFFormatError quickly, never another exception type.

The files are written with ``struct`` (tests/fuzz/corpus.py's tiny independent GGUF writer),
then corrupted.
"""

from __future__ import annotations

import os
import struct
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from entity.gguf.pread import read_tensor
from entity.gguf.reader import GGUFFile
from poly.errors import GGUFFormatError, UnsupportedError

# One small independent GGUF writer (struct only) serves this file and the fuzz corpus.
from tests.fuzz.corpus import (
    ARRAY,
    BOOL,
    F32,
    GGML_F16,
    GGML_F32,
    GGML_Q8_0,
    I32,
    STRING,
    U32,
    U64,
)
from tests.fuzz.corpus import gguf_pack as write_gguf
from tests.fuzz.corpus import gstr as _str

W = np.arange(12, dtype=np.float32).reshape(3, 4) / 7  # numpy (3, 4) -> GGUF dims [4, 3]
B = np.array([1.5, -2.0, 0.25], dtype=np.float16)
Q8_BLOCK = struct.pack("<e", 0.5) + bytes(range(0, 64, 2))  # one Q8_0 block: f16 scale, 32 int8
KVS = [
    ("general.architecture", STRING, "llama"),
    ("llama.block_count", U32, 2),
    ("llama.rope.freq_base", F32, 10000.0),
    ("tokenizer.ggml.add_bos_token", BOOL, False),
    ("tokenizer.ggml.tokens", ARRAY, (STRING, ["a", "b", "ü"])),
    ("tokenizer.ggml.token_type", ARRAY, (I32, [1, 3, 1])),
]
TENSORS = [
    ("w", GGML_F32, [4, 3], W.tobytes()),
    ("b", GGML_F16, [3], B.tobytes()),
    ("q", GGML_Q8_0, [32], Q8_BLOCK),
]


def valid_bytes(**kw) -> bytes:
    return write_gguf(KVS, TENSORS, **kw)


def open_bytes(tmp_path, data: bytes, name="x.gguf") -> GGUFFile:
    p = tmp_path / name
    p.write_bytes(data)
    return GGUFFile(p)


def assert_bad(tmp_path, data: bytes, match: str | None = None) -> GGUFFormatError:
    start = time.process_time()
    with pytest.raises(GGUFFormatError, match=match) as info:
        open_bytes(tmp_path, data)
    # a CPU-time bound on pathological behaviour (huge loops/allocations), not a speed test
    assert time.process_time() - start < 1.0
    assert info.value.offset is not None
    return info.value


def test_valid_round_trip(tmp_path):
    gg = open_bytes(tmp_path, valid_bytes())
    assert gg.version == 3 and gg.alignment == 32
    md = gg.metadata
    assert md["general.architecture"] == "llama" and md["llama.block_count"] == 2
    assert md["llama.rope.freq_base"] == 10000.0 and md["tokenizer.ggml.add_bos_token"] is False
    assert md["tokenizer.ggml.tokens"] == ["a", "b", "ü"]
    assert md["tokenizer.ggml.token_type"].tolist() == [1, 3, 1]
    assert gg.tensors["w"].shape == (3, 4)  # GGUF dims [4, 3] reversed
    np.testing.assert_array_equal(gg.dequantize("w"), W)
    np.testing.assert_array_equal(gg.tensor_array("w"), W)
    np.testing.assert_array_equal(gg.dequantize("b"), B.astype(np.float32))
    scale, qs = 0.5, np.frombuffer(bytes(range(0, 64, 2)), dtype=np.int8).astype(np.float32)
    np.testing.assert_array_equal(gg.dequantize("q"), (scale * qs)[None, :].reshape(32))
    assert gg.tensor_bytes("q").tobytes() == Q8_BLOCK


def test_custom_alignment_loads(tmp_path):
    kvs = [*KVS, ("general.alignment", U32, 64)]
    gg = open_bytes(tmp_path, write_gguf(kvs, TENSORS, alignment=64))
    assert gg.alignment == 64 and all(t.offset % 64 == 0 for t in gg.tensors.values())
    np.testing.assert_array_equal(gg.dequantize("w"), W)


def test_truncated_everywhere(tmp_path):
    data = valid_bytes()
    for cut in range(0, len(data) - 1, 3):
        assert_bad(tmp_path, data[:cut])


def _patch(data: bytes, at: int, fmt: str, value) -> bytes:
    return data[:at] + struct.pack(fmt, value) + data[at + struct.calcsize(fmt) :]


def _key_value_at(data: bytes, key: str) -> int:
    """Byte offset just after the key's type tag (where its value starts)."""
    return data.index(_str(key)) + 8 + len(key) + 4


@pytest.mark.parametrize(
    ("what", "at", "fmt", "value", "match"),
    [
        ("bad magic", 0, "<4s", b"GGML", "magic"),
        ("version 1", 4, "<I", 1, "version"),
        ("version 4", 4, "<I", 4, "version"),
        ("huge tensor count", 8, "<Q", 2**63, "tensor count"),
        ("huge kv count", 16, "<Q", 2**63 - 1, "kv count"),
    ],
)
def test_header_fields(tmp_path, what, at, fmt, value, match):
    assert_bad(tmp_path, _patch(valid_bytes(), at, fmt, value), match)


def test_huge_string_length(tmp_path):
    data = valid_bytes()
    at = _key_value_at(data, "general.architecture")
    assert_bad(tmp_path, _patch(data, at, "<Q", 2**63), "length")
    at = data.index(_str("general.architecture"))
    assert_bad(tmp_path, _patch(data, at, "<Q", 2**40), "length")  # a key length


def test_huge_array_length(tmp_path):
    data = valid_bytes()
    at = _key_value_at(data, "tokenizer.ggml.token_type") + 4
    assert_bad(tmp_path, _patch(data, at, "<Q", 2**63), "array")
    at = _key_value_at(data, "tokenizer.ggml.tokens") + 4
    assert_bad(tmp_path, _patch(data, at, "<Q", 2**62), "array")


def test_unknown_value_types(tmp_path):
    data = valid_bytes()
    at = _key_value_at(data, "llama.block_count") - 4
    assert_bad(tmp_path, _patch(data, at, "<I", 13), "value type")
    at = _key_value_at(data, "tokenizer.ggml.token_type")
    assert_bad(tmp_path, _patch(data, at, "<I", 99), "element type")
    assert_bad(tmp_path, _patch(data, at, "<I", ARRAY), "nested")


def test_duplicate_key_and_bad_utf8(tmp_path):
    assert_bad(tmp_path, write_gguf([*KVS, KVS[1]], TENSORS), "duplicate")
    assert_bad(tmp_path, write_gguf([(b"general.\xff", STRING, "x")], TENSORS), "UTF-8")
    assert_bad(tmp_path, write_gguf([("general.name", STRING, b"\xc3")], TENSORS), "UTF-8")


@pytest.mark.parametrize("alignment", [0, 13, 48, 2**31])
def test_bad_alignment_value(tmp_path, alignment):
    kvs = [*KVS, ("general.alignment", U32, alignment)]
    assert_bad(tmp_path, write_gguf(kvs, TENSORS), "alignment")


def test_alignment_wrong_type(tmp_path):
    kvs = [*KVS, ("general.alignment", U64, 32)]
    assert_bad(tmp_path, write_gguf(kvs, TENSORS), "UINT32")


def test_misaligned_offset(tmp_path):
    assert_bad(tmp_path, valid_bytes(offsets=[0, 52, 64]), "multiple")


def test_overlapping_tensors(tmp_path):
    assert_bad(tmp_path, valid_bytes(offsets=[0, 32, 0]), "overlaps")


def test_offset_past_eof(tmp_path):
    assert_bad(tmp_path, valid_bytes(offsets=[0, 64, 2**40]), "past the end")
    assert_bad(tmp_path, valid_bytes(offsets=[0, 64, 2**64 - 32]), "past the end")


def _tensor_with(name="t", gtype=GGML_F32, dims=(4,), raw=b"\0" * 16) -> bytes:
    return write_gguf(KVS, [(name, gtype, list(dims), raw)])


def test_bad_tensor_infos(tmp_path):
    assert_bad(tmp_path, _tensor_with(dims=(1, 1, 1, 1, 4)), "n_dims")
    assert_bad(tmp_path, _tensor_with(dims=()), "n_dims")
    assert_bad(tmp_path, _tensor_with(dims=(4, 0)), "zero")
    assert_bad(tmp_path, _tensor_with(dims=(2**32, 2**32, 2**32)), "larger than the file")
    assert_bad(tmp_path, _tensor_with(gtype=4), "unknown ggml type")  # Q4_2 was removed
    assert_bad(tmp_path, _tensor_with(gtype=2**31), "unknown ggml type")
    assert_bad(tmp_path, _tensor_with(gtype=GGML_Q8_0, dims=(33,)), "multiple")
    assert_bad(tmp_path, _tensor_with(name="n" * 100), "limit")
    assert_bad(tmp_path, write_gguf(KVS, [TENSORS[0], TENSORS[0]]), "duplicate")


def test_data_one_byte_short(tmp_path):
    assert_bad(tmp_path, valid_bytes()[:-1], "past the end")


def test_empty_and_tiny_files(tmp_path):
    assert_bad(tmp_path, b"")
    assert_bad(tmp_path, b"GGUF")


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    edits=st.lists(
        st.tuples(st.integers(min_value=0, max_value=10**6), st.integers(0, 255)),
        min_size=1,
        max_size=6,
    ),
    cut=st.one_of(st.none(), st.integers(min_value=0, max_value=10**6)),
)
def test_random_edits_only_raise_format_errors(tmp_path, edits, cut):
    data = bytearray(valid_bytes())
    for pos, byte in edits:
        data[pos % len(data)] = byte
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    start = time.process_time()
    try:
        gg = open_bytes(tmp_path, bytes(data), name="fuzz.gguf")
        for name in gg.tensors:
            try:
                assert gg.dequantize(name).dtype == np.float32
            except UnsupportedError:  # an edit may name a known type gguf cannot dequantize
                pass
    except GGUFFormatError:
        pass
    assert time.process_time() - start < 1.0


# --- tiny synthetic models of every architecture, written with gguf.GGUFWriter ------------------

ARCH_CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
}
HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF half-split -> interleaved rows)
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny_gguf(path, arch: str, model, dtype=np.float32) -> None:
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(128)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(0x100 + i) for i in range(cfg.vocab_size)])
    w.add_eos_token_id(1)
    for name, t in model.state_dict().items():
        arr = t.detach().numpy().astype(np.float32)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            arr = _llama_cpp_permute(arr, heads)
        gname = {
            "model.embed_tokens.weight": "token_embd.weight",
            "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight",
        }.get(name)
        if gname is None:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{HF_TO_GGUF[module]}.{kind}"
        w.add_tensor(gname, arr.astype(dtype) if arr.ndim == 2 else arr)  # matrices as `dtype`
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("keep_quantized", [True, False])
@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_tiny_arch_logits_match_transformers(tmp_path, arch, keep_quantized):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from entity.gguf.loader import load_gguf

    cls, extra = ARCH_CONFIGS[arch]
    cfg = getattr(transformers, cls)(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        tie_word_embeddings=arch != "llama",
        **extra,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random biases/norms so a dropped or misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, arch, model)
    ids = [3, 17, 42, 5, 77, 8, 13, 21, 34, 55, 89, 1]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    tf = load_gguf(path, keep_quantized=keep_quantized)
    assert tf.tied == cfg.tie_word_embeddings
    np.testing.assert_allclose(tf.forward_all(ids), ref, atol=1e-4, rtol=0)
    tf.reset()  # and token by token through the KV cache
    steps = np.stack([tf.forward([t]) for t in ids])
    np.testing.assert_allclose(steps, ref, atol=1e-4, rtol=0)


def _tiny_qwen2(tmp_path):
    """A one-layer random qwen2 from transformers written as a float32 GGUF file."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    cls, extra = ARCH_CONFIGS["qwen2"]
    cfg = getattr(transformers, cls)(vocab_size=96, hidden_size=64, intermediate_size=96,
                                     num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, **extra)  # fmt: skip
    path = tmp_path / "q.gguf"
    write_tiny_gguf(path, "qwen2", transformers.AutoModelForCausalLM.from_config(cfg).eval())
    return path


def test_f32_matrices_kept_as_stored_leave_the_file_mapping(tmp_path):
    """keep_quantized float tensors are not read from the mapping's 4 KB pages every token: copied
    to aligned memory, or laid out by 16 there by the plan (repack.float_kmajor16); the logits do
    not change."""
    from entity.gguf.loader import load_gguf
    from poly.nn import swiglu
    from poly.runtime import ckernels, fused, repack

    path = _tiny_qwen2(tmp_path)
    kept, dense = load_gguf(path, keep_quantized=True), load_gguf(path, keep_quantized=False)
    w = swiglu.components(kept.mlp(0))["w_down"]

    laid = repack.float_kmajor16_wanted(ckernels.F32, w.shape[0])
    assert (repack._mapping(w.raw) is not None) == laid  # on the file's bytes (FileSnapshot)
    if laid:  # the plan's copy, aligned
        assert fused.plan(kept) is not None and w.repacked16.ctypes.data % 64 == 0
    ids = [3, 17, 42, 5]
    np.testing.assert_allclose(kept.forward_all(ids), dense.forward_all(ids), atol=1e-5, rtol=0)


def test_read_tensor_copies_the_bytes_and_refuses_a_shrunken_file(tmp_path):
    """read_tensor gives the mapping's bytes; a file cut since opening is a GGUFFormatError."""
    path = _tiny_qwen2(tmp_path)
    gg = GGUFFile(path)
    name = max(gg.tensors, key=lambda n: gg.tensors[n].offset)  # the last tensor in the file
    want, got = np.array(gg.tensor_bytes(name)), np.zeros(gg.tensors[name].nbytes, np.uint8)
    for kw in ({"threads": 3, "piece": 100}, {}):  # pieces on a pool of threads, or one piece
        read_tensor(gg, name, got, **kw)
        np.testing.assert_array_equal(got, want.reshape(-1))
    with pytest.raises(ValueError):
        read_tensor(gg, name, got[:-1])
    os.truncate(path, gg.tensors[name].offset + 8)
    with pytest.raises(GGUFFormatError, match="ends past the file"):
        read_tensor(gg, name, got)

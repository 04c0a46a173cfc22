"""Builders for valid and hand-damaged checkpoint bytes (safetensors, GGUF, .entity).

Shared by the reliability tests and the fuzz harness so that seeds and catalogue cases stay in
sync (reliability.md §(c)). Everything is generated at test time; no binary fixtures.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from poly.errors import PolyError

# --- safetensors ---------------------------------------------------------------------------------

ST_DTYPE = {"F32": "<f4", "F16": "<f2", "I8": "i1", "U8": "u1", "I32": "<i4"}


def st_entries(arrays: dict[str, np.ndarray]) -> tuple[dict[str, Any], bytes]:
    """Header entries (offsets back to back, in the given order) and the data section."""
    header: dict[str, Any] = {}
    data = b""
    for name, arr in arrays.items():
        raw = np.ascontiguousarray(arr).tobytes()
        dtype = next(k for k, v in ST_DTYPE.items() if np.dtype(v) == arr.dtype)
        header[name] = {
            "dtype": dtype,
            "shape": list(arr.shape),
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    return header, data


def st_pack(header: Any, data: bytes = b"", *, raw_header: bytes | None = None) -> bytes:
    """8-byte little-endian length + header JSON (or ``raw_header``) + data."""
    body = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + data


ST_ARRAYS = {
    "a": np.arange(6, dtype=np.float32).reshape(2, 3) / 3,
    "b": np.array([1, -2, 3, -4], dtype=np.int8),
    "c": np.ones((2, 2), dtype=np.float16),
}


def st_valid(metadata: dict[str, str] | None = None) -> bytes:
    header, data = st_entries(ST_ARRAYS)
    if metadata is not None:
        header = {"__metadata__": metadata, **header}
    return st_pack(header, data)


# --- GGUF ----------------------------------------------------------------------------------------

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q8_0 = 0, 1, 2, 8
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
        U64: "<Q", I64: "<q", F64: "<d"}  # fmt: skip


def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def gvalue(vtype: int, value: Any) -> bytes:
    if vtype == STRING:
        return gstr(value)
    if vtype == ARRAY:
        etype, items = value
        return struct.pack("<IQ", etype, len(items)) + b"".join(gvalue(etype, v) for v in items)
    return struct.pack(_FMT[vtype], value)


def gguf_pack(kvs, tensors, *, alignment=32, version=3, magic=b"GGUF", offsets=None) -> bytes:
    """kvs: [(key, vtype, value)]; tensors: [(name, ggml_type, gguf_dims, raw_bytes)]."""
    head = magic + struct.pack("<IQQ", version, len(tensors), len(kvs))
    head += b"".join(gstr(k) + struct.pack("<I", t) + gvalue(t, v) for k, t, v in kvs)
    data, rel = b"", []
    for _, _, _, raw in tensors:
        data += b"\0" * (-len(data) % alignment)
        rel.append(len(data))
        data += raw
    rel = offsets if offsets is not None else rel
    for (name, gtype, dims, _), off in zip(tensors, rel):
        head += gstr(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        head += struct.pack("<IQ", gtype, off)
    head += b"\0" * (-len(head) % alignment)
    return head + data


GGUF_KVS = [
    ("general.architecture", STRING, "llama"),
    ("llama.block_count", U32, 1),
    ("tokenizer.ggml.tokens", ARRAY, (STRING, ["a", "b", "c"])),
    ("tokenizer.ggml.scores", ARRAY, (F32, [0.0, -1.0, -2.0])),
]
Q8_BLOCK = struct.pack("<e", 0.5) + bytes(range(0, 64, 2))  # f16 scale + 32 int8
GGUF_TENSORS = [
    ("w", GGML_F32, [4, 3], (np.arange(12, dtype=np.float32) / 7).tobytes()),
    ("b", GGML_F16, [3], np.array([1.5, -2.0, 0.25], np.float16).tobytes()),
    ("q", GGML_Q8_0, [32], Q8_BLOCK),
]


def gguf_valid(**kw) -> bytes:
    return gguf_pack(GGUF_KVS, GGUF_TENSORS, **kw)


# --- .entity -------------------------------------------------------------------------------------

ENTITY_META = dict(
    network={"depth": 1},
    transformer={"architecture": "llama"},
    quant={"scheme": "f32"},
    tokenizer='{"model": {}}',
    tokenizer_config={"bos_token": "<s>"},
    chat_template="{{ messages }}",
    generation_config={"temperature": 0.7},
    eos_token_ids=[2],
    source={"format": "test"},
)
ENTITY_ARRAYS = {
    "a": np.arange(10, dtype=np.float32).reshape(2, 5),
    "b": np.array([-3, 4, 5], dtype=np.int8),
}


def entity_write(path: str | os.PathLike, arrays=None, meta=None) -> Path:
    from entity.dotentity.container import EntityWriter

    w = EntityWriter(path)
    for name, arr in (ENTITY_ARRAYS if arrays is None else arrays).items():
        w.add(name, arr)
    return w.finish(dict(ENTITY_META if meta is None else meta))


def entity_valid() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        return entity_write(Path(d) / "x.entity").read_bytes()


# --- running a parser ----------------------------------------------------------------------------


def run_bytes(parser: Callable[[Path], Any], data: bytes, path: Path) -> Any:
    path.write_bytes(data)
    return parser(path)


def expect_error(fn: Callable[[], Any], cls: type[PolyError], code: str | None = None,
                 *, seconds: float = 2.0) -> PolyError:  # fmt: skip
    """``fn()`` must raise ``cls`` (with ``.code == code``) within ``seconds`` of CPU time (a
    bound on pathological behaviour, not a speed test: CPU time does not grow when other
    processes load the machine). Returns the error."""
    start = time.process_time()
    try:
        fn()
    except cls as exc:
        took = time.process_time() - start
        assert took < seconds, f"took {took:.2f} s of CPU time"
        if code is not None:
            assert exc.code == code, (exc.code, code, str(exc))
        assert str(exc), "error without a message"
        return exc
    except BaseException as exc:  # noqa: BLE001 - report what leaked
        raise AssertionError(f"expected {cls.__name__}, got {type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"expected {cls.__name__}, nothing raised")


# --- a tiny complete GGUF llama model (F32), for loader-level cases ------------------------------

GM_H, GM_HEADS, GM_KV, GM_FF, GM_VOCAB = 8, 2, 1, 16, 6
GM_TOKENS = ["a", "b", "c", "d", "<|im_start|>", "<|im_end|>"]


def byte_vocab() -> list[str]:
    """The 256 byte-level BPE symbols plus the two ChatML markers (vocab 258)."""
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet()) + ["<|im_start|>", "<|im_end|>"]


def gguf_model_parts(seed: int = 0, tokens: list[str] | None = None, hidden: int = GM_H,
                     layers: int = 1) -> tuple[list, list]:  # fmt: skip
    """(kvs, tensors) of a tiny llama with a byte-level vocabulary (default: 6 tokens)."""
    rng = np.random.default_rng(seed)
    tokens = GM_TOKENS if tokens is None else tokens
    vocab, GM_H_ = len(tokens), hidden
    hd = GM_H_ // GM_HEADS
    types = [1] * (vocab - 2) + [3, 3]
    kvs = [
        ("general.architecture", STRING, "llama"),
        ("general.name", STRING, "tiny"),
        ("llama.block_count", U32, layers),
        ("llama.embedding_length", U32, GM_H_),
        ("llama.feed_forward_length", U32, GM_FF),
        ("llama.attention.head_count", U32, GM_HEADS),
        ("llama.attention.head_count_kv", U32, GM_KV),
        ("llama.context_length", U32, 64),
        ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
        ("tokenizer.ggml.model", STRING, "gpt2"),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, tokens)),
        ("tokenizer.ggml.token_type", ARRAY, (I32, types)),
        ("tokenizer.ggml.merges", ARRAY, (STRING, [])),
        ("tokenizer.ggml.eos_token_id", U32, vocab - 1),
    ]
    h = GM_H_
    shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,)}  # numpy shapes
    for i in range(layers):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (h,),
            f"blk.{i}.attn_q.weight": (GM_HEADS * hd, h),
            f"blk.{i}.attn_k.weight": (GM_KV * hd, h),
            f"blk.{i}.attn_v.weight": (GM_KV * hd, h),
            f"blk.{i}.attn_output.weight": (h, GM_HEADS * hd),
            f"blk.{i}.ffn_norm.weight": (h,),
            f"blk.{i}.ffn_gate.weight": (GM_FF, h),
            f"blk.{i}.ffn_up.weight": (GM_FF, h),
            f"blk.{i}.ffn_down.weight": (h, GM_FF),
        })  # fmt: skip
    tensors = [
        (
            name,
            GGML_F32,
            list(reversed(shape)),
            rng.standard_normal(shape).astype(np.float32).tobytes(),
        )
        for name, shape in shapes.items()
    ]
    return kvs, tensors


def gguf_model(kv_changes: dict[str, tuple[int, Any] | None] | None = None, seed: int = 0,
               **kw: Any) -> bytes:  # fmt: skip
    """The tiny model with some KVs replaced (``(vtype, value)``) or removed (None)."""
    kvs, tensors = gguf_model_parts(seed, **kw)
    changes = dict(kv_changes or {})
    out = []
    for key, vtype, value in kvs:
        if key in changes:
            new = changes.pop(key)
            if new is not None:
                out.append((key, *new))
        else:
            out.append((key, vtype, value))
    out += [(k, *v) for k, v in changes.items() if v is not None]
    return gguf_pack(out, tensors)


def tiny_model(
    tmp_dir: str | os.PathLike, *, hidden: int = 32, layers: int = 1, max_seq_len: int = 64
):
    """A loaded tiny llama (byte vocab 258, random F32 weights) via our own GGUF loader."""
    from entity.gguf.loader import load_gguf

    p = Path(tmp_dir) / f"tiny-{hidden}-{layers}.gguf"
    if not p.exists():
        p.write_bytes(gguf_model(tokens=byte_vocab(), hidden=hidden, layers=layers))
    return load_gguf(p, keep_quantized=False, max_seq_len=max_seq_len)

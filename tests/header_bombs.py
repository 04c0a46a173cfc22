"""Headers at each format's cap, built to amplify (issue #18 item 5; docs/security.md table).

`python -m tests.header_bombs NAME DIR` writes the file, opens it the way `entity.load` does
and prints one JSON line; tests run it in a child to measure the peak RSS.
"""

from __future__ import annotations

import json
import struct
import sys
import time
import zlib
from pathlib import Path

import msgpack

MiB = 1 << 20


def seal_v2(body: bytes) -> bytes:
    from entity.dotentity.header import CRC_TAIL, MAGIC, PREFIX

    body = body + CRC_TAIL
    prefix = PREFIX.pack(MAGIC, 2, 0, len(body) + 4)
    return prefix + body + zlib.crc32(prefix + body).to_bytes(4, "big")


def _v2_empty_arrays(cap: int) -> bytes:
    inner = b"\xdd" + struct.pack(">I", 1 << 17) + b"\x90" * (1 << 17)  # 128k empty arrays
    n = (cap - 64) // len(inner)
    return seal_v2(b"\x82" + msgpack.packb("junk") + b"\xdd" + struct.pack(">I", n) + inner * n)


def _v2_string(cap: int) -> bytes:
    s = "x" * (cap - 64)
    return seal_v2(b"\x82" + msgpack.packb("tokenizer") + msgpack.packb(s))


def _v2_blob_table(cap: int) -> bytes:
    from entity.dotentity.header import MAX_BLOBS

    rec = {"path": "", "offset": 0, "length": 4, "dtype": "float32", "shape": [1], "checksum": 0}
    blobs = [dict(rec, path=f"layers.{i}.w", offset=64 * i) for i in range(MAX_BLOBS)]
    return seal_v2(b"\x83" + msgpack.packb("format_version") + b"\x02"
                    + msgpack.packb("blobs") + msgpack.packb(blobs))  # fmt: skip


def _v1(raw: bytes) -> bytes:
    from entity.dotentity.header import MAGIC

    return MAGIC + struct.pack("<HHQ", 1, 0, len(raw)) + raw


def _v1_empty_arrays(cap: int) -> bytes:
    n = (cap - 64) // 3
    return _v1(b'{"format_version": 1, "x": [' + b"[]," * n + b"[]]}")


def _v1_string(cap: int) -> bytes:
    return _v1(b'{"format_version": 1, "x": "' + b"x" * (cap - 64) + b'"}')


def _st_empty_arrays(cap: int) -> bytes:
    n = (cap - 64) // 3
    head = b'{"__metadata__": {"x": [' + b"[]," * n + b"[]]}}"
    return struct.pack("<Q", len(head)) + head


def _st_tensor_table(cap: int) -> bytes:
    from entity.hf.safetensors_io import MAX_HEADER_ITEMS

    n = MAX_HEADER_ITEMS // 9  # the most tensor entries under the item cap
    ents = ",".join(f'"t{i}":{{"dtype":"F32","shape":[1],"data_offsets":[{4 * i},{4 * i + 4}]}}'
                    for i in range(n))  # fmt: skip
    head = ("{" + ents + "}").encode()
    return struct.pack("<Q", len(head)) + head + bytes(4 * n)


def _gguf_token_list_at_cap(cap: int) -> bytes:
    from entity.gguf.header import MAX_STRING_ARRAY
    from tests.fuzz.corpus import ARRAY, STRING, gguf_pack

    toks = [f"{i:x}" for i in range(MAX_STRING_ARRAY)]
    return gguf_pack([("general.architecture", STRING, "llama"),
                      ("tokenizer.ggml.tokens", ARRAY, (STRING, toks))], [])  # fmt: skip


def _gguf_strings(cap: int) -> bytes:
    from tests.fuzz.corpus import ARRAY, STRING, gguf_pack

    n = cap // 9  # an array of empty strings: 8-byte length each
    return gguf_pack([("general.architecture", STRING, "llama"),
                      ("tokenizer.ggml.tokens", ARRAY, (STRING, [""] * n))], [])  # fmt: skip


def caps() -> dict[str, tuple[int, object, str]]:
    from entity.dotentity import container, v1
    from entity.hf import safetensors_io

    c2, c1 = container.MAX_HEADER_LEN, v1.MAX_HEADER_LEN
    cst = safetensors_io.MAX_HEADER_BYTES
    return {
        "entity-v2-empty-arrays": (c2, _v2_empty_arrays, "m.entity"),
        "entity-v2-one-string": (c2, _v2_string, "m.entity"),
        "entity-v2-blob-table-at-cap": (0, _v2_blob_table, "m.entity"),
        "entity-v1-empty-arrays": (c1, _v1_empty_arrays, "m.entity"),
        "entity-v1-one-string": (c1, _v1_string, "m.entity"),
        "safetensors-empty-arrays": (cst, _st_empty_arrays, "model.safetensors"),
        "safetensors-tensor-table-at-cap": (cst, _st_tensor_table, "model.safetensors"),
        "gguf-empty-strings-64MiB": (64 * MiB, _gguf_strings, "m.gguf"),
        "gguf-token-list-at-cap": (0, _gguf_token_list_at_cap, "m.gguf"),
    }


def build(name: str, directory: str) -> Path:
    """Write the file of case ``name`` into ``directory`` (run this in a separate process)."""
    cap, builder, fname = caps()[name]
    path = Path(directory) / fname
    path.write_bytes(builder(cap))
    if fname.endswith(".safetensors"):  # a snapshot dir, so the header gets parsed
        (path.parent / "config.json").write_text(json.dumps(_TINY_CONFIG))
    return path


_TINY_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 8,
                "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                "num_attention_heads": 2, "num_key_value_heads": 2}  # fmt: skip


def open_file(path: str) -> dict:
    """Open ``path`` the way `entity.load` does: the one JSON line the tests read."""
    import entity
    from poly.errors import PolyError

    p = Path(path)
    t = time.monotonic()
    try:
        entity.load(p.parent if p.suffix == ".safetensors" else p)
        outcome = "loaded"
    except PolyError as exc:
        outcome = f"{type(exc).__name__}: {str(exc)[:80]}"
    return {"bytes": p.stat().st_size, "outcome": outcome,
            "seconds": round(time.monotonic() - t, 2)}  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1] == "build":
        print(build(sys.argv[2], sys.argv[3]))
    else:
        print(json.dumps(open_file(sys.argv[2])))

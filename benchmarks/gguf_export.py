"""Write F32 / F16 copies of a GGUF checkpoint for llama.cpp (the peers of our float paths).

Every tensor is dequantized from the source file as stored, so rows stay in llama.cpp's order:
the q/k permutation the converter applied (interleaved RoPE) is kept as is. Our loader undoes
that permutation on load; these copies must not, or llama.cpp would rotate the wrong pairs.
All metadata (tokenizer, chat template, hyper-parameters) is copied; general.file_type is set.

    python -m benchmarks.gguf_export SRC.gguf OUT.gguf --type f16
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

FILE_TYPES = {"f32": 0, "f16": 1}  # llama_ftype: ALL_F32, MOSTLY_F16
SKIP_KEYS = ("GGUF.", "general.architecture", "general.file_type")


def _copy_metadata(reader: GGUFReader, writer: GGUFWriter) -> None:
    for field in reader.fields.values():
        if field.name.startswith(SKIP_KEYS):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)


def export(src: str | Path, dst: str | Path, kind: str = "f32") -> Path:
    """Write `dst` with every 2-D tensor as F32 (kind="f32") or F16 ("f16"); 1-D stay F32."""
    if kind not in FILE_TYPES:
        raise ValueError(f"kind must be one of {sorted(FILE_TYPES)}")
    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(dst), arch)
    _copy_metadata(reader, writer)
    writer.add_file_type(FILE_TYPES[kind])
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # numpy order [rows, cols]
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            vals = np.asarray(t.data, dtype=np.float32).reshape(shape)
        else:
            vals = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        if kind == "f16" and vals.ndim == 2:
            vals = vals.astype(np.float16)
        writer.add_tensor(t.name, vals)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--type", choices=sorted(FILE_TYPES), default="f32")
    args = ap.parse_args(argv)
    export(args.src, args.dst, args.type)


if __name__ == "__main__":
    main()

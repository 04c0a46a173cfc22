"""Write a llama-shaped GGUF with random float32 weights (the matrix's large model).

Default shape ~1.07 B parameters (Llama-3.2-1B's blocks: hidden 2048, 16 layers, FFN 8192,
32 query heads, 8 KV heads; tied embeddings), so the weights are far larger than the caches.
The tokenizer (and so the vocabulary size) is copied from a source GGUF (SmolLM2's by default),
so poly and llama.cpp both load the file and the prompts are the same token ids. Weights are
N(0, 0.02), norms 1. Tensors are streamed to the file one at a time (peak memory: one tensor).

    python -m benchmarks.synthetic_gguf OUT.gguf [--hidden 2048 --layers 16 --ffn 8192]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

SHAPE_1B = {"hidden": 2048, "layers": 16, "ffn": 8192, "heads": 32, "kv_heads": 8}
# Llama-3-8B's blocks (issue 62's 8B-shaped cells); with SmolLM2's 49k vocabulary, tied: 7.0 B
SHAPE_8B = {"hidden": 4096, "layers": 32, "ffn": 14336, "heads": 32, "kv_heads": 8}
SHAPES = {"synth1b": SHAPE_1B, "synth8b": SHAPE_8B}


def tensor_shapes(vocab: int, hidden: int, layers: int, ffn: int, heads: int, kv_heads: int):
    """(name, numpy shape [rows, cols]) of every tensor, in file order."""
    kv = hidden // heads * kv_heads
    out = [("token_embd.weight", (vocab, hidden))]
    for i in range(layers):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (hidden,)),
            (b + "attn_q.weight", (hidden, hidden)),
            (b + "attn_k.weight", (kv, hidden)),
            (b + "attn_v.weight", (kv, hidden)),
            (b + "attn_output.weight", (hidden, hidden)),
            (b + "ffn_norm.weight", (hidden,)),
            (b + "ffn_gate.weight", (ffn, hidden)),
            (b + "ffn_up.weight", (ffn, hidden)),
            (b + "ffn_down.weight", (hidden, ffn)),
        ]
    out.append(("output_norm.weight", (hidden,)))
    return out


def parameter_count(**shape) -> int:
    return sum(int(np.prod(s)) for _, s in tensor_shapes(**shape))


def vocab_size(path: str | os.PathLike) -> int:
    """The number of tokens in a GGUF's vocabulary (its tokenizer.ggml.tokens array)."""
    return len(GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].data)


def _copy_tokenizer(src: GGUFReader, writer: GGUFWriter) -> int:
    """Copy the tokenizer.* keys; return the vocabulary size."""
    vocab = 0
    for field in src.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        value = field.contents()
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
        if field.name == "tokenizer.ggml.tokens":
            vocab = len(value)
    return vocab


def write(
    dst: str | os.PathLike,
    tokenizer_src: str | os.PathLike,
    *,
    hidden: int = 2048,
    layers: int = 16,
    ffn: int = 8192,
    heads: int = 32,
    kv_heads: int = 8,
    context: int = 16384,  # the matrix opens at the longest prompt + context (8,192 + 8,000)
    seed: int = 0,
) -> Path:
    """Write the model to `dst` (through a temp file renamed at the end)."""
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".tmp")
    writer = GGUFWriter(str(tmp), "llama")
    writer.add_name(f"synthetic-llama-h{hidden}-l{layers}")
    writer.add_file_type(0)  # ALL_F32
    vocab = _copy_tokenizer(GGUFReader(str(tokenizer_src)), writer)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    shapes = tensor_shapes(vocab, hidden, layers, ffn, heads, kv_heads)
    for name, shape in shapes:
        writer.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _name, shape in shapes:
        if len(shape) == 1:
            data = np.ones(shape, dtype=np.float32)
        else:
            data = rng.standard_normal(shape, dtype=np.float32)
            data *= 0.02
        writer.write_tensor_data(data)
    writer.close()
    os.replace(tmp, dst)
    return dst


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dst")
    ap.add_argument("--tokenizer-from", default=None, help="GGUF to copy the tokenizer from")
    for key, value in SHAPE_1B.items():
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=value)
    args = ap.parse_args(argv)
    if args.tokenizer_from is None:
        from entity.smollm2 import ensure_smollm2

        args.tokenizer_from = ensure_smollm2()
    shape = {k: getattr(args, k) for k in SHAPE_1B}
    write(args.dst, args.tokenizer_from, **shape)


if __name__ == "__main__":
    main()

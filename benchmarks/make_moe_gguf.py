"""Write a synthetic Qwen3-MoE GGUF (arch ``qwen3moe``) of random weights, streamed tensor by
tensor, for the expert-budget runs and tests (`lucy generate MODEL.gguf --max-experts N`) and
for llama.cpp under the same memory limit (benchmarks/moe_memory_limit.py).

    python -m benchmarks.make_moe_gguf OUT.gguf --hidden 1024 --experts 64 --width 1024 \\
        --layers 4 --top-k 2 [--experts-type Q4_K] [--seed 0]

The experts are stored as ``--experts-type`` (F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, MXFP4;
or one per stack: ``gate,up,down``), the rest F32. Quantized rows are random code bytes with
block scales chosen so each row has a standard deviation near 1/sqrt(fan_in) (activations stay
O(1) through the blocks); the routers are N(0, 1) rows so tokens spread over the experts. Peak
memory while writing is one tensor. The tokenizer: GPT-2's 256 byte tokens and 256 merges.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

VOCAB = 512
ARCH = "qwen3moe"
# code standard deviation per unit block scale, and where the scale (float16) sits in a block
_SPREAD = {"Q4_0": 4.6, "Q4_1": 4.6, "Q8_0": 74.0, "Q4_K": 200.0, "Q6_K": 1000.0}
_SCALE_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (-2,)}


def _stack(rng, qtype, shape: tuple[int, ...]) -> np.ndarray:
    """Random rows of ggml type `qtype` for numpy `shape` (..., cols): float or block bytes."""
    from gguf.constants import GGML_QUANT_SIZES

    cols, name = shape[-1], qtype.name
    if name in ("F32", "F16"):
        w = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(cols))
        return w.astype(np.float16 if name == "F16" else np.float32)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (int(np.prod(shape)) // block, size), dtype=np.uint8)
    if name == "MXFP4":  # e8m0 exponent: values ~ 3 * 2^(e - 127)
        raw[:, 0] = 127 + round(np.log2(1 / (3 * np.sqrt(cols))))
    else:
        d = np.full(raw.shape[0], 1 / (_SPREAD[name] * np.sqrt(cols)), np.float16)
        for at in _SCALE_AT[name]:
            stop = at + 2 if at + 2 else None
            raw[:, at:stop] = d[:, None].view(np.uint8)
    return raw.reshape(*shape[:-1], cols // block * size)


def _tokens() -> tuple[list[str], list[str]]:
    """(tokens, merges): GPT-2's byte-level alphabet (every text tokenizes), then the merges of
    letter pairs up to VOCAB tokens (llama.cpp refuses a BPE vocabulary without merges)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in keep}
    chars.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in chars)})
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    pairs = [(a, b) for a in letters for b in letters][: VOCAB - 256]
    return [chars[b] for b in range(256)] + [a + b for a, b in pairs], [
        f"{a} {b}" for a, b in pairs
    ]


def _tensors(cfg: dict, types: dict):
    """(name, numpy shape, ggml type) of every tensor, in file order."""
    from gguf.constants import GGMLQuantizationType as T

    d, layers, e, w = cfg["hidden"], cfg["layers"], cfg["experts"], cfg["width"]
    heads, kv, hd = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    out = [("token_embd.weight", (VOCAB, d), T.F32)]
    for i in range(layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (d,), T.F32), (b + "attn_q.weight", (heads * hd, d), T.F32),
                (b + "attn_k.weight", (kv * hd, d), T.F32), (b + "attn_v.weight", (kv * hd, d), T.F32),
                (b + "attn_output.weight", (d, heads * hd), T.F32),
                (b + "attn_q_norm.weight", (hd,), T.F32), (b + "attn_k_norm.weight", (hd,), T.F32),
                (b + "ffn_norm.weight", (d,), T.F32), (b + "ffn_gate_inp.weight", (e, d), T.F32),
                (b + "ffn_gate_exps.weight", (e, w, d), types["gate"]),
                (b + "ffn_up_exps.weight", (e, w, d), types["up"]),
                (b + "ffn_down_exps.weight", (e, d, w), types["down"])]  # fmt: skip
    return out + [("output_norm.weight", (d,), T.F32), ("output.weight", (VOCAB, d), T.F32)]


def _values(rng, name: str, shape, qtype) -> np.ndarray:
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith("ffn_gate_inp.weight"):
        return rng.standard_normal(shape, dtype=np.float32)
    return _stack(rng, qtype, shape)


def make_moe_gguf(out: str | Path, *, hidden: int = 256, experts: int = 8, width: int = 256,
                  layers: int = 2, top_k: int = 2, heads: int = 4, kv_heads: int = 2,
                  experts_type: str = "Q8_0", seed: int = 0) -> Path:  # fmt: skip
    """Write the file (see the module doc); returns its path."""
    import gguf
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    parts = experts_type.upper().split(",")
    parts = parts * 3 if len(parts) == 1 else parts
    types = dict(zip(("gate", "up", "down"), (GGMLQuantizationType[p] for p in parts)))
    cfg = dict(hidden=hidden, layers=layers, experts=experts, width=width, heads=heads,
               kv_heads=kv_heads, head_dim=hidden // heads)  # fmt: skip
    w = gguf.GGUFWriter(str(out), ARCH)
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(width)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(hidden // heads)
    w.add_value_length(hidden // heads)
    w.add_expert_count(experts)
    w.add_expert_used_count(top_k)
    w.add_expert_feed_forward_length(width)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_tokenizer_model("gpt2")
    tokens, merges = _tokens()
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_eos_token_id(1)
    tensors = _tensors(cfg, types)
    for name, shape, qtype in tensors:
        block, size = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // block * size
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape, qtype in tensors:  # one tensor in memory at a time
        w.write_tensor_data(np.ascontiguousarray(_values(rng, name, shape, qtype)))
    w.close()
    return Path(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    for flag, default in (("hidden", 256), ("experts", 8), ("width", 256), ("layers", 2),
                          ("top-k", 2), ("heads", 4), ("kv-heads", 2), ("seed", 0)):  # fmt: skip
        ap.add_argument(f"--{flag}", type=int, default=default)
    ap.add_argument("--experts-type", default="Q8_0")
    a = ap.parse_args(argv)
    path = make_moe_gguf(a.out, hidden=a.hidden, experts=a.experts, width=a.width,
                         layers=a.layers, top_k=a.top_k, heads=a.heads, kv_heads=a.kv_heads,
                         experts_type=a.experts_type, seed=a.seed)  # fmt: skip
    print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()

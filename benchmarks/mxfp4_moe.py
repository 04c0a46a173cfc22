"""Decode speed of a GPT-OSS-shaped MoE with MXFP4 experts: the C kernels reading the stored
blocks (csrc/formats/gguf_blocks.h, inside the fused decode step) against the path before them
(each product dequantizing the blocks in numpy, the Python reference path).

    python -m benchmarks.mxfp4_moe [--hidden 1024] [--experts 32] [--top-k 4] [--layers 4]
        [--tokens 16] [--rounds 3] [--out benchmarks/results/mxfp4-moe-zen3.json]

The model (random weights, `build`): GPT-OSS's MoE options (router bias, softmax over the top-k
logits, expert biases, the clamped SwiGLU) on llama attention (GPT-OSS's sinks and windows are
the attention side's), experts as GGUF MXFP4 blocks quantized by gguf-py. Rounds alternate the
two paths; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np


def build(hidden: int = 64, experts: int = 8, width: int = 64, layers: int = 2, top_k: int = 2,
          heads: int = 4, vocab: int = 120, mxfp4: bool = True, seed: int = 0,
          gate_scale: float = 1.0):  # fmt: skip
    """A random Transformer with GPT-OSS's MoE options; experts MXFP4 (GGUFMatrix) or float32.
    Matrices ~N(0, 0.25 / hidden), norms ~1; the experts' gate/up rows times gate_scale (16 drives
    many of them past the clamp's limit of 7)."""
    from gguf import GGMLQuantizationType, quants

    from poly.config import MoEConfig
    from poly.nn import layout, moe, swiglu
    from poly.quant.qtensor import GGUFMatrix
    from tests.tiny_model import random_transformer, tiny_cfg

    cfg = tiny_cfg(hidden, width, vocab_size=vocab, num_layers=layers, num_heads=heads,
                   num_kv_heads=max(1, heads // 2), max_seq_len=512,
                   moe=MoEConfig(experts, top_k, width, "softmax_topk", True, router_bias=True,
                                 expert_bias=True, activation="swiglu_oai"))  # fmt: skip
    tf = random_transformer(cfg, seed=seed, master_scale=0.5 / np.sqrt(hidden), norm_shift=1.0)
    for i in range(layers):
        for sub in moe.experts(tf.mlp(i)):
            sw = layout.swiglu(sub)
            sw.w_gate[...] *= np.float32(gate_scale)
            sw.w_up[...] *= np.float32(gate_scale)
            if not mxfp4:
                continue
            comps = dict(swiglu.components(sub))
            for name in ("w_gate", "w_up", "w_down"):
                w = np.ascontiguousarray(comps[name], np.float32)
                raw = quants.quantize(w, GGMLQuantizationType.MXFP4)
                comps[name] = GGUFMatrix(raw, GGMLQuantizationType.MXFP4, w.shape)
            sub.weights.set_version("gguf", comps, activate=True)
    return tf


def _tok_s(tf, tokens: int) -> float:
    tf.reset()
    tf.forward([1, 2, 3])
    t0 = time.perf_counter()
    for t in range(tokens):
        tf.forward([4 + t % 50])
    return tokens / (time.perf_counter() - t0)


def numpy_mxfp4():
    """A context in which no C kernel reads MXFP4 (the state before it had one)."""
    import contextlib

    from poly.runtime import ckernels
    from poly.weights import Generations

    @contextlib.contextmanager
    def ctx():
        kind = ckernels.GGUF_KINDS.pop("gguf_mxfp4")
        Generations.bump()  # cached fused plans are rebuilt
        try:
            yield
        finally:
            ckernels.GGUF_KINDS["gguf_mxfp4"] = kind
            Generations.bump()

    return ctx()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 1024), ("experts", 32), ("width", 1024), ("layers", 4),
                          ("top-k", 4), ("tokens", 16), ("rounds", 3)):  # fmt: skip
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from poly.runtime import ckernels, fused, kernels

    kernels.set_backend("c")
    tf = build(a.hidden, a.experts, a.width, a.layers, a.top_k, heads=8, vocab=512)
    assert fused.plan(tf) is not None
    runs: dict[str, list[float]] = {"c_kernel_fused": [], "numpy_dequant": []}
    for _ in range(a.rounds):
        runs["c_kernel_fused"].append(_tok_s(tf, a.tokens))
        with numpy_mxfp4():
            assert fused.plan(tf) is None
            runs["numpy_dequant"].append(_tok_s(tf, max(2, a.tokens // 4)))
    res = {
        "benchmark": "mxfp4_moe decode tok/s (GPT-OSS MoE options, MXFP4 experts)",
        "shape": vars(a) | {"heads": 8, "vocab": 512},
        "cpu": cpu_model(), "isa": ckernels.info().get("isa"), "threads": ckernels.info().get("threads"),
        "note": "machine heavily shared (2 cores, up to 8 sessions); medians of alternating rounds",
        "tok_s": {k: [round(v, 2) for v in vs] for k, vs in runs.items()},
        "median_tok_s": {k: round(statistics.median(vs), 2) for k, vs in runs.items()},
    }  # fmt: skip
    res["speedup"] = round(
        res["median_tok_s"]["c_kernel_fused"] / res["median_tok_s"]["numpy_dequant"], 1
    )
    text = json.dumps(res, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                flags = "avx2" if "avx2" in Path("/proc/cpuinfo").read_text() else ""
                return f"{line.split(':', 1)[1].strip()} ({flags})"
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()

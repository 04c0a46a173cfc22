"""Decode speed of a Gemma-2-shaped model on the fused C step next to a llama of the same size and
stored type (issue 58: a family on the fused path must decode near llama's speed).

    python -m benchmarks.recipes_decode [--hidden 1024] [--ffn 4096] [--layers 6] [--vocab 8192]
        [--prompt 160] [--tokens 32] [--rounds 5] [--out benchmarks/results/recipes-decode.json]

Both models: random weights, every attention and FFN matrix GGUF Q8_0 (gguf-py's quantizer),
a tied float32 embedding table as the LM head, head_dim 128, GQA 8/4. The Gemma-2 shape adds
GeGLU, sandwich norms, a sliding window of 64 on every other layer (the prompt is past it, so
those layers attend over the window's moved rows), attention and final soft-caps, the
query_pre_attn_scalar scale and the embedding scale. Rounds alternate the two; medians reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

WINDOW = 64


def build(kind: str, hidden: int, ffn: int, layers: int, vocab: int, seed: int = 0):
    """A random Transformer of `kind` ("llama" or "gemma2"), its matrices GGUF Q8_0."""
    from gguf import GGMLQuantizationType, quants

    from poly.config import AttentionConfig, BlockRecipe
    from poly.layer import LayerType
    from poly.nn import layout
    from poly.quant.qtensor import GGUFMatrix
    from tests.tiny_model import random_transformer, tiny_cfg

    extra = {}
    if kind == "gemma2":
        extra = dict(
            block=BlockRecipe(ffn="geglu", post_norms=True),
            attention=AttentionConfig(sliding_window=WINDOW, window_layers=tuple(range(0, layers, 2)),
                                      softcap=50.0, scale=256**-0.5),
            embedding_scale=float(np.sqrt(hidden)), final_logit_softcap=30.0,
        )  # fmt: skip
    cfg = tiny_cfg(hidden, ffn, vocab_size=vocab, num_layers=layers, num_heads=8, num_kv_heads=4,
                   head_dim=128, max_seq_len=1024, tie_word_embeddings=True, **extra)  # fmt: skip
    tf = random_transformer(cfg, seed=seed, master_scale=0.5 / np.sqrt(hidden), norm_shift=1.0,
                            head_scale=None)  # fmt: skip
    q8 = GGMLQuantizationType.Q8_0
    for layer in tf.network.walk():
        if layer.type not in (LayerType.MHA, LayerType.SWIGLU):
            continue
        comps = {}
        for name, view in layout.views(layer).items():
            if view is not None and name in layout.MATRIX_COMPONENTS:
                w = np.ascontiguousarray(view, np.float32)
                comps[name] = GGUFMatrix(quants.quantize(w, q8), q8, w.shape)
            else:
                comps[name] = None if view is None else np.array(view, dtype=np.float32)
        layer.weights.set_version("gguf_q8_0", comps, activate=True)
    return tf


def _tok_s(tf, prompt: int, tokens: int) -> float:
    tf.reset()
    tf.forward([(7 * i + 3) % 500 for i in range(prompt)])
    t0 = time.perf_counter()
    for t in range(tokens):
        tf.forward([4 + t % 50])
    return tokens / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 1024), ("ffn", 4096), ("layers", 6), ("vocab", 8192),
                          ("prompt", 160), ("tokens", 32), ("rounds", 5)):  # fmt: skip
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from benchmarks.mxfp4_moe import cpu_model
    from poly.runtime import ckernels, fused, kernels

    kernels.set_backend("c")
    models = {k: build(k, a.hidden, a.ffn, a.layers, a.vocab) for k in ("llama", "gemma2")}
    assert all(fused.plan(tf) is not None for tf in models.values())
    runs: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(a.rounds):
        for k, tf in models.items():
            runs[k].append(_tok_s(tf, a.prompt, a.tokens))
    med = {k: round(statistics.median(vs), 2) for k, vs in runs.items()}
    res = {
        "benchmark": "recipes_decode: fused-step decode tok/s, Gemma-2 shape vs llama, GGUF Q8_0",
        "shape": vars(a) | {"heads": 8, "kv_heads": 4, "head_dim": 128, "window": WINDOW},
        "cpu": cpu_model(), "isa": ckernels.info().get("isa"), "threads": kernels.num_threads(),
        "note": "machine heavily shared (2 cores, up to 8 sessions); medians of alternating rounds",
        "tok_s": {k: [round(v, 2) for v in vs] for k, vs in runs.items()},
        "median_tok_s": med,
        "gemma2_over_llama": round(med["gemma2"] / med["llama"], 3),
    }  # fmt: skip
    text = json.dumps(res, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

"""Write a synthetic Qwen3-MoE-style `.entity` of random weights (many experts), block by block,
for the expert-budget runs (`lucy generate MODEL --max-experts N`).

    python -m benchmarks.make_moe_entity OUT.entity --hidden 1024 --experts 64 --width 1024 \\
        --layers 4 --top-k 2 [--quant f32|f16|q8|q4] [--seed 0]

Size ~ layers * experts * 3 * hidden * width * bytes per weight (f32: 4), plus attention and a
small byte-level BPE vocabulary (trained here with `tokenizers`). Peak memory while writing is
one block. Weights are N(0, 1/fan_in) so activations stay O(1) through the blocks; the router
is N(0, 1) rows so tokens spread over the experts.
"""

from __future__ import annotations

import argparse
import types
from pathlib import Path

import numpy as np

VOCAB = 512
_CORPUS = ["The quick brown fox jumps over the lazy dog. 0123456789 Hello world, MoE experts!"]


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from poly.text.tokenizer import Tokenizer as PolyTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    return PolyTokenizer.from_str(tok.to_str(), eos_token="<|endoftext|>")


def config(hidden: int, experts: int, width: int, layers: int, top_k: int, vocab: int = VOCAB,
           heads: int = 8):  # fmt: skip
    from poly.config import MoEConfig, TransformerConfig

    return TransformerConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=width, num_layers=layers,
        num_heads=heads, num_kv_heads=max(1, heads // 4), qk_norm=True, max_seq_len=512,
        tie_word_embeddings=False, architecture="qwen3_moe",
        moe=MoEConfig(experts, top_k, width, "softmax", True),
    )  # fmt: skip


def _block(cfg, rng) -> dict:
    d, q, kv, w = cfg.hidden_size, cfg.query_dim, cfg.kv_dim, cfg.moe.expert_intermediate_size

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(
            np.float32
        )

    mlp = {"router": rng.standard_normal((cfg.moe.num_experts, d), dtype=np.float32)}
    for e in range(cfg.moe.num_experts):
        mlp[f"experts.{e}.w_gate"], mlp[f"experts.{e}.w_up"] = mat(w, d), mat(w, d)
        mlp[f"experts.{e}.w_down"] = mat(d, w)
    ones = np.ones(cfg.head_dim, np.float32)
    return {
        "attn_norm": {"gamma": np.ones(d, np.float32)},
        "attn": {
            "w_q": mat(q, d),
            "w_k": mat(kv, d),
            "w_v": mat(kv, d),
            "w_o": mat(d, q),
            "q_norm": ones,
            "k_norm": ones,
        },  # fmt: skip
        "mlp_norm": {"gamma": np.ones(d, np.float32)},
        "mlp": mlp,
    }


def make_moe_entity(path: str | Path, *, hidden: int = 1024, experts: int = 64, width: int = 1024,
                    layers: int = 4, top_k: int = 2, quant: str = "f32", seed: int = 0,
                    force: bool = False) -> Path:  # fmt: skip
    """Write the synthetic model to ``path`` (temp-then-rename) and return the path."""
    from entity.dotentity.write import model_meta, write_entity
    from poly.model.block import build_block
    from poly.network import VolumetricNetwork

    tok = _tokenizer()  # a byte-level BPE of at most VOCAB ids (all of them reachable)
    cfg = config(hidden, experts, width, layers, top_k, tok.vocab_size)
    net = VolumetricNetwork(1, 1, 1, layers)
    for i in range(layers):
        net.set_layer(0, 0, 0, i, build_block(cfg, allocate=False, index=i))
    shell = types.SimpleNamespace(network=net, tokenizer=tok, chat_template=None,
                                  eos_token_ids=(0,), generation_defaults=None,
                                  source={"format": "synthetic", "seed": seed})  # fmt: skip
    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((cfg.vocab_size, hidden), dtype=np.float32)
    # an untied random head: a tied one maps each token back to itself (greedy repeats it)
    head = rng.standard_normal((cfg.vocab_size, hidden), dtype=np.float32)
    blocks = ((i, _block(cfg, rng)) for i in range(layers))
    out = write_entity(path, cfg, blocks, lambda: (emb, head, np.ones(hidden, np.float32)),
                       model_meta(shell, cfg), quant=quant, force=force)  # fmt: skip
    return Path(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    for name, default in (("hidden", 1024), ("experts", 64), ("width", 1024), ("layers", 4),
                          ("top-k", 2), ("seed", 0)):  # fmt: skip
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--quant", default="f32", choices=["f32", "f16", "bf16", "q8", "q4"])
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args(argv)
    make_moe_entity(a.out, hidden=a.hidden, experts=a.experts, width=a.width, layers=a.layers,
                    top_k=a.top_k, quant=a.quant, seed=a.seed, force=a.force)  # fmt: skip


if __name__ == "__main__":
    main()

"""MoE speed, poly vs llama.cpp on the same GGUF files (issue #14): a random Qwen3-MoE
(d = 512, 16 experts of width 1024, top-2, 8 layers) built with transformers, converted by
llama.cpp's own converter to F32 and Q8_0.

Each engine runs in its own process: load, one warm-up, then `--runs` measured runs of a
64-token prefill and `--new` greedy decode steps; medians are reported with poly/llama.cpp ratios.

    python -m benchmarks.compare_moe [--runs 3] [--new 32] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORK = Path(os.environ.get("POLY_BENCH_DIR", Path(tempfile.gettempdir()) / "poly-bench")) / "moe"
DIMS = dict(hidden_size=512, moe_intermediate_size=1024, intermediate_size=1024, num_experts=16,
            num_experts_per_tok=2, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64, norm_topk_prob=True, vocab_size=2048,
            max_position_embeddings=1024, tie_word_embeddings=False)  # fmt: skip
ENGINES = ("poly-f32", "llama-f32", "poly-q8_0", "llama-q8_0")
PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 2048, 64)]


def _checkpoint(out: Path) -> Path:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**DIMS, bos_token_id=0, eos_token_id=1)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    model.save_pretrained(out)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(
        [" ".join(map(str, range(i, i + 400))) for i in range(0, 4000, 7)], trainer
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out)
    return out


def prepare() -> dict[str, Path]:
    from benchmarks import llama_convert

    WORK.mkdir(parents=True, exist_ok=True)
    hf = _checkpoint(WORK / "qwen3moe-hf")
    root = llama_convert.converter_dir()
    if root is None:
        raise SystemExit("llama.cpp converter (llama-cpp-python sdist) not available")
    files = {}
    for kind in ("f32", "q8_0"):
        path = WORK / f"qwen3moe.{kind}.gguf"
        files[kind] = path if path.is_file() else llama_convert.convert(hf, path, kind, root)
    return files


CHILD = """
import json, statistics, sys, time
import numpy as np
name, path, runs, new, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
prompt = json.loads(sys.argv[6])
if name.startswith("poly"):
    from entity.gguf.loader import load_gguf
    from poly.runtime import kernels
    kernels.set_num_threads(threads)
    m = load_gguf(path, keep_quantized=name.endswith("q8_0"))
    def run():
        m.reset(); t0 = time.perf_counter(); lg = m.forward(prompt); t1 = time.perf_counter(); out = []
        for _ in range(new):
            out.append(int(np.argmax(lg))); lg = m.forward([out[-1]])
        return t1 - t0, time.perf_counter() - t1, out
else:
    import llama_cpp
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=512, n_threads=threads, n_batch=512, verbose=False)
    def logits():
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))
    def run():
        llm.reset(); t0 = time.perf_counter(); llm.eval(prompt); t1 = time.perf_counter(); out = []
        for _ in range(new):
            out.append(int(np.argmax(logits()))); llm.eval([out[-1]])
        return t1 - t0, time.perf_counter() - t1, out
run()
res = [run() for _ in range(runs)]
print(json.dumps({"prefill_tok_s": statistics.median(len(prompt) / p for p, _, _ in res),
                  "decode_tok_s": statistics.median(new / d for _, d, _ in res),
                  "tokens": res[-1][2]}))
"""


def measure(name: str, path: Path, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-c", CHILD, name, str(path), str(args.runs), str(args.new),
           str(args.threads), json.dumps(PROMPT)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    files = prepare()
    t0 = time.perf_counter()
    results = {e: measure(e, files[e.split("-", 1)[1]], args) for e in ENGINES}
    rows = []
    for kind in ("f32", "q8_0"):
        ours, peer = results[f"poly-{kind}"], results[f"llama-{kind}"]
        same = sum(a == b for a, b in zip(ours["tokens"], peer["tokens"]))
        rows.append({"file": kind, "poly_prefill": ours["prefill_tok_s"],
                     "llama_prefill": peer["prefill_tok_s"],
                     "prefill_ratio": ours["prefill_tok_s"] / peer["prefill_tok_s"],
                     "poly_decode": ours["decode_tok_s"], "llama_decode": peer["decode_tok_s"],
                     "decode_ratio": ours["decode_tok_s"] / peer["decode_tok_s"],
                     "same_tokens": f"{same}/{args.new}"})  # fmt: skip
    report = {"model": DIMS, "runs": args.runs, "new": args.new, "threads": args.threads,
              "seconds": time.perf_counter() - t0, "rows": rows}  # fmt: skip
    text = json.dumps(report, indent=2)
    if args.json:
        from entity.atomic import atomic_output

        with atomic_output(args.json, force=True) as f:  # temp, fsync, rename
            f.write(text.encode())
    print(text)


if __name__ == "__main__":
    main()

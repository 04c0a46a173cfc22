"""`lucy serve` under concurrent load: 8 streaming greedy requests vs one stream.

Starts `lucy serve MODEL` on a free loopback port (or measures an already running
OpenAI-compatible server with --url, e.g. llama.cpp's `llama-server --parallel 8`), then:
1. each prompt alone, one after another (streamed): time to first token (TTFT), decode tok/s,
   and the text (the reference);
2. all prompts at once, one thread each: aggregate decode tok/s (tokens after the first, summed,
   over the span from the earliest first token to the last token), TTFT of each;
3. whether every concurrent text equals its solo text (greedy: it must).

    python -m benchmarks.serve_bench [MODEL] [--n 8] [--new 64] [--rounds 2] [--json out.json]
    python -m benchmarks.serve_bench --url http://127.0.0.1:8080 --model-name x   # another server
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village",
    "def fibonacci(n):",
    "Hello, my name is",
    "The best way to learn a language is",
    "1, 2, 3, 4,",
    "In the year 2050, cities will",
    "Water boils at",
    "The three primary colors are",
    "My favourite recipe for bread",
    "import numpy as np",
    "Dear hiring manager,",
    "The planets of the solar system are",
    "A haiku about winter:",
    "Step 1: preheat the oven",
    "The history of the internet began",
]


def one_stream(client, model: str, prompt: str, new: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    text, n = [], 0
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=new, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    for chunk in stream:
        if not chunk.choices:
            continue
        now = time.perf_counter()
        first = first if first is not None else now
        last = now
        text.append(chunk.choices[0].text)
        n += 1
    return {"t0": t0, "first": first, "last": last, "chunks": n, "text": "".join(text)}


def _decode_rate(runs: list[dict]) -> float:
    tokens = sum(r["chunks"] - 1 for r in runs)
    span = max(r["last"] for r in runs) - min(r["first"] for r in runs)
    return tokens / span if span > 0 else 0.0


def measure(client, model: str, n: int, new: int) -> dict:
    prompts = PROMPTS[:n]
    solo = [one_stream(client, model, p, new) for p in prompts]
    with ThreadPoolExecutor(n) as pool:
        together = list(pool.map(lambda p: one_stream(client, model, p, new), prompts))
    return {
        "single_decode_tok_s": statistics.median(_decode_rate([r]) for r in solo),
        "single_ttft_s": statistics.median(r["first"] - r["t0"] for r in solo),
        "concurrent_decode_tok_s": _decode_rate(together),
        "concurrent_ttft_s_median": statistics.median(r["first"] - r["t0"] for r in together),
        "concurrent_ttft_s_max": max(r["first"] - r["t0"] for r in together),
        "tokens_per_stream": [r["chunks"] for r in together],
        "same_text_as_alone": [a["text"] == b["text"] for a, b in zip(solo, together)],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="model for lucy serve (default: SmolLM2 GGUF)")
    ap.add_argument("--url", help="measure this running server instead of starting lucy serve")
    ap.add_argument("--model-name", default=None, help="the model id to send (with --url)")
    ap.add_argument("--n", type=int, default=8, help="concurrent requests")
    ap.add_argument("--new", type=int, default=64, help="tokens per request")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import openai

    from tests.serve_helpers import KEY, running_server

    def run(base: str, name: str) -> list[dict]:
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=900)
        one_stream(client, name, PROMPTS[0], 4)  # warm-up
        return [measure(client, name, args.n, args.new) for _ in range(args.rounds)]

    if args.url:
        rounds = run(args.url.rstrip("/"), args.model_name or "model")
    else:
        if args.model is None:
            from entity.smollm2 import ensure_smollm2

            args.model = str(ensure_smollm2())
        with running_server(args.model, "--max-batch", str(max(args.n, 1))) as (base, _):
            rounds = run(base, Path(args.model).name.removesuffix(".gguf").removesuffix(".entity"))
    best = max(rounds, key=lambda r: r["concurrent_decode_tok_s"])
    summary = {
        "n": args.n,
        "new": args.new,
        "rounds": rounds,
        "speedup_best": best["concurrent_decode_tok_s"] / max(best["single_decode_tok_s"], 1e-9),
    }
    for i, r in enumerate(rounds):
        print(f"round {i}: single {r['single_decode_tok_s']:.1f} tok/s (TTFT "
              f"{r['single_ttft_s'] * 1000:.0f} ms) | {args.n} concurrent "
              f"{r['concurrent_decode_tok_s']:.1f} tok/s aggregate (TTFT median "
              f"{r['concurrent_ttft_s_median'] * 1000:.0f} ms, max "
              f"{r['concurrent_ttft_s_max'] * 1000:.0f} ms) | same text as alone: "
              f"{sum(r['same_text_as_alone'])}/{args.n}")  # fmt: skip
    print(f"aggregate / single: {summary['speedup_best']:.2f}x")
    if args.json:
        tmp = Path(args.json + ".tmp")
        tmp.write_text(json.dumps(summary, indent=1))
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

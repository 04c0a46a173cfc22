"""`lucy serve` under concurrent load: 8 streaming greedy requests vs one stream.

Starts `lucy serve MODEL` on a free loopback port (or measures an already running
OpenAI-compatible server with --url, e.g. llama.cpp's `llama-server --parallel 8`), then:
1. each prompt alone, one after another (streamed): time to first token (TTFT), decode tok/s,
   and the text (the reference);
2. all prompts at once, one thread each: aggregate decode tok/s (tokens after the first, summed,
   over the span from the earliest first token to the last token), TTFT of each;
3. whether every concurrent text equals its solo text (greedy: it must).
With --prefix-tokens N: TTFT of a chat request with an N-token system prompt, then of a second
one sharing it (its KV pages come from the prefix cache), and whether the outputs match a
cold run. With --memory: 16 concurrent 100-token prompts under `--ctx 8192`, /metrics sampled
while all 16 run (KV bytes in use vs the live tokens' need, RSS).

    python -m benchmarks.serve_bench [MODEL] [--n 8] [--new 64] [--rounds 2] [--json out.json]
        [--client raw|openai]   # the streaming client of the rounds (default raw: httpx + json)
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


class RawClient:
    """Streamed completions over the standard library's http.client and json: the openai client
    builds a pydantic model per chunk, and 8 client threads doing that shared the 2 cores with
    the server under test. The same wire requests, lighter parsing."""

    def __init__(self, base_url: str, api_key: str):
        from urllib.parse import urlsplit

        u = urlsplit(base_url)
        self.host, self.port, self.path = u.hostname, u.port or 80, u.path.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}

    def texts(self, model: str, prompt, new: int):
        import http.client

        body = {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0,
                "stream": True, "ignore_eos": True}  # fmt: skip
        conn = http.client.HTTPConnection(self.host, self.port, timeout=900)
        try:
            conn.request("POST", self.path + "/completions", json.dumps(body), self.headers)
            r = conn.getresponse()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices")
                if choices:
                    yield choices[0].get("text") or ""
        finally:
            conn.close()


def _texts(client, model: str, prompt, new: int):
    if isinstance(client, RawClient):
        yield from client.texts(model, prompt, new)
        return
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=new, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    for chunk in stream:
        if chunk.choices:
            yield chunk.choices[0].text


def one_stream(client, model: str, prompt: str, new: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    text, n = [], 0
    for piece in _texts(client, model, prompt, new):
        now = time.perf_counter()
        first = first if first is not None else now
        last = now
        text.append(piece)
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


def _ttft(client, model, messages, new=8):
    t0 = time.perf_counter()
    s = client.chat.completions.create(model=model, messages=messages, max_tokens=new,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})  # fmt: skip
    first, text, usage = None, [], None
    for c in s:
        if c.choices and c.choices[0].delta.content and first is None:
            first = time.perf_counter()  # the first token (the first chunk only carries the role)
        if c.choices:
            text.append(c.choices[0].delta.content or "")
        usage = c.usage or usage
    return first - t0, "".join(text), usage


def prefix_reuse(client, model, n_tokens: int) -> dict:
    system = " ".join(f"Rule {i}: answer politely and briefly." for i in range(n_tokens // 8))
    msgs = [{"role": "system", "content": system}]
    cold, text_a, ua = _ttft(client, model, msgs + [{"role": "user", "content": "Hi!"}])
    warm, text_b, ub = _ttft(client, model, msgs + [{"role": "user", "content": "Hello!"}])
    cached = (ub.prompt_tokens_details.cached_tokens or 0) if ub.prompt_tokens_details else 0
    return {"prompt_tokens": ub.prompt_tokens, "cached_tokens": cached, "ttft_first_s": cold,
            "ttft_second_s": warm, "ratio": warm / cold}  # fmt: skip


def memory(base: str, client, model: str) -> dict:
    from tests.serve_helpers import metrics

    prompts = [[1000 + 7 * i + j for j in range(100)] for i in range(16)]  # 100 token ids each
    seen = {}

    def run(p):
        return one_stream(client, model, p, 160)

    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(run, p) for p in prompts]
        for _ in range(2000):
            m = metrics(base)
            if m["poly_kv_sequences"] == 16 and m["poly_kv_tokens"] >= seen.get(
                "poly_kv_tokens", 0
            ):
                seen = m
            if all(f.done() for f in futures):
                break
            time.sleep(0.05)
    per_token = seen["poly_kv_bytes_used"] / max(
        seen["poly_kv_pages_used"] * seen["poly_kv_page_size"], 1
    )
    need = seen["poly_kv_tokens"] * per_token
    return {"live_tokens": seen["poly_kv_tokens"], "kv_bytes_used": seen["poly_kv_bytes_used"],
            "kv_bytes_needed": need, "ratio": seen["poly_kv_bytes_used"] / need,
            "contiguous_16x8192_bytes": 16 * 8192 * per_token,
            "rss_mb": seen["poly_process_resident_bytes"] / 2**20}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="model for lucy serve (default: SmolLM2 GGUF)")
    ap.add_argument("--url", help="measure this running server instead of starting lucy serve")
    ap.add_argument("--model-name", default=None, help="the model id to send (with --url)")
    ap.add_argument("--n", type=int, default=8, help="concurrent requests")
    ap.add_argument("--new", type=int, default=64, help="tokens per request")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--prefix-tokens", type=int, default=0, help="also measure prefix reuse")
    ap.add_argument("--memory", action="store_true", help="only the --ctx 8192 memory scenario")
    ap.add_argument("--client", choices=("raw", "openai"), default="raw",
                    help="streaming client of the throughput rounds (raw: httpx + json)")  # fmt: skip
    args = ap.parse_args(argv)
    import openai

    from tests.serve_helpers import KEY, running_server

    def run(base: str, name: str) -> list[dict]:
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=900)
        if args.client == "raw":
            client = RawClient(base + "/v1", KEY)
        one_stream(client, name, PROMPTS[0], 4)  # warm-up: one stream, then n at once (a
        with ThreadPoolExecutor(args.n) as pool:  # server that settles per batch size does it here)
            list(pool.map(lambda p: one_stream(client, name, p, 16), PROMPTS[: args.n]))
        return [measure(client, name, args.n, args.new) for _ in range(args.rounds)]

    if args.url:
        rounds = run(args.url.rstrip("/"), args.model_name or "model")
    else:
        if args.model is None:
            from entity.smollm2 import ensure_smollm2

            args.model = str(ensure_smollm2())
        name = Path(args.model).name.removesuffix(".gguf").removesuffix(".entity")
        if args.memory:
            with running_server(args.model, "--max-batch", "16", "--ctx", "8192") as (base, _):
                c = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=900)
                print(json.dumps(memory(base, c, name), indent=1))
            return 0
        with running_server(args.model, "--max-batch", str(max(args.n, 1))) as (base, _):
            if args.prefix_tokens:
                c = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=900)
                print(json.dumps(prefix_reuse(c, name, args.prefix_tokens), indent=1))
            rounds = run(base, name) if args.rounds else []
    if not rounds:
        return 0
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

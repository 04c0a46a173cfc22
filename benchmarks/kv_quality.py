"""KV cache precision on SmolLM2-135M-Instruct (float32 weights): the KL divergence a float16 or
q8_0 cache adds against the float32 cache, by `lucy eval`'s function (poly.text.evaluate, the
float32-cache run's logits as the reference), the bytes a position costs, and decode speed at a
long context (caches filled by one float32 prefill, then converted, so every cache holds the same
positions). The fused C step reads every cache (q8_0: csrc/decode/kv_q8.h); `--reference` also
times the Python reference path. The machine's load average (`uptime`) is recorded before and
after the decode rounds.

Evaluation text: Botchan (benchmarks/quant_quality.py's, Project Gutenberg #8868).

    python -m benchmarks.kv_quality [--ctx 1024] [--windows 2] [--decode-at 4000] [--reference]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.quant_quality import eval_text, git_revision, machine

HF_DIR = Path.home() / ".cache" / "poly" / "models" / "SmolLM2-135M-Instruct-hf"
OUT = Path(__file__).parent / "results" / "kv-quality-smollm2.json"
CACHES = ("f32", "f16", "q8_0")


def kld_rows(model, tokens, ctx: int, log, caches=CACHES) -> dict:
    from poly.text.evaluate import evaluate, reference_logits

    model.kv_cache_dtype = "f32"
    t0 = time.perf_counter()
    refs = list(reference_logits(model, tokens, ctx))
    log(f"f32 cache reference: {time.perf_counter() - t0:.1f} s")
    rows = {}
    for kv in caches:
        model.kv_cache_dtype = kv
        r = evaluate(model, tokens, reference=refs, n_ctx=ctx).to_json()
        rows[kv] = {k: r[k] for k in ("tokens", "ppl", "kld_mean", "kld_stderr", "kld_p99",
                                       "kld_max", "top1")}  # fmt: skip
        log(f"{kv}: KLD {r['kld_mean']:.6f} +- {r['kld_stderr']:.6f}, top-1 {r['top1']:.4f}")
    return rows


def _fill(model, kv: str, saved: list, length: int) -> None:
    """The model's caches set to `saved` (float32 keys/values [length, kvh, hd] per layer) as a
    `kv` cache holds them."""
    from poly.nn.kvcache import live_cache, q8_quantize

    model.kv_cache_dtype = kv
    for i, (k, v) in enumerate(saved):
        c = live_cache(model.attn(i))
        if c.ks is None:
            c.k[:length], c.v[:length] = k, v
        else:
            (c.k[:length], c.ks[:length]), (c.v[:length], c.vs[:length]) = map(q8_quantize, (k, v))
        c.length = length


def decode_rows(
    model, tokens, at: int, steps: int, rounds: int, log, reference=False, synthetic=False
) -> dict:
    """Decode tok/s after `at` cached positions: per cache and path, the median of `rounds`."""
    from poly.runtime import fused

    model.kv_cache_dtype = "f32"
    model.reset()
    t0 = time.perf_counter()
    if synthetic:  # speed only: any keys/values cost the same (a loaded machine: no prefill)
        rng = np.random.default_rng(0)
        shape = (at, model.config.num_kv_heads, model.config.head_dim)
        saved = [(rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32))
                 for _ in range(model.config.num_layers)]  # fmt: skip
    else:
        for i in range(0, at, 256):
            model.forward(tokens[i : min(at, i + 256)])
        log(f"prefill {at} tokens: {time.perf_counter() - t0:.1f} s")
        saved = [(model.attn(i).state.k[:at].copy(), model.attn(i).state.v[:at].copy())
                 for i in range(model.config.num_layers)]  # fmt: skip
    cells = [(kv, "fused") for kv in CACHES] + [(kv, "reference") for kv in CACHES if reference]
    runs: dict = {f"{kv} {path}": [] for kv, path in cells}
    for _ in range(rounds):  # alternating: the load of the machine hits every cell alike
        for kv, path in cells:
            _fill(model, kv, saved, at)
            if path == "fused" and fused.plan(model) is None:
                continue
            step = model.forward if path == "fused" else model.reference_forward
            t0 = time.perf_counter()
            for t in tokens[at : at + steps]:
                step([t])
            runs[f"{kv} {path}"].append(steps / (time.perf_counter() - t0))
    rows = {}
    for name, tps in runs.items():
        if tps:
            rows[name] = {"tok_s": statistics.median(tps), "runs": tps}
            log(f"decode at {at}, {name}: {rows[name]['tok_s']:.1f} tok/s")
    return rows


def bytes_per_position(model) -> dict:
    out = {}
    for kv in CACHES:
        model.kv_cache_dtype = kv
        model.reset()
        model.forward([1])
        out[kv] = model.memory_report()["kv_cache"] / model.config.max_seq_len
    model.reset()
    return out


def _uptime() -> str:
    import subprocess

    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=HF_DIR)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--decode-at", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reference", action="store_true", help="also time the reference path")
    ap.add_argument("--kld-caches", default=",".join(CACHES), help="caches whose KLD is measured")
    ap.add_argument("--synthetic", action="store_true", help="decode over random keys/values")
    ap.add_argument("--json", type=Path, default=OUT)
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    import entity
    from poly.text.evaluate import text_tokens

    text, source = eval_text()
    model = entity.load(args.model, max_seq_len=max(args.ctx, args.decode_at + args.steps + 1))
    tokens = text_tokens(model, text)
    need = max(args.windows * args.ctx, args.decode_at + args.steps)
    if len(tokens) < need:
        raise SystemExit(f"the text has {len(tokens)} tokens, fewer than {need}")
    result = {
        "model": "SmolLM2-135M-Instruct (float32 weights)",
        "n_ctx": args.ctx,
        "windows": args.windows,
        "text": source,
        "bytes_per_position": bytes_per_position(model),
        "lucy_eval": kld_rows(
            model, tokens[: args.windows * args.ctx], args.ctx, log, args.kld_caches.split(",")
        ),
        "uptime_before": _uptime(),
        "decode": decode_rows(
            model,
            tokens,
            args.decode_at,
            args.steps,
            args.rounds,
            log,
            args.reference,
            args.synthetic,
        ),  # fmt: skip
        "uptime_after": _uptime(),
        "decode_at": args.decode_at,
        "decode_fill": "random normal keys/values" if args.synthetic else "the text's prefill",
        "machine": machine(),
        "git": git_revision(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("bytes_per_position", "lucy_eval")}, indent=1))
    print(json.dumps({k: v["tok_s"] for k, v in result["decode"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

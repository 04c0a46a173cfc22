"""Side-by-side decode/prefill speed: poly vs llama.cpp (llama-cpp-python) vs HF transformers.

Every engine lives in its own worker process (benchmarks/workers.py: its peak RSS is its own),
loads once, warms up, then the parent asks the workers for one measured run each in turn, round after round
(alternating engines, so load drifts on a shared machine hit all of them alike). Per run and
prompt: prefill seconds, then `new` greedy decode steps. Reported: medians, min-max, ratios to
every peer, peak RSS, the greedy tokens/texts and how many tokens our 4-bit paths share with our
f32 path.

    python -m benchmarks.compare [--runs 5] [--new 64] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "24")  # as `import poly` does; numpy reads it

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from benchmarks.workers import start_worker  # noqa: E402

CHAT_PROMPT = "What is the capital of France? Answer in two sentences."
ENGINES = (
    "poly-f32",
    "poly-gguf-q4_1",
    "poly-entity-q4",
    "poly-entity-q8",
    "poly-entity-f16",
    "llama-f32",
    "llama-f16",
    "llama-q4_1",
    "hf-f32",
)
WORK = Path(os.environ.get("POLY_BENCH_DIR", Path(tempfile.gettempdir()) / "poly-bench"))


# --- engines (each in its own worker process, benchmarks/workers.py) ---------------------------


def engine_spec(name: str, args) -> dict:
    """The worker spec of one of ENGINES."""
    spec = {"threads": args.threads}
    if name in ("poly-f32", "poly-gguf-q4_1"):
        spec.update(kind="poly", path=str(args.gguf), keep_quantized=name != "poly-f32")
    elif name.startswith("poly-entity-"):
        spec.update(kind="poly", path=str(WORK / f"smollm2-{name.rsplit('-', 1)[1]}.entity"))
    elif name == "llama-q4_1":
        spec.update(kind="llama", path=str(args.gguf), n_ctx=512, buffers=args.llama_buffers)
    elif name.startswith("llama-"):
        path = WORK / f"smollm2-{name.split('-')[1]}.gguf"
        spec.update(kind="llama", path=str(path), n_ctx=512, buffers=args.llama_buffers)
    else:
        spec.update(kind="hf", path=str(args.hf_dir))
    return spec


# --- parent ------------------------------------------------------------------------------------


def stale(path: Path) -> bool:
    """Missing, or older than the conversion code that writes it (formats change)."""
    import entity

    if not path.is_file():
        return True
    newest = max(f.stat().st_mtime for f in Path(entity.__file__).parent.rglob("*.py"))
    return path.stat().st_mtime < newest


def prepare(args) -> tuple[dict[str, list[int]], object]:
    """Write the F32/F16 GGUF and .entity copies once; return the token ids of both prompts."""
    import entity
    from benchmarks.gguf_export import export
    from entity.gguf.loader import load_gguf
    from lucy.bench import prompt_ids

    WORK.mkdir(parents=True, exist_ok=True)
    for kind in ("f32", "f16"):
        if not (WORK / f"smollm2-{kind}.gguf").is_file():
            export(args.gguf, WORK / f"smollm2-{kind}.gguf", kind)
    for quant in ("q4", "q8", "f16"):
        if stale(WORK / f"smollm2-{quant}.entity"):
            entity.convert(
                args.gguf, str(WORK / f"smollm2-{quant}.entity"), quant=quant, force=True
            )
    model = load_gguf(args.gguf, keep_quantized=True)
    chat = model.prompt_ids([{"role": "user", "content": CHAT_PROMPT}], chat=True)
    return {"chat": list(chat), "p128": prompt_ids(model, 128)}, model.tokenizer


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def measure(args, prompts: dict[str, list[int]]) -> dict:
    workers, warm = [], {"op": "run", "ids": prompts["chat"][:8], "new": 12}
    for name in args.engines:
        if name.startswith("hf-") and not (Path(args.hf_dir) / "config.json").is_file():
            print(f"skip {name}: no HF snapshot at {args.hf_dir}", file=sys.stderr)
            continue  # the worker would die with transformers' traceback
        spec = engine_spec(name, args)
        try:  # warm-up: weights paged in, kernels compiled, poly's thread count chosen
            workers.append(start_worker(name, spec, warm))
        except (RuntimeError, OSError) as exc:  # e.g. a llama.cpp build that crashes in decode
            print(f"skip {name}: {exc}", file=sys.stderr)
            continue
        if spec.get("buffers") == "plain":
            print(f"{name}: llama.cpp on plain weight buffers", file=sys.stderr)
    results = {w.name: {"prefill": {}, "decode": {}, "tokens": {}} for w in workers}
    for w in workers:
        if "buffers" in w.spec:  # the llama.cpp weight buffers measured
            results[w.name]["buffers"] = w.spec["buffers"]
    for run in range(args.runs):
        print(f"run {run + 1}/{args.runs} …", file=sys.stderr, flush=True)  # progress
        for key, ids in prompts.items():
            for w in workers:
                res = w.ask({"op": "run", "ids": ids, "new": args.new})
                r = results[w.name]
                r["prefill"].setdefault(key, []).append(len(ids) / res["prefill_s"])
                r["decode"].setdefault(key, []).append(args.new / res["decode_s"])
                r["tokens"][key] = res["tokens"]
    for w in workers:
        if w.name == "poly-f32":
            ids = prompts["chat"]
            one = [w.ask({"op": "batch", "ids": ids, "new": args.new, "size": 1})["tok_s"]]
            four = [w.ask({"op": "batch", "ids": ids, "new": args.new, "size": 4})["tok_s"]]
            for _ in range(args.runs - 1):
                one.append(w.ask({"op": "batch", "ids": ids, "new": args.new, "size": 1})["tok_s"])
                four.append(w.ask({"op": "batch", "ids": ids, "new": args.new, "size": 4})["tok_s"])
            results[w.name]["batch"] = {"b1": _stats(one), "b4": _stats(four)}
        w.close()
        results[w.name]["peak_rss_mb"] = w.rss
        for kind in ("prefill", "decode"):
            results[w.name][kind] = {k: _stats(v) for k, v in results[w.name][kind].items()}
    return results


def agreement(results: dict, prompt: str = "chat") -> dict[str, int]:
    base = results.get("poly-f32", {}).get("tokens", {}).get(prompt)
    if base is None:
        return {}
    out = {}
    for name, r in results.items():
        toks = r["tokens"].get(prompt, [])
        out[name] = sum(a == b for a, b in zip(base, toks))
    return out


def table(results: dict, prompts: dict[str, list[int]]) -> str:
    names = list(results)
    lines = ["| engine | prompt | prefill tok/s | decode tok/s (min-max) | peak RSS MB |"]
    lines.append("|---|---|---|---|---|")
    for name in names:
        r = results[name]
        for key in prompts:
            p, d = r["prefill"][key], r["decode"][key]
            lines.append(
                f"| {name} | {key} ({len(prompts[key])} tok) | {p['median']:.0f} | "
                f"{d['median']:.1f} ({d['min']:.1f}-{d['max']:.1f}) | {r['peak_rss_mb']:.0f} |"
            )
    lines += ["", "Decode ratios (chat prompt, median / median; rows = ours):", ""]
    peers = [n for n in names if not n.startswith("poly")]
    lines.append("| ours \\ peer | " + " | ".join(peers) + " |")
    lines.append("|---" * (len(peers) + 1) + "|")
    for name in (n for n in names if n.startswith("poly")):
        d = results[name]["decode"]["chat"]["median"]
        cells = [f"{d / results[p]['decode']['chat']['median']:.2f}x" for p in peers]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="poly vs llama.cpp vs transformers")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", nargs="*", default=list(ENGINES))
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--hf-dir", default=None)
    ap.add_argument("--llama-buffers", dest="llama_buffers", choices=("default", "plain"),
                    default="default", help="llama.cpp's weight buffers: its default (repacked "
                    "Q4_0/Q4_K/... layouts; plain if it crashes) or plain")  # fmt: skip
    ap.add_argument(
        "--json", default=None, help="write the report as JSON to this file ('-': stdout only)"
    )
    args = ap.parse_args(argv)
    if args.json == "-":  # JSON alone on stdout: the table goes to stderr
        with contextlib.redirect_stdout(sys.stderr):
            report = _run(args)
        print(json.dumps(report))
        return
    report = _run(args)
    if args.json:
        from entity.atomic import atomic_output

        with atomic_output(args.json, force=True) as f:  # temp, fsync, rename: never half a file
            f.write(json.dumps(report, indent=1).encode())


def _run(args) -> dict:
    from entity.smollm2 import ensure_smollm2

    args.gguf = args.gguf or str(ensure_smollm2())
    args.hf_dir = args.hf_dir or str(Path(args.gguf).parent / "SmolLM2-135M-Instruct-hf")
    prompts, tokenizer = prepare(args)
    results = measure(args, prompts)
    texts = {n: tokenizer.decode(r["tokens"]["chat"]) for n, r in results.items()}
    report = {
        "machine": {"cpus": os.cpu_count(), "load": os.getloadavg(), "uname": os.uname()[:3]},
        "args": vars(args),
        "prompts": prompts,
        "results": results,
        "agreement_with_poly_f32_chat": agreement(results),
        "texts_chat": texts,
    }
    print(table(results, prompts))
    print(
        "\nTokens equal to poly-f32's on the chat prompt:", report["agreement_with_poly_f32_chat"]
    )
    if "poly-f32" in results and "batch" in results["poly-f32"]:
        b = results["poly-f32"]["batch"]
        print(
            f"forward_batch f32: B=1 {b['b1']['median']:.1f} tok/s, B=4 {b['b4']['median']:.1f} "
            f"tok/s ({b['b4']['median'] / b['b1']['median']:.2f}x)"
        )
    return report


if __name__ == "__main__":
    main()

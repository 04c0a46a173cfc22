"""Speculative decoding on the real SmolLM2-135M-Instruct: plain vs --lookup vs --draft.

A code-editing prompt (a ~300-token Python function, "rename the variable x to count and return
the whole function": the answer repeats the input). Engines, each a greedy generation of up to
`--new` tokens from the same prompt ids, rounds alternating so load drifts hit all alike:

- poly f32 (the HF snapshot of the demo GGUF, dequantized): plain, lookup N, draft = the Q4_1
  GGUF of the same weights;
- poly Q4_1 GGUF: plain, lookup N;
- llama.cpp (llama-cpp-python) on the same Q4_1 GGUF: plain and its prompt-lookup decoding
  (`LlamaPromptLookupDecoding`), in a subprocess of its own (its OpenMP threads apart).

Sampling: plain greedy in every engine (no repetition penalty, no DRY: llama.cpp's engines run
temp 0, top_k 1, repeat_penalty 1.0), or with `--model-settings` poly's engines keep SmolLM2's
known-model defaults (repetition penalty 1.1 over 64 ids and DRY 0.8 on the reply,
poly.text.known_models), which make the reply copy less of the prompt.

Decode tok/s = (tokens - 1) / (last token time - first token time): the prefill and the first
token are out, the same rule for every engine. Reported: medians, ratios to plain, acceptance
rates, tokens per pass, whether the greedy tokens equal plain decoding's, and the machine's
load average before and after (the machine may be shared).

    python -m benchmarks.speculative [--rounds 5] [--new 320] [--lookup 8] [--draft-tokens 8]
        [--model-settings] [--json benchmarks/results/results-speculative-smollm2-zen3.json]
    python -m benchmarks.speculative --agreement [--new 48] [--json ...]

`--agreement`: issue 61's first point on the real model: 20 chat prompts (questions, rewrites,
code), greedy, each decoded plainly, with lookup and with the Q4_1 draft, f32 target; the
tokens must be equal.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODELS = Path.home() / ".cache" / "poly" / "models"
GGUF = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_DIR = MODELS / "SmolLM2-135M-Instruct-hf"

CODE = """def summarize(values, weights=None, label="data"):
    x = 0
    total = 0.0
    weighted = 0.0
    smallest = None
    largest = None
    for i, v in enumerate(values):
        if v is None:
            continue
        w = 1.0 if weights is None else weights[i]
        x += 1
        total += v
        weighted += w * v
        if smallest is None or v < smallest:
            smallest = v
        if largest is None or v > largest:
            largest = v
    if x == 0:
        return {"label": label, "n": 0}
    mean = total / x
    spread = 0.0
    for v in values:
        if v is not None:
            spread += (v - mean) ** 2
    return {
        "label": label,
        "n": x,
        "mean": mean,
        "weighted_mean": weighted / x,
        "min": smallest,
        "max": largest,
        "var": spread / x,
    }
"""
TASK = "Rename the variable x to count in this Python function and return the whole function.\n\n"


def prompt_ids(model) -> list[int]:
    return model.prompt_ids(TASK + "```python\n" + CODE + "```", chat=True)


def timed(events) -> tuple[list[int], float, dict | None]:
    """(tokens, decode tok/s after the first token, speculative report) of a poly stream."""
    from poly.text.generation import DoneEvent

    toks, stamps, done, cpu = [], [], None, []
    for ev in events:
        if isinstance(ev, DoneEvent):
            done = ev
        else:
            toks.append(ev.token_id)
            stamps.append(time.perf_counter())
            cpu.append(_cpu())
    rate = (len(toks) - 1) / (stamps[-1] - stamps[0]) if len(toks) > 1 else 0.0
    CPU_MS[0] = 1e3 * (cpu[-1] - cpu[0]) / (len(toks) - 1) if len(toks) > 1 else 0.0
    return toks, rate, done.speculative


CPU_MS = [0.0]  # the last poly stream's process CPU ms per decoded token (timed)


def _cpu() -> float:
    """This process's CPU seconds (all threads): on a loaded machine a steadier cost than wall
    time, which mostly measures the share of the cores the scheduler gave us."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def poly_engines(args) -> dict:
    """name -> callable() -> (tokens, tok/s, report)."""
    import entity
    import poly.text  # noqa: F401

    f32, q4 = entity.load(HF_DIR), entity.load(GGUF)
    draft = entity.load(GGUF)  # its own KV cache beside the Q4_1 target
    ids = prompt_ids(f32)
    opts = dict(temperature=0.0, max_tokens=args.new)
    if not args.model_settings:
        opts.update(repetition_penalty=1.0, dry_multiplier=0.0)  # llama.cpp's engines' greedy

    def run(model, **kw):
        return lambda: timed(model.stream(ids, **opts, **kw))

    return ids, {
        "poly-f32": run(f32),
        "poly-f32-lookup": run(f32, lookup=args.lookup),
        "poly-f32-draft-q4_1": run(f32, draft=draft, draft_tokens=args.draft_tokens),
        "poly-q4_1": run(q4),
        "poly-q4_1-lookup": run(q4, lookup=args.lookup),
    }


def llama_worker(new: int, lookup: int, threads: int) -> None:
    """One round of llama.cpp plain and prompt-lookup on the GGUF; ids on stdin, JSON out."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    ids = json.loads(sys.stdin.read())
    out = {}
    for name, draft in (("llama-q4_1", None),
                        ("llama-q4_1-lookup", LlamaPromptLookupDecoding(num_pred_tokens=lookup))):  # fmt: skip
        # a draft needs every position's logits kept (scores past n_batch otherwise: shape 0)
        llm = Llama(str(GGUF), n_ctx=2048, n_threads=threads, verbose=False, draft_model=draft,
                    logits_all=draft is not None)  # fmt: skip
        toks, stamps = [], []
        for t in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            if t == llm.token_eos() or len(toks) >= new:
                break
            toks.append(int(t))
            stamps.append(time.perf_counter())
        rate = (len(toks) - 1) / (stamps[-1] - stamps[0]) if len(toks) > 1 else 0.0
        out[name] = {"tokens": toks, "tok_s": rate}
    print(json.dumps(out))


def llama_round(ids, args) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.speculative", "--llama-worker",
           "--new", str(args.new), "--lookup", str(args.lookup), "--threads", str(args.threads)]  # fmt: skip
    res = subprocess.run(cmd, input=json.dumps(ids), capture_output=True, text=True, timeout=900)
    if res.returncode:
        raise RuntimeError(f"llama.cpp worker failed: {res.stderr.strip()[-400:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def summarize(runs: dict, reports: dict, tokens: dict, cpu: dict) -> dict:
    out = {}
    for name, rates in runs.items():
        base = name.split("-lookup")[0].split("-draft")[0]
        med = statistics.median(rates)
        row = {"tok_s_median": med, "tok_s_runs": rates, "tokens": len(tokens[name])}
        if name in cpu:  # poly engines: process CPU ms per decoded token
            row["cpu_ms_per_token_median"] = statistics.median(cpu[name])
        if base != name:
            row["speedup_vs_plain"] = med / statistics.median(runs[base])
            row["same_tokens_as_plain"] = tokens[name] == tokens[base]
            if name in cpu and base in cpu:
                row["cpu_speedup_vs_plain"] = (
                    statistics.median(cpu[base]) / row["cpu_ms_per_token_median"]
                )
        if name in reports and reports[name]:
            rep = reports[name]
            row.update({k: rep[k] for k in ("acceptance_rate", "tokens_per_pass", "mean_proposed")})
        out[name] = row
    if "llama-q4_1-lookup" in out and "poly-q4_1-lookup" in out:
        out["poly-q4_1-lookup"]["vs_llama_lookup"] = (
            out["poly-q4_1-lookup"]["tok_s_median"] / out["llama-q4_1-lookup"]["tok_s_median"]
        )
    return out


AGREEMENT_PROMPTS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Repeat exactly: the quick brown fox jumps over the lazy dog.",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "Translate to French: good morning, how are you?",
    "List the days of the week.",
    "Write a Python function that adds two numbers.",
    "Fix the grammar: she go to school every days.",
    "What is 12 times 12?",
    "Summarize: The sun is a star at the center of the solar system.",
    "Give me a recipe for pancakes.",
    "Rename the variable a to total: def f(a):\n    a = a + 1\n    return a",
    "Why is the sky blue?",
    "Write a short email asking for a meeting on Monday.",
    "Count from one to ten in words.",
    "What does HTTP stand for?",
    "Convert this list to uppercase: apple, banana, cherry.",
    "Describe a cat in one sentence.",
    'Return this JSON with the key renamed to id: {"key": 1, "name": "x"}',
)


def agreement(args) -> dict:
    """Greedy tokens of plain, lookup and draft decoding on 20 prompts (f32 target)."""
    import entity
    import poly.text  # noqa: F401

    f32, draft = entity.load(HF_DIR), entity.load(GGUF)
    opts = dict(temperature=0.0, max_tokens=args.new, repetition_penalty=1.0, dry_multiplier=0.0)
    rows = []
    for text in AGREEMENT_PROMPTS:
        ids = f32.prompt_ids(text, chat=True)
        plain = f32.generate(ids, **opts).tokens
        look = f32.generate(ids, lookup=args.lookup, **opts)
        drafted = f32.generate(ids, draft=draft, draft_tokens=args.draft_tokens, **opts)
        rows.append({"prompt": text, "tokens": len(plain),
                     "lookup_equal": look.tokens == plain, "draft_equal": drafted.tokens == plain,
                     "lookup_accepted": look.speculative["accepted"],
                     "draft_accepted": drafted.speculative["accepted"]})  # fmt: skip
        print(f"{len(rows)}/20 lookup={rows[-1]['lookup_equal']} draft={rows[-1]['draft_equal']}",
              file=sys.stderr)  # fmt: skip
    return {"benchmark": "speculative greedy agreement, 20 prompts (issue 61, acceptance 1)",
            "model": "SmolLM2-135M-Instruct f32 (draft: its Q4_1 GGUF)", "new_tokens_max": args.new,
            "all_equal": all(r["lookup_equal"] and r["draft_equal"] for r in rows),
            "prompts": rows}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=320)
    ap.add_argument("--lookup", type=int, default=8)
    ap.add_argument("--draft-tokens", dest="draft_tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument(
        "--model-settings",
        dest="model_settings",
        action="store_true",
        help="poly engines keep the model's penalties (plain greedy otherwise)",
    )
    ap.add_argument("--agreement", action="store_true", help="greedy equality on 20 prompts")
    ap.add_argument("--llama-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.llama_worker:
        return llama_worker(args.new, args.lookup, args.threads)
    if args.agreement:
        text = json.dumps(agreement(args), indent=1)
        if args.json:
            Path(args.json).write_text(text + "\n")
        return print(text)
    load0 = os.getloadavg()
    ids, engines = poly_engines(args)
    runs, reports, tokens, cpu = {}, {}, {}, {}
    for r in range(args.rounds):
        for name, fn in engines.items():
            toks, rate, rep = fn()
            runs.setdefault(name, []).append(rate)
            reports[name], tokens[name] = rep, toks
            cpu.setdefault(name, []).append(CPU_MS[0])
            print(f"round {r + 1} {name}: {rate:.1f} tok/s, {len(toks)} tokens", file=sys.stderr)
        if not args.no_llama:
            for name, row in llama_round(ids, args).items():
                runs.setdefault(name, []).append(row["tok_s"])
                tokens[name] = row["tokens"]
                print(f"round {r + 1} {name}: {row['tok_s']:.1f} tok/s", file=sys.stderr)
    result = {
        "benchmark": "speculative decoding, code edit (issue 61)",
        "model": "SmolLM2-135M-Instruct (f32: HF snapshot of the Q4_1 GGUF; Q4_1 GGUF)",
        "prompt_tokens": len(ids),
        "new_tokens_max": args.new,
        "sampling": "poly: the model's known settings (penalties), greedy"
        if args.model_settings
        else "greedy, no penalties (every engine)",
        "lookup": args.lookup,
        "draft_tokens": args.draft_tokens,
        "rounds": args.rounds,
        "llama_threads": args.threads,
        "poly_threads": "adaptive (poly.runtime.threadtune) over 2",
        "loadavg_before": load0,
        "loadavg_after": os.getloadavg(),
        "cpus": os.cpu_count(),
        "engines": summarize(runs, reports, tokens, cpu),
    }
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

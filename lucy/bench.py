"""`lucy bench`: load time, prefill and decode tok/s, peak RSS, measured on the raw forward.

Decode is greedy (argmax of the last logits) so the measured work does not depend on sampling
or on an early EOS; a warm-up pass runs first so lazy initialisation is not timed. Before it,
the first two turns' first-token seconds: one-time work left to a fresh model's first forward
shows as their gap (`first_turns`).
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from lucy.rss import peak_rss_mb
from poly.errors import UsageError

BENCH_TEXT = "Explain in one short paragraph why the sky appears blue during the day. "
WARMUP_PROMPT, WARMUP_NEW = (
    8,
    12,
)  # 12 steps: the decode thread count is chosen (poly.runtime.threadtune)


def prompt_ids(model, n: int) -> list[int]:
    """`n` token ids of ordinary text (the benchmark sentence repeated, then cut)."""
    ids = list(model.tokenizer.encode(BENCH_TEXT))
    if not ids:
        raise UsageError("the tokenizer produced no tokens for the benchmark text")
    reps = n // len(ids) + 1
    return (ids * reps)[:n]


def time_run(model, ids: list[int], new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds) for one prompt + `new_tokens` greedy steps."""
    model.reset()
    t0 = time.perf_counter()
    logits = model.forward(ids)
    t1 = time.perf_counter()
    for _ in range(new_tokens):
        logits = model.forward([int(np.argmax(logits))])
    t2 = time.perf_counter()
    model.reset()
    return t1 - t0, t2 - t1


def first_turns(model, ids: list[int]) -> dict:
    """First-token seconds (the prompt's forward and its argmax, each from a reset model) of the
    first two turns: on a freshly loaded model, one-time work left to the first forward shows
    as their gap (SmolLM2 Q4_1 before the fused plan was made at load: 0.38 s vs 0.05 s)."""
    times = []
    for _ in range(2):
        model.reset()
        t0 = time.perf_counter()
        int(np.argmax(model.forward(ids)))
        times.append(time.perf_counter() - t0)
    model.reset()
    return {"first_turn_ttft_s": times[0], "second_turn_ttft_s": times[1]}


def _check(prompt_tokens: int, new_tokens: int, runs: int, max_seq: int | None) -> None:
    if prompt_tokens < 1 or new_tokens < 1 or runs < 1:
        raise UsageError("--prompt-tokens, --new-tokens and --runs must be >= 1")
    if max_seq is not None and prompt_tokens + new_tokens > max_seq:
        raise UsageError(
            f"prompt + new tokens ({prompt_tokens + new_tokens}) exceed the context of {max_seq}"
        )


def bench_model(model, prompt_tokens: int = 64, new_tokens: int = 32, runs: int = 3) -> dict:
    """Median prefill/decode tok/s over `runs` after one warm-up pass; before it, the first two
    turns' first-token seconds (`first_turns`)."""
    _check(prompt_tokens, new_tokens, runs, getattr(model.config, "max_seq_len", None))
    ids = prompt_ids(model, prompt_tokens)
    turns = first_turns(model, ids)  # before any warm-up: what a fresh process's user waits
    time_run(model, ids[:WARMUP_PROMPT], min(WARMUP_NEW, new_tokens))
    prefill, decode = [], []
    for _ in range(runs):
        p, d = time_run(model, ids, new_tokens)
        prefill.append(prompt_tokens / p)
        decode.append(new_tokens / d)
    return {
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "runs": runs,
        "prefill_tok_s": statistics.median(prefill),
        "decode_tok_s": statistics.median(decode),
        "prefill_runs_tok_s": prefill,  # each timed run, in order (`lucy bench --plot`)
        "decode_runs_tok_s": decode,
        **turns,
        "peak_rss_mb": peak_rss_mb(),
    }


DEFAULT_LENGTHS = (16, 64, 256, 1024)  # `lucy bench --plot` without --lengths: those that fit


def sweep(model, lengths, new_tokens: int, runs: int) -> list[dict]:
    """Per prompt length L (also the context the decode runs after): median prefill tok/s of an
    L-token prompt and decode tok/s of the `new_tokens` after it (`lucy bench --lengths`).
    ``lengths`` None: the `DEFAULT_LENGTHS` within the model's context."""
    max_seq = getattr(model.config, "max_seq_len", None)
    if lengths is None:
        lengths = [n for n in DEFAULT_LENGTHS if max_seq is None or n + new_tokens <= max_seq]
    out = []
    for n in lengths:
        _check(n, new_tokens, runs, max_seq)
        ids = prompt_ids(model, n)
        times = [time_run(model, ids, new_tokens) for _ in range(runs)]
        out.append({"prompt_tokens": n,
                    "prefill_tok_s": statistics.median(n / p for p, _ in times),
                    "decode_tok_s": statistics.median(new_tokens / d for _, d in times)})  # fmt: skip
    return out


def run_bench(
    spec: str,
    prompt_tokens: int = 64,
    new_tokens: int = 32,
    runs: int = 3,
    *,
    max_experts: int | None = None,
    kv_cache: str | None = None,
    speculation: dict | None = None,
    memory: str | None = None,
    lengths: list[int] | None = None,
    sweep_lengths: bool = False,
) -> dict:
    """Load `spec` through `entity.load` (timed), then `bench_model`; an MoE model under a
    ``max_experts`` budget adds its expert-cache report ("experts"); ``kv_cache``: "f16" or
    "f32" (`Transformer.kv_cache_dtype`); ``speculation`` (the checked --lookup/--draft flags)
    adds `bench_speculative` ("speculative"); ``lengths`` (or
    ``sweep_lengths``: the default ones) adds `sweep` ("sweep")."""
    from lucy.actions import load_model, load_speculation

    _check(prompt_tokens, new_tokens, runs, None)
    t0 = time.perf_counter()
    model = load_model(spec, max_experts, kv_cache, memory=memory)
    load_s = time.perf_counter() - t0
    result = bench_model(model, prompt_tokens, new_tokens, runs)
    if lengths or sweep_lengths:
        result["sweep"] = sweep(model, lengths, new_tokens, runs)
    pager = getattr(model, "expert_pager", None)
    if pager is not None:
        result["experts"] = pager.report()
    if speculation:
        kw = load_speculation(speculation, model, kv_cache)
        ids = prompt_ids(model, prompt_tokens)
        result["speculative"] = bench_speculative(model, ids, new_tokens, runs, kw)
    return {"model": str(spec), "load_s": load_s, **result}


def bench_speculative(model, ids: list[int], new_tokens: int, runs: int, kw: dict) -> dict:
    """Greedy generations of `new_tokens` (no EOS stop), plain and speculative (``kw``: the
    generate keywords) alternating: the median decode tok/s of each, their ratio, whether the
    tokens agree, and the last speculative run's acceptance rate and tokens per pass."""
    opts = dict(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens)
    plain, spec, same, report = [], [], True, {}
    for _ in range(runs):
        a = model.generate(ids, **opts)
        b = model.generate(ids, **opts, **kw)
        plain.append(a.decode_tok_s)
        spec.append(b.decode_tok_s)
        same, report = same and a.tokens == b.tokens, b.speculative
    p, s = statistics.median(plain), statistics.median(spec)
    return {**report, "decode_tok_s": s, "plain_decode_tok_s": p,
            "speedup": s / p if p else 0.0, "same_tokens": same}  # fmt: skip


def run_compare(model: str | None, *, runs: int, as_json: bool) -> int:
    """`lucy bench --compare`: benchmarks/compare.py of this source checkout, in a subprocess
    (each engine needs its own process anyway, for its own peak RSS)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / "compare.py").is_file():
        raise UsageError("lucy bench --compare needs a source checkout (benchmarks/compare.py)")
    missing = missing_peers()
    if missing:
        raise UsageError(
            f"lucy bench --compare needs {', '.join(missing)}: pip install 'polyloom[bench,test]'"
        )
    cmd = [sys.executable, "-m", "benchmarks.compare", "--runs", str(max(runs, 1))]
    if model:
        cmd += ["--gguf", str(model)]
    if as_json:
        cmd += ["--json", "-"]
    print(
        f"running benchmarks/compare.py: poly vs llama.cpp vs transformers, {max(runs, 1)} runs "
        "(progress below, the table at the end) …",
        file=sys.stderr,
        flush=True,
    )
    return subprocess.run(cmd, cwd=root, check=False).returncode


# The peers `lucy bench --compare` measures against: import name -> pip package.
PEERS = {"llama_cpp": "llama-cpp-python", "transformers": "transformers", "torch": "torch"}


def missing_peers() -> list[str]:
    """The pip names of the peers that are not installed (found without importing them)."""
    import importlib.util

    return [pkg for mod, pkg in PEERS.items() if importlib.util.find_spec(mod) is None]

"""A prompt on each prefill path: fused calls of at most 64 rows against the reference path
(`poly/runtime/dispatch.py`), on one model file, prompts of several lengths from an empty cache.
The dispatcher's own choice is overridden per run; both paths alternate round by round in one
process (the layouts and page cache warm), medians of `--rounds`. What LONG_CONTEXT rests on.

    python -m benchmarks.prefill_paths /tmp/poly-bench/matrix/smollm2-Q8_0.gguf \
        --lengths 512 1024 2048 4096 --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a GGUF or .entity file")
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048, 4096])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache", dest="kv_cache", choices=("f32", "f16", "q8_0"), default="f16")
    ap.add_argument("--json", help="write the medians and every run here")
    args = ap.parse_args(argv)
    if min(args.lengths) < 65 or args.rounds < 1:
        ap.error("--lengths must be > 64 (one fused call below) and --rounds >= 1")

    import entity
    from benchmarks.matrix_report import parse_cpuinfo
    from poly.runtime import dispatch, kernels

    kernels.set_num_threads(args.threads)
    model = entity.load(args.model, max_seq_len=max(args.lengths) + 16)
    model.kv_cache_dtype = args.kv_cache
    real = dispatch.fused_prompt
    paths = {"fused": lambda *a: True, "reference": lambda *a: False}
    rng = np.random.default_rng(0)
    runs: dict = {}
    for n in args.lengths:
        ids = [int(i) for i in rng.integers(100, model.config.vocab_size - 100, n)]
        for r in range(args.rounds):
            for name in paths if r % 2 == 0 else reversed(paths):
                dispatch.fused_prompt = paths[name]
                model.reset()
                t0 = time.perf_counter()
                model.forward(ids)
                runs.setdefault(str(n), {}).setdefault(name, []).append(time.perf_counter() - t0)
                print(f"{n} tokens, round {r + 1}: {name} {n / runs[str(n)][name][-1]:.1f} tok/s",
                      file=sys.stderr, flush=True)  # fmt: skip
    dispatch.fused_prompt = real
    medians = {n: {p: n_tok / statistics.median(t) for p, t in v.items()}
               for n, v in runs.items() for n_tok in [int(n)]}  # fmt: skip
    print("| tokens | fused tok/s | reference tok/s | reference / fused |\n|---|---|---|---|")
    for n, m in medians.items():
        print(
            f"| {n} | {m['fused']:.1f} | {m['reference']:.1f} | {m['reference'] / m['fused']:.2f}x |"
        )
    if args.json:
        out = {
            "cpu": parse_cpuinfo(open("/proc/cpuinfo").read()),
            "args": vars(args),
            "tok_s": medians,
            "seconds": runs,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

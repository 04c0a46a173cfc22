"""poly vs llama.cpp on one GGUF file, one thread each, in CPU time (time.process_time).

    python -m benchmarks.gguf_cpu model.gguf --prompt 128 --new 32 --runs 3

CPU seconds per prefill and per decode step instead of wall time: on a machine shared with other
work the wall clock mostly measures the others, the CPU time of a one-thread run much less so
(caches are still shared). Best of --runs (the median step of each run's decode). Also prints the
first greedy tokens of both engines. POLY_ISA / POLY_ACT_Q8 apply to poly as usual. llama.cpp
runs on its default weight buffers (its repacked Q4_0/Q4_K/... layouts, as its users run it);
`--llama-buffers plain` switches them off (in this process: no fallback if llama.cpp crashes).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

CT = time.process_time


def _poly(path: Path, ids: list[int], new: int):
    from entity.gguf.loader import load_gguf
    from poly.runtime import kernels

    kernels.set_num_threads(1)
    model = load_gguf(path, keep_quantized=True, max_seq_len=len(ids) + new + 8)

    def run():
        model.reset()
        t0 = CT()
        logits = model.forward(ids)
        t1, out, steps = CT(), [], []
        for _ in range(new):
            out.append(int(np.argmax(logits)))
            a = CT()
            logits = model.forward([out[-1]])
            steps.append(CT() - a)
        return t1 - t0, statistics.median(steps), out

    return run


def _llama(path: Path, ids: list[int], new: int, buffers: str = "default"):
    import llama_cpp

    from benchmarks.workers import llama_plain_buffers

    if buffers == "plain":
        llama_plain_buffers()
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=len(ids) + new + 8, n_threads=1, n_threads_batch=1,
        n_batch=512, verbose=False,
    )  # fmt: skip

    def run():
        llm.reset()
        t0 = CT()
        llm.eval(ids)
        t1, out, steps = CT(), [], []
        for _ in range(new):
            ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
            out.append(int(np.argmax(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)))))
            a = CT()
            llm.eval([out[-1]])
            steps.append(CT() - a)
        return t1 - t0, statistics.median(steps), out

    return run


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--engines", nargs="+", default=["poly", "llama"])
    ap.add_argument("--llama-buffers", choices=["default", "plain"], default="default")
    args = ap.parse_args(argv)
    ids = [int(t) for t in np.random.default_rng(0).integers(100, 40000, args.prompt)]
    for name in args.engines:
        if name == "poly":
            run = _poly(args.gguf, ids, args.new)
        else:
            run = _llama(args.gguf, ids, args.new, args.llama_buffers)
        run()  # warm-up: pages in the weights
        res = [run() for _ in range(args.runs)]
        pf, dc = min(r[0] for r in res), min(r[1] for r in res)
        print(
            f"{name:5s} {args.gguf.name:14s} prefill {pf * 1e3:7.1f} ms ({args.prompt / pf:5.0f} tok/s)"
            f"  decode {dc * 1e3:6.2f} ms/step ({1 / dc:5.0f} tok/s)  tokens {res[-1][2][:8]}",
            flush=True,
        )


if __name__ == "__main__":
    main()

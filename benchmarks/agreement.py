"""Greedy agreement of quantized files with an f32 reference (issue 17 acceptance 2).

For each file: 64 greedy tokens on the chat prompt, compared with the f32 reference's tokens
("prefix": equal before the first difference, "equal": equal positions), and the teacher-forced
top-1 agreement (the file fed the reference's path, so one early near-tie does not decide the
rest). With --llama the same is measured for llama.cpp on the same files against its own f32
run, and ours against llama.cpp's tokens on each file: whether a greedy divergence is the
quantization (both engines diverge alike) or the engine.

    python -m benchmarks.agreement REF.gguf FILE [FILE ...] [--new 64] [--llama]
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.workers import Engine

PROMPT = "What is the capital of France? Answer in two sentences."


def greedy(engine: Engine, ids: list[int], new: int) -> list[int]:
    engine.reset()
    return engine.greedy(engine.forward(ids), new)[1]


def teacher_forced(engine: Engine, ids: list[int], path: list[int]) -> int:
    engine.reset()
    logits, agree = engine.forward(ids), 0
    for t in path:
        agree += int(np.argmax(logits)) == t
        logits = engine.forward([t])
    return agree


def compare(path: list[int], got: list[int]) -> tuple[int, int]:
    """(equal prefix, equal positions)"""
    prefix = next((i for i, (a, b) in enumerate(zip(path, got)) if a != b), len(path))
    return prefix, sum(a == b for a, b in zip(path, got))


def engines(kind: str, threads: int):
    from benchmarks.workers import LlamaEngine, PolyEngine

    if kind == "poly":
        return lambda f: PolyEngine(f, threads)
    return lambda f: LlamaEngine(f, threads, n_ctx=1024)


def main(argv: list[str] | None = None) -> None:
    import entity

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ref", help="the reference (e.g. the F32 GGUF)")
    ap.add_argument("files", nargs="+")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama", action="store_true", help="also llama.cpp (llama-cpp-python)")
    args = ap.parse_args(argv)
    ids = entity.load(args.ref).prompt_ids(PROMPT, chat=True)
    kinds = ["poly", "llama"] if args.llama else ["poly"]
    tokens: dict[tuple[str, str], list[int]] = {}
    print(f"| engine | file | prefix | equal /{args.new} | teacher-forced top-1 /{args.new} |")
    print("|---|---|---|---|---|")
    for kind in kinds:
        make = engines(kind, args.threads)
        ref = make(args.ref)
        path = tokens[(kind, args.ref)] = greedy(ref, ids, args.new)
        del ref
        for name in args.files:
            if kind == "llama" and not name.endswith(".gguf"):
                continue  # llama.cpp reads GGUF only
            e = make(name)
            got = tokens[(kind, name)] = greedy(e, ids, args.new)
            prefix, equal = compare(path, got)
            tf = teacher_forced(e, ids, path)
            print(f"| {kind} | {name} | {prefix} | {equal} | {tf} |", flush=True)
            del e
    if args.llama:
        print(f"\n| file | ours vs llama.cpp: prefix | equal /{args.new} |")
        print("|---|---|---|")
        for name in [args.ref, *args.files]:
            if ("llama", name) not in tokens:
                continue
            prefix, equal = compare(tokens[("llama", name)], tokens[("poly", name)])
            print(f"| {name} | {prefix} | {equal} |")


if __name__ == "__main__":
    main()

"""Greedy agreement of quantized files with an f32 reference engine (issue 17 acceptance 2).

For each file: 64 greedy tokens on the chat prompt, compared with the reference's tokens
("prefix": equal before the first difference, "greedy": equal positions), and the teacher-forced
top-1 agreement (both fed the reference's path, so one early near-tie does not decide the rest).

    python -m benchmarks.agreement REF.gguf FILE [FILE ...] [--new 64]
"""

from __future__ import annotations

import argparse

import numpy as np

PROMPT = "What is the capital of France? Answer in two sentences."


def greedy(model, ids: list[int], new: int) -> list[int]:
    model.reset()
    logits, out = model.forward(ids), []
    for _ in range(new):
        out.append(int(np.argmax(logits)))
        logits = model.forward([out[-1]])
    return out


def teacher_forced(model, ids: list[int], path: list[int]) -> int:
    model.reset()
    logits, agree = model.forward(ids), 0
    for t in path:
        agree += int(np.argmax(logits)) == t
        logits = model.forward([t])
    return agree


def main(argv: list[str] | None = None) -> None:
    import entity

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ref", help="the reference (e.g. the F32 GGUF)")
    ap.add_argument("files", nargs="+")
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args(argv)
    ref = entity.load(args.ref)
    ids = ref.prompt_ids(PROMPT, chat=True)
    path = greedy(ref, ids, args.new)
    print(f"| file | prefix | greedy equal /{args.new} | teacher-forced top-1 /{args.new} |")
    print("|---|---|---|---|")
    for name in args.files:
        m = entity.load(name)
        got = greedy(m, ids, args.new)
        prefix = next((i for i, (a, b) in enumerate(zip(path, got)) if a != b), args.new)
        equal = sum(a == b for a, b in zip(path, got))
        print(f"| {name} | {prefix} | {equal} | {teacher_forced(m, ids, path)} |")


if __name__ == "__main__":
    main()

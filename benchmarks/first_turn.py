"""A fresh process's first turn against its second (issue 55 item 5), A/B of two trees.

Each round starts one fresh process per tree and model file (the trees alternating, ABBA...),
which loads the model (`entity.load`, timed), then runs two chat turns from a reset model: the
prompt's forward and its argmax (the first token: `ttft`), then `--new` greedy decode steps.
Printed: medians per tree of the load, both turns' first-token seconds, their ratio, and the
time from the process's start to the first token (imports + load + first turn's first token).

    mkdir /tmp/old && git archive HEAD~1 | tar -x -C /tmp/old && cp poly/runtime/native/*.so \
        /tmp/old/poly/runtime/native/
    python -m benchmarks.first_turn MODEL.gguf MODEL.entity --a /tmp/old --b . --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.matrix_report import parse_cpuinfo

# One process: poly from the tree in POLY_AB_TREE; times from the interpreter's first line
ROUND = r"""
import time
t0 = time.perf_counter()
import json, os, sys
sys.path.insert(0, os.environ["POLY_AB_TREE"])
import numpy as np
import entity, poly
a = json.loads(sys.argv[1])
t1 = time.perf_counter()
model = entity.load(a["model"])
t2 = time.perf_counter()
out = {"import_s": t1 - t0, "load_s": t2 - t1, "poly": poly.__file__}
for turn, text in enumerate(a["prompts"], 1):
    ids = model.prompt_ids(text, chat=True)
    model.reset()
    s = time.perf_counter()
    tok = int(np.argmax(model.forward(ids)))
    e = time.perf_counter()
    for _ in range(a["new"]):
        tok = int(np.argmax(model.forward([tok])))
    out[f"turn{turn}_ttft_s"] = e - s
    out[f"turn{turn}_decode_tok_s"] = a["new"] / (time.perf_counter() - e)
out["start_to_first_token_s"] = out["import_s"] + out["load_s"] + out["turn1_ttft_s"]
out["ttft_ratio"] = out["turn1_ttft_s"] / out["turn2_ttft_s"]
print(json.dumps(out))
"""
PROMPTS = ["What is the capital of France?", "Tell me a short joke about cats."]


def one_round(tree: str, model: str, new: int) -> dict:
    env = {**os.environ, "POLY_AB_TREE": str(Path(tree).resolve())}
    job = {"model": str(Path(model).resolve()), "prompts": PROMPTS, "new": new}
    run = subprocess.run(
        [sys.executable, "-c", ROUND, json.dumps(job)],
        env=env, cwd=tree, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if run.returncode:
        raise SystemExit(f"{tree}: the round failed\n{run.stderr[-2000:]}")
    got = json.loads(run.stdout.strip().splitlines()[-1])
    if not Path(got.pop("poly")).resolve().is_relative_to(env["POLY_AB_TREE"]):
        raise SystemExit(f"{tree}: the round imported poly from elsewhere")
    return got


def medians(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="first turn vs second, fresh processes, A/B")
    ap.add_argument("models", nargs="+", help=".gguf / .entity files")
    ap.add_argument("--a", required=True, help="tree A (before)")
    ap.add_argument("--b", default=".", help="tree B (after)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new", type=int, default=16, help="decode steps per turn")
    ap.add_argument("--json", help="write the medians and every run here")
    a = ap.parse_args(argv)
    cpu = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    report = {"cpu": cpu, "cpus": os.cpu_count(), "load_start": list(os.getloadavg())}
    report.update(args=vars(a), results={})
    runs = {(m, side): [] for m in a.models for side in "AB"}
    for r in range(a.rounds):
        for m in a.models:
            for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
                runs[m, side].append(one_round(a.a if side == "A" else a.b, m, a.new))
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    report["load_end"] = list(os.getloadavg())
    print("| model | tree | load s | ttft 1 s | ttft 2 s | 1/2 | start->token s |")
    print("|---|---|---|---|---|---|---|")
    for (m, side), rs in runs.items():
        md = medians(rs)
        report["results"].setdefault(Path(m).name, {})[side] = {"median": md, "runs": rs}
        print(f"| {Path(m).name} | {side} | {md['load_s']:.3f} | {md['turn1_ttft_s']:.3f} | "
              f"{md['turn2_ttft_s']:.3f} | {md['ttft_ratio']:.2f} | "
              f"{md['start_to_first_token_s']:.3f} |")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

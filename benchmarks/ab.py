"""A/B of two builds of poly on one model file: is a change faster?

Each tree (a checkout with its extension built in place, e.g. a `git worktree` of the old
revision) runs in its own process, one process per tree and round, the trees alternating
(ABBA...), so drift in the machine's load hits both alike. A round: a warm-up, then `--reps`
timed prompts of each `--prefill` length from an empty cache and `--reps` greedy decodes of
`--new` tokens after a `--context`-token prompt. Printed: medians per tree, B/A, and the
median of the rounds' own B/A (a round's two processes ran back to back: a VM whose
processes settle at one of two speeds moves the pooled medians more than it). With
`--drop-caches` (root) the page cache is dropped first: the tree whose layout files were written
last would otherwise decode from pages the kernel holds in 2 MB folios, the faster
(docs/performance.md).

    git worktree add /tmp/old HEAD~1 && (cd /tmp/old && python setup.py build_ext --inplace)
    python -m benchmarks.ab MODEL.gguf --a /tmp/old --b . --rounds 6 --prefill 16 42 --new 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# One round in one tree: the worker imports poly from the tree given in POLY_AB_TREE
ROUND = r"""
import json, os, sys
sys.path.insert(0, os.environ["POLY_AB_TREE"])
from benchmarks.workers import PolyEngine
a = json.loads(sys.argv[1])
ctx = max([*a["prefill"], a["context"] + a["new"] + 4]) + 8
kw = {"n_ctx": ctx} if ctx > 2048 else {}  # past the loader's default context (older trees: none)
e = PolyEngine(a["model"], a["threads"], kv_cache=a["kv_cache"], **kw)
ids = lambda n: list(range(100, 100 + n))  # token ids every vocabulary has
e.prefill(ids(8)); e.decode(ids(a["context"]), 4)  # warm-up: pages in, threads chosen
out = {f"prefill {n}": [n / e.prefill(ids(n)) for _ in range(a["reps"])] for n in a["prefill"]}
if a["new"]:
    runs = [e.decode(ids(a["context"]), a["new"])[0] for _ in range(a["reps"])]
    out[f"decode {a['new']} @{a['context']}"] = [a["new"] / s for s in runs]
import poly
print(json.dumps({"poly": poly.__file__, "ops": out}))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="A/B two builds of poly on one model (tok/s)")
    ap.add_argument("model", help="a .gguf or .entity file")
    ap.add_argument("--a", default=".", help="tree A (the baseline)")
    ap.add_argument("--b", required=True, help="tree B (the change)")
    ap.add_argument("--rounds", type=int, default=6, help="processes per tree, alternating")
    ap.add_argument("--reps", type=int, default=2, help="timed runs of each op per process")
    ap.add_argument("--prefill", nargs="*", type=int, default=[16, 42])
    ap.add_argument("--new", type=int, default=64, help="decode tokens (0: no decode)")
    ap.add_argument("--context", type=int, default=16, help="prompt before the decode")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache", default="f16", choices=["f16", "f32"])
    ap.add_argument("--json", help="write every run here")
    ap.add_argument("--drop-caches", action="store_true",
                    help="drop the page cache first (root): both trees read their layout files "
                         "back from disk, not one from the pages it just wrote")  # fmt: skip
    a = ap.parse_args(argv)
    for tree in (a.a, a.b):
        if not (Path(tree) / "poly" / "__init__.py").is_file():
            ap.error(f"{tree}: not a poly checkout")
    if a.rounds < 1 or a.reps < 1 or a.context < 1 or min(a.prefill, default=1) < 1:
        ap.error("--rounds, --reps, --context and --prefill must be at least 1")
    return a


def one_round(tree: str, a: argparse.Namespace) -> dict[str, list[float]]:
    """tok/s of every op in one fresh process importing poly from `tree`."""
    job = {k: getattr(a, k) for k in ("model", "threads", "kv_cache", "reps", "prefill", "new")}
    job.update(model=str(Path(a.model).resolve()), context=a.context)
    env = {**os.environ, "POLY_AB_TREE": str(Path(tree).resolve())}
    run = subprocess.run(
        [sys.executable, "-c", ROUND, json.dumps(job)],
        env=env, cwd=tree, capture_output=True, text=True,
    )  # fmt: skip
    if run.returncode:
        raise SystemExit(f"{tree}: the round failed\n{run.stderr[-2000:]}")
    got = json.loads(run.stdout.strip().splitlines()[-1])
    if not Path(got["poly"]).resolve().is_relative_to(env["POLY_AB_TREE"]):
        raise SystemExit(f"{tree}: the round imported poly from {got['poly']}")
    return got["ops"]


def drop_caches() -> None:
    """sync, then drop the page cache: decode from mapped layouts reads files just written
    faster than the same files read back (docs/performance.md), so A/B from one state."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        raise SystemExit(f"--drop-caches: {exc.strerror} (it needs root)") from None


def paired(va: list[float], vb: list[float], reps: int) -> float:
    """The median over rounds of B's median / A's median in that round (`reps` runs a round)."""
    cut = [slice(r * reps, (r + 1) * reps) for r in range(len(va) // reps)]
    return statistics.median(statistics.median(vb[c]) / statistics.median(va[c]) for c in cut)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.drop_caches:
        drop_caches()
    runs: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
    for r in range(a.rounds):
        order = ("A", "B") if r % 2 == 0 else ("B", "A")
        for side in order:
            for op, v in one_round(a.a if side == "A" else a.b, a).items():
                runs[side].setdefault(op, []).extend(v)
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    print(f"A = {a.a}\nB = {a.b}\n")
    print("| op | A tok/s | B tok/s | B/A | B/A by round |\n|---|---|---|---|---|")
    for op, va in runs["A"].items():
        vb = runs["B"][op]
        ma, mb = statistics.median(va), statistics.median(vb)
        print(f"| {op} | {ma:.2f} | {mb:.2f} | {mb / ma:.3f} | {paired(va, vb, a.reps):.3f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

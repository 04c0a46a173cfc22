"""Where each prompt length runs on this machine: the probe of poly/runtime/crossover.py for every
length class of each model, printed as a table, kept in the CPU's tune file
($POLY_HOME/tune/<cpu>.json, what later processes read) and optionally written as a results JSON.

    python -m benchmarks.tune MODEL.gguf [MODEL.entity ...] [--rounds 3] [--json out.json]

Each model is probed `--rounds` times (fresh decisions each time); the table shows the median
fused / reference time ratio per class and each round's decision. The probe's own rounds and
budget are crossover.ROUNDS / BUDGET; on a loaded machine the ratios are noise (the load is
printed: the runtime itself never probes while other processes hold the cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.matrix_report import parse_cpuinfo


def probe_model(path: str, rounds: int) -> dict:
    import entity
    from poly.runtime import crossover, dispatch, fused, tune_cache

    model = entity.load(path)
    p = fused.plan(model)
    out: dict = {"model": path, "hidden": model.config.hidden_size, "classes": {}}
    if p is None:
        out["note"] = "no fused plan (the reference path runs every prompt)"
        return out
    out["kinds"] = crossover.entry_name(model, p, 16, 0).split("/")[2]
    for _ in range(rounds):
        for row in crossover.table(model, dispatch.shipped_rule):
            cell = out["classes"].setdefault(str(row["tokens"]), {"runs": []})
            cell["blocks"], cell["default"] = row["blocks"], row["default"]
            cell["runs"].append({k: row[k] for k in ("fused_s", "reference_s", "fused")})
    for cell in out["classes"].values():
        ratios = [r["fused_s"] / r["reference_s"] for r in cell["runs"]]
        cell["ratio_median"] = statistics.median(ratios)
    out["tune_file"] = str(tune_cache.store().path)
    return out


def render(result: dict) -> str:
    lines = []
    for m in result["models"]:
        lines.append(f"{m['model']} (hidden {m['hidden']}, blocks {m.get('kinds', '-')})")
        if m.get("note"):
            lines.append(f"  {m['note']}")
            continue
        lines.append("  tokens  blocks  fused/ref (median)  decisions         shipped rule")
        for n, c in m["classes"].items():
            votes = " ".join("fused" if r["fused"] else "ref" for r in c["runs"])
            rule = "fused" if c["default"] else "ref"
            lines.append(
                f"  {n:>6}  {c['blocks']:>6}  {c['ratio_median']:>18.2f}  {votes:<16}  {rule}"
            )
        lines.append(f"  kept in {m['tune_file']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help=".gguf / .entity / HF snapshot paths")
    ap.add_argument("--rounds", type=int, default=3, help="probes of every class per model")
    ap.add_argument(
        "--json", help="write the results here (benchmarks/results/results-tune-*.json)"
    )
    args = ap.parse_args(argv)
    from poly.runtime import ckernels, kernels

    try:
        cpu = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = {"model": "unknown", "flags": []}
    machine = {"cpu": cpu, "cpus": os.cpu_count(), "load": list(os.getloadavg())}
    machine["poly_isa"] = ckernels.info().get("isa", "none") if ckernels.AVAILABLE else "none"
    machine["threads"] = kernels.num_threads()
    t0 = time.time()
    models = [probe_model(path, args.rounds) for path in args.models]
    machine["load_after"] = list(os.getloadavg())
    result = {"machine": machine, "args": vars(args), "seconds": time.time() - t0, "models": models}
    print(f"CPU {cpu['model']} ({' '.join(cpu['flags'])}), poly ISA {machine['poly_isa']}, "
          f"{machine['threads']} threads, load {machine['load'][0]:.1f}")  # fmt: skip
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

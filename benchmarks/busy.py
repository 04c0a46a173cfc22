"""`lucy generate` on a quiet machine and with one core kept busy (issue 13). A script, not a test.

    python -m benchmarks.busy [--model X.entity] [--runs 3] [--new 64] [--json out.json]

Runs `lucy generate MODEL --chat --max-tokens N --json` (a fresh process each time: load,
prefill, decode) `--runs` times quiet, then the same with a competing process spinning on one
core (a pure-Python busy loop, bounded by `--busy-limit` seconds and stopped when the runs end),
alternating nothing else. Reports wall-clock medians and the prefill/decode split from
`--json`, with the CPU model, its SIMD flags and the load average (`uptime`) before and after.
Target: busy within 2x of quiet (docs/performance.md). The default model is the demo's
`.entity` (converted like `lucy demo` does if missing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Write a short story about a robot who learns to paint."
SPIN = "import time\nend = time.time() + {limit}\nwhile time.time() < end:\n    pass\n"
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile")


def cpu_facts() -> dict:
    model, flags = "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "?":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "flags": [f for f in FLAGS if f in flags]}


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def demo_model() -> Path:
    """The demo's .entity, converted like `lucy demo` if it is not there yet."""
    import entity
    from entity.paths import entities_dir, entity_filename
    from entity.smollm2 import DEMO_GENERATION, GGUF_NAME, ensure_smollm2, has_demo_generation

    path = entities_dir() / entity_filename(GGUF_NAME, "q4")
    if not path.exists() or not has_demo_generation(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        entity.convert(ensure_smollm2(), path, quant="q4", force=path.exists(),
                       generation=DEMO_GENERATION)  # fmt: skip
    return path


def one_run(model: Path, new: int, prompt: str, env: dict | None = None) -> dict:
    cmd = [sys.executable, "-m", "lucy", "generate", str(model), "--prompt", prompt, "--chat",
           "--max-tokens", str(new), "--json"]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"lucy generate failed: {proc.stderr.strip()}")
    out = json.loads(proc.stdout)
    return {"wall_s": wall, "prefill_s": out["prefill_s"], "decode_s": out["decode_s"],
            "tokens": len(out["tokens"]), "prompt_tokens": out["prompt_tokens"],
            "stop_reason": out["stop_reason"]}  # fmt: skip


def series(model: Path, runs: int, new: int, prompt: str, env: dict | None = None) -> dict:
    one_run(model, new, prompt, env)  # warm-up: page cache, imports
    rows = [one_run(model, new, prompt, env) for _ in range(runs)]
    med = {k: statistics.median(r[k] for r in rows) for k in ("wall_s", "prefill_s", "decode_s")}
    return {"median": med, "runs": rows, "load_after": load_average()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.busy", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--model", type=Path, default=None, help="a .entity (default: the demo's)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per series (after a warm-up)")
    ap.add_argument("--new", type=int, default=64, help="tokens to generate")
    ap.add_argument("--prompt", default=PROMPT, help="chat prompt")
    ap.add_argument("--busy-limit", type=float, default=900.0, help="competitor's max seconds")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--fixed", action="store_true",
                    help="also run busy with POLY_ADAPTIVE_THREADS=0 (the configured threads)")  # fmt: skip
    args = ap.parse_args(argv)
    model = args.model or demo_model()
    report = {**cpu_facts(), "model": str(model), "new": args.new, "prompt": args.prompt,
              "threads_env": os.environ.get("POLY_NUM_THREADS"), "load_before": load_average()}  # fmt: skip
    report["quiet"] = series(model, args.runs, args.new, args.prompt)
    spinner = subprocess.Popen([sys.executable, "-c", SPIN.format(limit=args.busy_limit)])
    try:
        time.sleep(0.5)  # the competitor is running
        report["busy"] = series(model, args.runs, args.new, args.prompt)
        if args.fixed:
            fixed = {**os.environ, "POLY_ADAPTIVE_THREADS": "0"}
            report["busy-fixed"] = series(model, args.runs, args.new, args.prompt, fixed)
    finally:
        spinner.kill()
        spinner.wait()
    q, b = report["quiet"]["median"], report["busy"]["median"]
    report["ratio"] = b["wall_s"] / q["wall_s"]
    print(f"{report['cpu']} ({report['cores']} cores; {' '.join(report['flags'])})")
    print(f"load average before: {report['load_before']}")
    for name in [k for k in ("quiet", "busy", "busy-fixed") if k in report]:
        m, r0 = report[name]["median"], report[name]["runs"][0]
        print(f"{name:10s}: {m['wall_s']:.2f} s wall (prefill {m['prefill_s']:.2f} s, decode "
              f"{m['decode_s']:.2f} s; {r0['prompt_tokens']} prompt + {r0['tokens']} new tokens, "
              f"{r0['stop_reason']}); load after {report[name]['load_after']}")  # fmt: skip
    print(f"busy / quiet: {report['ratio']:.2f}x (target <= 2x)")
    if args.json:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Generate from an MoE `.entity` with and without an expert budget, each in a fresh process, and
report peak RSS (VmHWM), tok/s, expert hit rate and bytes read per token (docs/performance.md).

    python -m benchmarks.moe_budget MODEL.entity --max-experts 32 [--new-tokens 64] [--json OUT]

The all-resident run is the reference: the budgeted run's tokens must be identical.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import json, sys, time, entity
path, budget, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
t0 = time.perf_counter()
tf = entity.load(path, max_resident_experts=None if budget == "all" else int(budget))
load_s = time.perf_counter() - t0
prompt = [5, 17, 42, 99, 123, 7, 250, 3, 64, 128, 200, 11, 33, 77, 1, 180]
done = tf.generate(prompt, max_tokens=n, min_tokens=n, temperature=0.0)
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(json.dumps({"tokens": list(done.tokens), "vmhwm_mb": int(hwm) / 1024, "load_s": load_s,
                  "prefill_tok_s": done.prefill_tok_s, "decode_tok_s": done.decode_tok_s,
                  "experts": done.experts}))
"""


def run(path: str, budget: str, new_tokens: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", CHILD, path, budget, str(new_tokens)],
                         capture_output=True, text=True, env=env, check=True)  # fmt: skip
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--max-experts", type=int, required=True)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None, help="write the report here (temp-then-rename)")
    a = ap.parse_args(argv)
    paged = run(a.model, str(a.max_experts), a.new_tokens)
    full = run(a.model, "all", a.new_tokens)
    exp = paged["experts"]
    report = {
        "model": a.model,
        "file_gb": Path(a.model).stat().st_size / 1e9,
        "max_experts": a.max_experts,
        "identical_tokens": paged["tokens"] == full["tokens"],
        "paged": {k: v for k, v in paged.items() if k != "tokens"},
        "all_resident": {k: v for k, v in full.items() if k not in ("tokens", "experts")},
        "hit_rate": exp["hit_rate"],
        "bytes_read_per_token": exp["bytes_read"] / (len(paged["tokens"]) + 16),
    }
    text = json.dumps(report, indent=2)
    if a.json:
        from entity.atomic import atomic_output

        with atomic_output(a.json, force=True) as f:  # temp, fsync, rename
            f.write(text.encode())
    print(text)


if __name__ == "__main__":
    main()

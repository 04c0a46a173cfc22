"""Peak RSS of one long prompt in fresh processes: poly opens a model file with a cache for
`--ctx` positions, runs a `--tokens`-token prompt (seeded random ids) from an empty cache, and
reports its VmHWM and VmRSS after each 512-token chunk. Each process is new (the peak is the
process's own); `--runs` of them show whether the peak is the same from run to run. The layout
cache should be warm (one open of the file before: an open that writes the layouts peaks higher).

    python -m benchmarks.long_prompt_rss /tmp/poly-bench/matrix/smollm2-Q8_0.gguf \
        --kv-cache q8_0 --ctx 10096 --tokens 8000 --runs 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.matrix_report import parse_cpuinfo

CHILD = r"""
import json, sys
import numpy as np
import entity
from poly.model import prefill
from poly.runtime import kernels
path, kv, ctx, tokens, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
kernels.set_num_threads(threads)
def mib(key):
    status = open("/proc/self/status").read()
    return int(status.split(key + ":")[1].split()[0]) / 1024
model = entity.load(path, max_seq_len=ctx)
model.kv_cache_dtype = kv
chunks, run = [], prefill.in_chunks
def traced(m, ids, step):
    def one(m, ids):
        out = step(m, ids)
        chunks.append({"position": m.position, "hwm_mib": mib("VmHWM"), "rss_mib": mib("VmRSS")})
        return out
    return run(m, ids, one)
prefill.in_chunks = traced
loaded = mib("VmHWM")
model.forward(np.random.default_rng(0).integers(100, 40000, size=tokens))
print(json.dumps({"loaded_hwm_mib": loaded, "peak_mib": mib("VmHWM"), "chunks": chunks}))
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a GGUF or .entity file")
    ap.add_argument("--kv-cache", dest="kv", choices=("float32", "float16", "q8_0"), default="q8_0")
    ap.add_argument("--ctx", type=int, default=10096, help="the cache's positions")
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write every run here")
    a = ap.parse_args(argv)
    if a.tokens >= a.ctx or a.runs < 1:
        ap.error("--tokens must be below --ctx, and --runs at least 1")
    runs = []
    for r in range(a.runs):
        args = [a.model, a.kv, str(a.ctx), str(a.tokens), str(a.threads)]
        out = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"run {r + 1} failed: {out.stderr.strip().splitlines()[-1]}")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"run {r + 1}/{a.runs}: peak {runs[-1]['peak_mib']:.0f} MiB", file=sys.stderr)
    if a.json:
        from entity.atomic import atomic_output

        cpu = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
        with atomic_output(a.json, force=True) as f:  # temp, fsync, rename: never half a file
            f.write(json.dumps({"machine": {"cpu": cpu}, "args": vars(a), "runs": runs}).encode())
    peaks = ", ".join(f"{r['peak_mib']:.0f}" for r in runs)
    print(f"peak RSS MiB: {peaks}")


if __name__ == "__main__":
    main()

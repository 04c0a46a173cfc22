"""Decode tok/s of SmolLM2's default q4 (importance-weighted Q4_0 + Q8_0 table, as
benchmarks/quant_calibrated.py writes it) against the plain `.entity` q4 (Loom Q4 + int8 head,
`calibrate=False`: the q4 before issue 59), `lucy bench` in fresh processes, alternating rounds,
medians (issue 59 acceptance 2).

    python -m benchmarks.q4_decode_ab [ROUNDS] [CALIBRATED.entity]
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import entity

HF = Path.home() / ".cache/poly/models/SmolLM2-135M-Instruct-hf"
out = Path("/tmp/q4ab")
out.mkdir(exist_ok=True)
files = {"plain-q4": out / "plain.entity", "calibrated-q4": out / "cal.entity"}
if not files["plain-q4"].exists():
    entity.convert(HF, files["plain-q4"], quant="q4", calibrate=False, force=True)
if len(sys.argv) > 2:  # quant_calibrated's q4-default (Q4_1 left out on the snapshot's blocks)
    files["calibrated-q4"] = Path(sys.argv[2])
elif not files["calibrated-q4"].exists():
    entity.convert(HF, files["calibrated-q4"], quant="q4", force=True)
res = {k: [] for k in files}
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
    for k, f in files.items():
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "lucy",
                "bench",
                str(f),
                "--runs",
                "3",
                "--prompt-tokens",
                "64",
                "--new-tokens",
                "64",
                "--json",
            ],
            capture_output=True,
            text=True,
        )
        d = json.loads(p.stdout.strip().splitlines()[-1])
        res[k].append(d["decode_tok_s"])
        print(r, k, round(d["decode_tok_s"], 2), flush=True)
print(
    json.dumps(
        {
            k: {"median": statistics.median(v), "runs": v, "bytes": files[k].stat().st_size}
            for k, v in res.items()
        }
    )
)

"""The docs' tables drawn as PNG beside them (issue 63), from the results JSON they quote, with
the same charts as `lucy eval --plot` (lucy/plots.py):

    python -m benchmarks.plot_docs [--out docs/img]

- docs/img/quantization_kld.png: mean KL divergence against bits per weight of SmolLM2's 4-bit
  files, poly's and llama.cpp's (benchmarks/results/quant-calibrated-group-smollm2.json).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lucy import plots

ROOT = Path(__file__).resolve().parents[1]
QUANT = ROOT / "benchmarks" / "results" / "quant-calibrated-group-smollm2.json"


def quantization_points(data: dict) -> list[dict]:
    """One point per file: llama.cpp's (named llama.cpp NAME) and poly's."""
    pts = [{"model": f"llama.cpp {name}", **row}
           for name, row in data["llama_cpp_files_by_lucy_eval"].items()]  # fmt: skip
    pts += [
        {"model": f"poly {name.split(' (')[0]}", **row}
        for name, row in data["files"].items()
        if "5.41" not in name
    ]  # over the Q4_0 file's size: --bpw 5.40 is the one that fits
    return [p for p in pts if p.get("bpw") is not None and p.get("kld_mean") is not None]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "img"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = json.loads(QUANT.read_text())
    fig = plots.eval_figure(quantization_points(data), "float32 " + data["model"].split(" (")[0])
    plots.save(fig, out / "quantization_kld.png")
    print(out / "quantization_kld.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Calibrated quantization on SmolLM2-135M-Instruct (issue 59): KL divergence from float32 and
bits per weight of the new default q4 (importance-weighted Q4_0 + Q8_0 embeddings) and of
`--bpw` allocations, by `lucy eval`'s function (poly.text.evaluate) on the evaluation text of
benchmarks/quant_quality.py (Botchan, from CHAPTER I), against the float32 HF snapshot.

One importance matrix and one sensitivity measurement (entity.quantize.Planner) serve every
budget. llama.cpp's own files are measured by benchmarks/quant_quality.py (same text, windows).

    python -m benchmarks.quant_calibrated [--bpw 4.5 5.0 5.41 6.22] [--windows 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

HF = Path.home() / ".cache" / "poly" / "models" / "SmolLM2-135M-Instruct-hf"
TEXT = Path.home() / ".cache" / "poly" / "eval-text" / "botchan.txt"
OUT = Path(__file__).parent / "results" / "quant-calibrated-smollm2.json"


def main(argv: list[str] | None = None) -> int:
    import entity
    from entity.quantize import Planner
    from poly.errors import UsageError
    from poly.text.evaluate import evaluate, reference_logits, text_tokens

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bpw", type=float, nargs="*", default=[4.5, 5.0, 5.41, 6.22])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--no-default", dest="default", action="store_false")
    ap.add_argument("--exclude", nargs="*", default=["Q4_1"], help="type names left out")
    ap.add_argument("--work", type=Path, default=Path("/tmp/quant-calibrated"))
    ap.add_argument("--json", type=Path, default=OUT)
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    text = TEXT.read_text(encoding="utf-8-sig")
    text = text[text.index("CHAPTER I") :]
    ref = entity.load(HF)
    tokens = text_tokens(ref, text)[: args.ctx * args.windows]
    refs = list(reference_logits(ref, tokens, args.ctx))
    t0 = time.perf_counter()
    planner = Planner(HF)
    # The snapshot is dequantized from llama.cpp's Q4_1 GGUF (tests/conftest.py): Q4_1 blocks
    # hold its matrices exactly, so Q4_1 is left out to measure quantization of unseen weights.
    planner.exclude = set(args.exclude)
    rows = {"planner_seconds": round(time.perf_counter() - t0, 1)}
    rows["excluded_types"] = sorted(planner.exclude)
    rows["floor_bpw"] = round(planner.floor_bpw(), 3)
    jobs = [("q4-default", None)] if args.default else []
    jobs += [(f"bpw-{x:g}", x) for x in args.bpw]
    for name, bpw in jobs:
        dst = args.work / f"smollm2-{name}.entity"
        t = time.perf_counter()
        try:
            rep = entity.convert(HF, dst, quant="q4", force=True, bpw=bpw, planner=planner)
        except UsageError as err:  # a budget below the smallest types
            rows[name] = {"error": str(err)}
            continue
        secs = time.perf_counter() - t
        model = entity.load(dst)
        res = evaluate(model, tokens, reference=refs, n_ctx=args.ctx, file_bytes=rep.bytes)
        kinds: dict[str, int] = {}
        for _, n, kind, _ in rep.recipe.table or []:
            kinds[kind] = kinds.get(kind, 0) + n
        rows[name] = {**res.to_json(), "bytes": rep.bytes, "convert_seconds": round(secs, 1),
                      "params_by_type": kinds}  # fmt: skip
        print(name, json.dumps(rows[name]), flush=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Decode speed per stored GGUF type, as GB/s of weights: where is a kernel short of memory speed?

A small llama-shaped model (benchmarks/synthetic_gguf.py; default 4 blocks of hidden 2048 /
FFN 8192, the 1B model's matrices, and its tied 49,152-row head) is quantized by llama.cpp's
quantizer once per type with `pure` set, so every matrix of a file is in that one type (the
presets mix in Q6_K and others). Each engine decodes each file in its own worker process,
round after round (alternating); a step reads all of a file's weight bytes, so bytes per token
x tok/s is the speed the kernel streamed them at. The plain read loop of benchmarks/matrix.py,
measured in the same run, is the ceiling.

    python -m benchmarks.kinds [--types Q4_K Q6_K Q8_0 Q4_0] [--engines poly llama] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchmarks.matrix import WORK, machine_info, progress, quantize, read_bandwidth, weight_bytes
from benchmarks.workers import Worker, start_worker

# llama_ftype whose main type each is (llama.h): quantized `pure`, every matrix takes it
TYPES = {"F16": 1, "BF16": 32, "Q8_0": 7, "Q6_K": 18, "Q5_K": 17, "Q5_0": 8, "Q5_1": 9,
         "Q4_K": 15, "Q4_0": 2, "Q4_1": 3, "IQ4_NL": 25, "IQ4_XS": 30, "Q3_K": 12, "Q2_K": 10}  # fmt: skip
DEFAULT_TYPES = ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0", "Q3_K", "Q2_K")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="decode GB/s per stored GGUF type, poly vs llama.cpp")
    ap.add_argument("--types", nargs="+", choices=list(TYPES), default=list(DEFAULT_TYPES))
    ap.add_argument("--engines", nargs="+", choices=["poly", "llama"], default=["poly", "llama"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new", type=int, default=32, help="decode tokens per run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--json", help="write every run here")
    a = ap.parse_args(argv)
    if min(a.rounds, a.new, a.threads, a.layers) < 1 or a.hidden % 256 or a.ffn % 256:
        ap.error("counts must be at least 1; --hidden and --ffn multiples of 256")
    return a


def files(a: argparse.Namespace) -> dict[str, Path]:
    """One GGUF per type, every matrix in that type, written once (WORK/kinds)."""
    from benchmarks.synthetic_gguf import write
    from entity.smollm2 import ensure_smollm2

    out = WORK / "kinds"
    out.mkdir(parents=True, exist_ok=True)
    stem = f"h{a.hidden}-l{a.layers}-f{a.ffn}"
    src = out / f"{stem}-F32.gguf"
    if not src.is_file():
        progress(f"writing {src.name}")
        write(src, ensure_smollm2(), hidden=a.hidden, layers=a.layers, ffn=a.ffn)
    got = {}
    for t in a.types:
        got[t] = out / f"{stem}-{t}.gguf"
        if not got[t].is_file():
            progress(f"quantizing to {t} (llama_model_quantize, pure)")
            quantize(src, got[t], TYPES[t], a.threads, pure=True)
    return got


def measure(paths: dict[str, Path], a: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """tok/s of every (type, engine), `--rounds` runs each, the workers taking turns."""
    ids = list(range(100, 116))  # a 16-token context: token ids every vocabulary has
    warm = {"op": "decode", "ids": ids[:8], "new": 8}
    workers: dict[tuple[str, str], Worker] = {}
    for t, path in paths.items():
        for e in a.engines:
            spec = {"kind": e, "path": str(path), "threads": a.threads}
            spec.update({"kv_cache": "f16"} if e == "poly" else {"n_ctx": 256})
            workers[(t, e)] = start_worker(f"{e} {t}", spec, warm)
    runs: dict[str, dict[str, list[float]]] = {t: {e: [] for e in a.engines} for t in paths}
    try:
        for r in range(a.rounds):
            order = list(workers) if r % 2 == 0 else list(workers)[::-1]
            for t, e in order:
                res = workers[(t, e)].ask({"op": "decode", "ids": ids, "new": a.new})
                runs[t][e].append(a.new / res["decode_s"])
            progress(f"round {r + 1}/{a.rounds}")
    finally:
        for w in workers.values():
            w.close()
    return runs


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    paths = files(a)
    bw = read_bandwidth(a.threads)
    runs = measure(paths, a)
    cpu = machine_info(a)["cpu"]
    print(f"CPU {cpu['model']}; read loop {bw / 1e9:.1f} GB/s ({a.threads} threads)\n")
    head = " | ".join(f"{e} GB/s | {e} / read loop" for e in a.engines)
    print(f"| type | MB / token | {head} |" + (" poly / llama |" if len(a.engines) == 2 else ""))
    print("|---" * (2 + 2 * len(a.engines) + (len(a.engines) == 2)) + "|")
    table = {}
    for t, per in runs.items():
        nb = weight_bytes(paths[t])
        gbs = {e: statistics.median(v) * nb / 1e9 for e, v in per.items()}
        cells = " | ".join(f"{gbs[e]:.1f} | {gbs[e] * 1e9 / bw:.2f}" for e in a.engines)
        ratio = f" {gbs['poly'] / gbs['llama']:.2f}x |" if len(gbs) == 2 else ""
        print(f"| {t} | {nb / 1e6:.0f} | {cells} |{ratio}")
        table[t] = {"bytes_per_token": nb, "gb_s": gbs, "tok_s_runs": per}
    if a.json:
        doc = {"args": vars(a), "cpu": cpu, "read_bandwidth": bw, "types": table}
        Path(a.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

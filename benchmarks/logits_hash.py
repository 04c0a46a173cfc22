"""sha256 of the raw float32 logits of every SmolLM2 matrix file: did a change alter any bit?

For a change that must not alter behaviour (a re-layout of csrc/, a rename): run it on the tree
before and after and compare the JSONs (`--check BEFORE.json` exits 1 on any difference). Files:
the matrix's GGUFs (benchmarks/matrix.py: llama.cpp's quantizer writes each preset from the F32
GGUF) and the `.entity` f16/q8/q4 converted from it. Per file, in one process per ISA build:
a fixed ~128-token prompt (prefill), 16 greedy decode steps, and one batched step of 3 sequences
(poly.runtime.batch.forward_batch), each with the f32 and the f16 KV cache. The hash covers
every logits row those return, in order; threads are fixed (the split of a reduction may depend
on them).

    python -m benchmarks.logits_hash --json benchmarks/results/logits-hash-before.json
    python -m benchmarks.logits_hash --check benchmarks/results/logits-hash-before.json
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "24")  # as `import poly` does; numpy reads it

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent.parent
TEXT = (
    "The river bends twice before it reaches the town, and at each bend the old mill stands "
    "with its wheel turning slowly in the brown water. Children from the school walk along the "
    "bank in the afternoon, counting the boats, naming the birds, and arguing about whether the "
    "heron that fishes by the bridge is the same one their parents saw years ago. In winter the "
    "water rises, the path floods, and the mill's keeper lights a lamp in the upper window so "
    "that the ferry can find the landing in the fog. Nobody remembers who first lit it."
)
PROMPT_TOKENS, DECODE_STEPS = 128, 16

# One file in one process: the ISA build is chosen at import (POLY_ISA), so each gets its own
ONE = r"""
import hashlib, json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import entity
from entity.gguf.loader import load_gguf
from poly.runtime import ckernels, kernels
from poly.runtime.batch import forward_batch
job = json.loads(sys.argv[2])
kernels.set_num_threads(job["threads"])
path, ids = job["path"], job["ids"]
model = entity.load(path) if path.endswith(".entity") else load_gguf(path, keep_quantized=True)
out = {"isa": ckernels.info().get("isa") if ckernels.AVAILABLE else "none"}
for kv in ("f32", "f16"):
    h = hashlib.sha256()
    add = lambda a: h.update(np.ascontiguousarray(a, dtype=np.float32).tobytes())
    model.kv_cache_dtype = kv
    model.reset()
    logits = model.forward(ids)
    add(logits)
    for _ in range(job["steps"]):
        logits = model.forward([int(np.argmax(logits))])
        add(logits)
    states = [model.new_state() for _ in range(3)]
    add(forward_batch(model, [ids[:40], ids[:17], ids[:64]], states))
    add(forward_batch(model, [[ids[5]], [ids[9]], [ids[11]]], states))
    out[kv] = h.hexdigest()
print(json.dumps(out))
"""


def files(precisions: list[str], threads: int) -> dict[str, Path]:
    """name -> file of every matrix cell (written on first use, as benchmarks/matrix.py does)."""
    from benchmarks.matrix import WORK, cell_files

    WORK.mkdir(parents=True, exist_ok=True)
    out = {}
    for p in precisions:
        for path in cell_files("smollm2", p, threads).values():
            out[path.name] = path
    return out


def prompt_ids() -> list[int]:
    """PROMPT_TOKENS ids of TEXT (repeated) by SmolLM2's own tokenizer (the GGUF's)."""
    from entity.gguf.loader import load_gguf
    from entity.smollm2 import ensure_smollm2

    model = load_gguf(ensure_smollm2(), keep_quantized=True)
    ids = [int(i) for i in model.prompt_ids(TEXT, chat=False)]
    while len(ids) < PROMPT_TOKENS:
        ids = ids + ids
    return ids[:PROMPT_TOKENS]


def run_one(tree: Path, path: Path, ids: list[int], isa: str, threads: int) -> dict:
    job = {"path": str(path), "ids": ids, "threads": threads, "steps": DECODE_STEPS}
    env = {**os.environ, "POLY_ISA": isa}
    run = subprocess.run(
        [sys.executable, "-c", ONE, str(tree), json.dumps(job)],
        env=env, cwd=tree, capture_output=True, text=True,
    )  # fmt: skip
    if run.returncode:
        raise SystemExit(f"{path.name} ({isa}): failed\n{run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    from benchmarks.matrix import PRECISIONS

    ap = argparse.ArgumentParser(description="sha256 of the logits of every SmolLM2 matrix file")
    ap.add_argument("--tree", default=str(HERE), help="the poly checkout to run (its extension)")
    ap.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS))
    ap.add_argument("--isas", nargs="+", default=["avx2", "base"], help="POLY_ISA values to run")
    ap.add_argument("--files", nargs="+", help="these model files instead of the matrix's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the hashes here")
    ap.add_argument("--check", help="compare with this JSON; exit 1 on any difference")
    a = ap.parse_args(argv)
    ids = prompt_ids()
    hashes: dict[str, dict] = {}
    chosen = {Path(f).name: Path(f) for f in a.files} if a.files else files(a.precisions, a.threads)
    for name, path in chosen.items():
        for isa in a.isas:
            got = run_one(Path(a.tree), path, ids, isa, a.threads)
            hashes[f"{name} {isa}"] = got
            print(f"{name:<28} {isa:<7} {got['f32'][:16]} {got['f16'][:16]} ({got['isa']})")
    if a.json:
        Path(a.json).write_text(json.dumps({"prompt_ids": ids, "hashes": hashes}, indent=1))
    if a.check:
        want = json.loads(Path(a.check).read_text())["hashes"]
        diff = sorted(k for k in set(want) | set(hashes) if want.get(k) != hashes.get(k))
        print(f"{len(hashes) - len(diff)}/{len(set(want) | set(hashes))} equal; differ: {diff}")
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Open -> first logits in a fresh process, poly vs llama.cpp (llama-cpp-python), issue 62.

Each run is one new interpreter that imports the engine, opens the model file, tokenizes a
5-token prompt with the model's own tokenizer and computes the prompt's last logits. Engines
alternate run by run (ABBA ...), medians of `--rounds`. Measured per run: seconds from the
child's first line to the logits (`open_s`), the parent's wall from spawn to exit (`process_s`:
interpreter start and teardown too), the child's CPU seconds and peak RSS (`os.wait4`'s
rusage: ru_maxrss of that child alone) and that peak past the child's RSS after its imports
(`model_rss_mb`: what the model costs, beside the file's size); for poly the phases of `poly.timing`
(POLY_PROFILE_OPEN=1: read, parse, tokenizer, verify, repack; `import` and `forward` timed here).
llama.cpp reads GGUF only: a `.entity` or an HF snapshot runs against the GGUF named with
`--peer` (its matching file). Page cache warm: every file is read once before the rounds, and
one untimed run per engine warms the layout cache (`poly.runtime.layout_cache`) and writes the
bytecode of the modules it imports, as a user's first open would.

    python -m benchmarks.open_time --rounds 5 --json benchmarks/results/results-open-time-X.json
    python -m benchmarks.open_time --files F32=/tmp/poly-bench/smollm2-f32.gguf
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
from benchmarks.workers import warm_page_cache

TREE = os.environ.get("POLY_OPEN_TREE", "")  # --tree
PROMPT = "The capital of France is"  # 5 tokens in SmolLM2's vocabulary
M = Path("/tmp/poly-bench/matrix")
HF = Path.home() / ".cache/poly/models/SmolLM2-135M-Instruct-hf"
# label -> (poly's file, llama.cpp's file)
FILES = {
    "F32 GGUF": ("/tmp/poly-bench/smollm2-f32.gguf", "/tmp/poly-bench/smollm2-f32.gguf"),
    "Q8_0 GGUF": (f"{M}/smollm2-Q8_0.gguf", f"{M}/smollm2-Q8_0.gguf"),
    "Q4_K_M GGUF": (f"{M}/smollm2-Q4_K_M.gguf", f"{M}/smollm2-Q4_K_M.gguf"),
    ".entity q8 vs Q8_0": (f"{M}/smollm2-q8.entity", f"{M}/smollm2-Q8_0.gguf"),
    "HF f32 vs F32 GGUF": (str(HF), "/tmp/poly-bench/smollm2-f32.gguf"),
}

POLY = r"""
import time
t0 = time.perf_counter()
import json, sys
import entity
try:
    from poly import timing
except ImportError:  # a tree from before the hook
    timing = type("T", (), {"PHASES": {}})
from poly.runtime import kernels
kernels.set_num_threads(int(sys.argv[2]))
t1 = time.perf_counter()
rss = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
rss_import = rss()
model = entity.load(sys.argv[1])
t2 = time.perf_counter()
ids = model.tokenizer.encode(sys.argv[3])
logits = model.forward(ids)
t3 = time.perf_counter()
out = {"open_s": t3 - t0, "n_ids": len(ids), "top": int(logits.argmax()), "poly": entity.__file__,
       "import_rss_mb": rss_import / 1024}
out["phases"] = {"import": t1 - t0, "load": t2 - t1, **timing.PHASES, "first_forward": t3 - t2}
print(json.dumps(out))
"""
LLAMA = r"""
import time
t0 = time.perf_counter()
import json, sys
import numpy as np
import llama_cpp
t1 = time.perf_counter()
rss = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
rss_import = rss()
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=512, n_threads=int(sys.argv[2]),
                      n_batch=512, verbose=False)
t2 = time.perf_counter()
ids = llm.tokenize(sys.argv[3].encode(), add_bos=False, special=False)
llm.eval(ids)
ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
logits = np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))
t3 = time.perf_counter()
out = {"open_s": t3 - t0, "n_ids": len(ids), "top": int(logits.argmax()),
       "import_rss_mb": rss_import / 1024}
out["phases"] = {"import": t1 - t0, "load": t2 - t1, "first_forward": t3 - t2}
print(json.dumps(out))
"""


def run_child(engine: str, path: str, threads: int, first: bool = False) -> dict:
    """One fresh child: its JSON line, wall, CPU seconds and peak RSS. Spawned and waited for
    with os.wait4 (subprocess reaps its own children): ru_maxrss of this child alone. `first`:
    the untimed first open, which also writes the bytecode of what it imports (__pycache__, as
    any user's first run does; llama-cpp-python's was written at install), even where the
    environment says PYTHONDONTWRITEBYTECODE."""
    env = {**os.environ, "POLY_PROFILE_OPEN": "1"}
    if first:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    if TREE:  # another checkout of poly (A/B): first on the path, before the caller's entries
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (TREE, os.environ.get("PYTHONPATH"))))
    code = POLY if engine == "poly" else LLAMA
    safe = ["-P"] if TREE else []  # -c puts the working directory first on the path, not TREE
    r, w = os.pipe()
    t0 = time.perf_counter()
    pid = os.posix_spawn(
        sys.executable, [sys.executable, *safe, "-c", code, path, str(threads), PROMPT], env,
        file_actions=[(os.POSIX_SPAWN_DUP2, w, 1), (os.POSIX_SPAWN_CLOSE, r)],
    )  # fmt: skip
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    _, status, ru = os.wait4(pid, 0)
    wall = time.perf_counter() - t0
    if status:
        raise SystemExit(f"{engine} {path}: the run failed (status {status})")
    got = json.loads(out.strip().splitlines()[-1])
    got.update(process_s=wall, cpu_s=ru.ru_utime + ru.ru_stime, peak_rss_mb=ru.ru_maxrss / 1024)
    return got


def medians(runs: list[dict]) -> dict:
    for r in runs:  # what the model costs: the peak past the interpreter and its imports
        r["model_rss_mb"] = r["peak_rss_mb"] - r["import_rss_mb"]
    keys = ("open_s", "process_s", "cpu_s", "peak_rss_mb", "model_rss_mb")
    md = {k: statistics.median(r[k] for r in runs) for k in keys}
    phases = {p for r in runs for p in r.get("phases", {})}
    md["phases"] = {p: statistics.median(r["phases"].get(p, 0.0) for r in runs) for p in phases}
    return md


def measure(label: str, ours: str, peer: str, rounds: int, threads: int) -> dict:
    warm_page_cache(ours), warm_page_cache(peer)
    run_child("poly", ours, threads, first=True)  # untimed: the layout cache written
    run_child("llama", peer, threads, first=True)
    runs = {"poly": [], "llama": []}
    for r in range(rounds):
        for eng in ("poly", "llama") if r % 2 == 0 else ("llama", "poly"):
            runs[eng].append(run_child(eng, ours if eng == "poly" else peer, threads))
    print(f"{label}: done", file=sys.stderr, flush=True)
    return {"poly_file": ours, "llama_file": peer, "medians": {e: medians(v) for e, v in runs.items()},
            "runs": runs, "file_mb": _size(ours) / 2**20}  # fmt: skip


def _size(path: str) -> int:
    """Bytes of a model file, or of a snapshot directory's weights (*.safetensors)."""
    p = Path(path)
    return (
        sum(f.stat().st_size for f in p.glob("*.safetensors")) if p.is_dir() else p.stat().st_size
    )


def table(results: dict) -> str:
    lines = ["| file | poly s | llama.cpp s | ratio | CPU s poly / llama | peak RSS MB poly / llama "
             "| past imports MB poly / llama / file |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for label, res in results.items():
        p, q = res["medians"]["poly"], res["medians"]["llama"]
        lines.append(
            f"| {label} | {p['open_s']:.2f} | {q['open_s']:.2f} | {p['open_s'] / q['open_s']:.2f}x "
            f"| {p['cpu_s']:.2f} / {q['cpu_s']:.2f} | {p['peak_rss_mb']:.0f} / {q['peak_rss_mb']:.0f} "
            f"| {p['model_rss_mb']:.0f} / {q['model_rss_mb']:.0f} / {res['file_mb']:.0f} |"
        )
    lines += [
        "",
        "poly's phases (medians, s; `load` holds read, parse, tokenizer, verify, repack):",
    ]
    for label, res in results.items():
        ph = res["medians"]["poly"]["phases"]
        lines.append(f"- {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(ph.items())))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="open -> first logits, fresh processes")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--files", nargs="*", help="LABEL=PATH[:PEER] (default: the issue's five)")
    ap.add_argument("--json", help="write medians and every run here")
    ap.add_argument("--tree", help="run poly from this checkout (a before/after A/B)")
    a = ap.parse_args(argv)
    global TREE
    TREE = str(Path(a.tree).resolve()) if a.tree else TREE
    files = FILES
    if a.files:
        files = {}
        for spec in a.files:
            label, _, paths = spec.partition("=")
            ours, _, peer = paths.partition(":")
            files[label] = (ours, peer or ours)
    report = {"cpu": parse_cpuinfo(Path("/proc/cpuinfo").read_text()), "cpus": os.cpu_count(),
              "load_start": list(os.getloadavg()), "prompt": PROMPT, "args": vars(a)}  # fmt: skip
    results = {}
    for label, (ours, peer) in files.items():
        if not Path(ours).exists() or not Path(peer).exists():
            print(f"skip {label}: {ours} or {peer} missing", file=sys.stderr)
            continue
        results[label] = measure(label, ours, peer, a.rounds, a.threads)
    report["load_end"] = list(os.getloadavg())
    report["results"] = results
    print(table(results))
    print(f"\nload average: start {report['load_start']}, end {report['load_end']}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

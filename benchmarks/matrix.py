"""The performance matrix (issue 17): poly vs llama.cpp (vs transformers on F32), side by side.

Models: SmolLM2-135M-Instruct (its F32 GGUF written from the Q4_1 file as compare.py does) and a
synthetic ~1 B llama-shaped model (benchmarks/synthetic_gguf.py). Precisions: the F32 GGUF,
llama.cpp's own quantizer (`llama_model_quantize`) making F16 ... Q2_K from it (both engines
read the same bytes), and our `.entity` f16/q8/q4 converted from the F32 GGUF (run in the cell
of F16/Q8_0/Q4_0). A cell is one (model, precision): its engines each load in their own worker
process (benchmarks/workers.py) and answer in turn, round after round (alternating, so load
drift hits all alike). Measured: prefill of each length from an empty context, then greedy
decode of `--new` tokens after a context of each length (prefilled once, not timed; each round
cuts the cache back to it, workers.py `decode`). Reported per engine: medians, load time, peak
RSS, decode as a fraction of the memory-read ceiling (weight bytes per token / read bandwidth
measured in the same run), on SmolLM2 how many of 64 greedy chat tokens equal our F32's.

    python -m benchmarks.matrix [--runs 5] [--models smollm2 synth1b synth8b] [--json out.json]
    python -m benchmarks.matrix --quick          # smoke run: SmolLM2, 1 round, short lengths
    python -m benchmarks.matrix --prepare        # only write the files (needs no quiet machine)
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "24")  # as `import poly` does; numpy reads it

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.matrix_report import decode_bytes, parse_cpuinfo, render, stats  # noqa: E402
from benchmarks.workers import Worker, start_worker, warm_page_cache  # noqa: E402

# llama_ftype of each preset (llama.h); F32 is the source file itself. The default run: the
# issue's nine; --precisions takes the other presets llama.cpp's quantizer writes too
PRECISIONS = {"F32": 0, "F16": 1, "Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q5_K_M": 17, "Q4_K_M": 15,
              "Q3_K_M": 12, "Q2_K": 10,
              "BF16": 32, "Q6_K": 18, "Q5_1": 9, "Q5_0": 8, "Q5_K_S": 16, "Q4_K_S": 14,
              "IQ4_NL": 25, "IQ4_XS": 30, "Q3_K_L": 13, "Q3_K_S": 11}  # fmt: skip
DEFAULT_PRECISIONS = tuple(PRECISIONS)[:9]
ENTITY_IN = {"F16": "f16", "Q8_0": "q8", "Q4_0": "q4"}  # .entity quant run in that GGUF's cell
AGREE_IN = ("F32", "Q8_0", "Q4_0", "Q4_1", "Q4_K_M")  # 8-bit and 4-bit cells (and the f32 base)
MODELS = ("smollm2", "synth1b", "synth8b")  # synth8b (28 GB in F32) only when asked for
ENTITY_COPY = {"smollm2": True, "synth1b": True, "synth8b": False}  # ENTITY_IN runs (not 28 GB)
CHAT_PROMPT = "What is the capital of France? Answer in two sentences."
# seconds before each request: the last engine's OpenMP/ggml threads spin a while after work
SETTLE = 0.05
QUICK = dict(runs=1, warmup=0, new=8, prefill=[16, 42], contexts=[0, 128], models=["smollm2"])
WORK = Path(os.environ.get("POLY_BENCH_DIR", "/tmp/poly-bench"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="poly vs llama.cpp vs transformers: the matrix")
    ap.add_argument("--runs", type=int, default=5, help="alternating rounds (medians)")
    ap.add_argument("--new", type=int, default=64, help="greedy decode tokens per run")
    ap.add_argument(
        "--warmup", type=int, default=1, help="untimed runs of each op per engine before its rounds"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS[:2]))
    ap.add_argument(
        "--precisions", nargs="+", choices=list(PRECISIONS), default=list(DEFAULT_PRECISIONS)
    )
    ap.add_argument("--prefill", nargs="+", type=int, default=[16, 42, 128, 512])
    ap.add_argument("--contexts", nargs="+", type=int, default=[0, 1000])
    ap.add_argument("--agree-new", type=int, default=64, help="greedy tokens compared with f32")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--no-entity", action="store_true", help="skip the .entity copies")
    ap.add_argument("--kv-cache", dest="kv_cache", choices=("f32", "f16", "q8_0"), default="f32",
                    help="poly's KV cache; q8_0: llama.cpp's too (else its default, f16)")  # fmt: skip
    ap.add_argument("--llama-buffers", dest="llama_buffers", choices=("default", "plain"),
                    default="default", help="llama.cpp's weight buffers: its default (repacked "
                    "Q4_0/Q4_K/... layouts; plain if it crashes) or plain")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="smoke run: " + json.dumps(QUICK))
    ap.add_argument("--json", default=None, help="write the report as JSON ('-': stdout only)")
    ap.add_argument(
        "--prepare", action="store_true", help="only write the model files of the cells, then exit"
    )
    args = ap.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.runs < 1 or args.new < 1 or args.threads < 1 or args.agree_new < 1:
        ap.error("--runs, --new, --threads and --agree-new must be >= 1")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    if min(args.prefill) < 1 or min(args.contexts) < 0:
        ap.error("--prefill lengths must be >= 1 and --contexts >= 0")
    args.precisions = [p for p in PRECISIONS if p in args.precisions]  # F32 first: the base
    return args


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- machine -----------------------------------------------------------------------------------


def read_bandwidth(threads: int, mb: int = 1024, reps: int = 5) -> float:
    """Bytes/s of a plain read (an OR-reduction over uint64, numpy releases the GIL) of `mb` MB
    split over `threads` threads; best of `reps`."""
    data = np.ones((mb << 20) // 8, dtype=np.uint64)
    chunks = np.array_split(data, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as ex:
        for _ in range(reps):
            t0 = time.perf_counter()
            list(ex.map(np.bitwise_or.reduce, chunks))
            best = min(best, time.perf_counter() - t0)
    return data.nbytes / best


def machine_info(args) -> dict:
    try:
        cpu = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = {"model": "unknown", "flags": []}
    info = {"cpu": cpu, "cpus": os.cpu_count(), "load": list(os.getloadavg())}
    info["uname"] = list(os.uname()[:3])
    try:
        from poly.runtime import ckernels

        isas = getattr(ckernels, "isas", None)  # runtime CPU dispatch (issue 17), when built
        if isas is None:
            info["poly_isa"] = "one build (no runtime dispatch)"
        else:
            active = ckernels.info().get("isa", "?") if ckernels.AVAILABLE else "none"
            info["poly_isa"] = f"{active} (builds here: {' '.join(isas())})"
    except ImportError:
        info["poly_isa"] = "no C kernels"
    try:
        import llama_cpp

        info["llama_cpp"] = llama_cpp.__version__
    except ImportError:
        info["llama_cpp"] = None
    return info


# --- files -------------------------------------------------------------------------------------

QUANTIZE = """import sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.nthread, p.pure = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))"""


def quantize(src: Path, dst: Path, ftype: int, threads: int, pure: bool = False) -> None:
    """llama.cpp's quantizer in a child process, its log in quantize.log (`pure`: one type)."""
    tmp = dst.with_name(dst.name + ".tmp")
    with open(dst.parent / "quantize.log", "ab") as log:
        cmd = [sys.executable, "-c", QUANTIZE, str(src), str(tmp), str(ftype), str(threads)]
        code = subprocess.run([*cmd, str(int(pure))], stdout=log, stderr=log).returncode
    if code != 0 or not tmp.is_file():
        raise RuntimeError(f"llama_model_quantize {dst.name} failed (exit {code})")
    os.replace(tmp, dst)


def source_f32(model: str) -> Path:
    """The model's F32 GGUF, written once."""
    from entity.smollm2 import ensure_smollm2

    if model == "smollm2":
        from benchmarks.gguf_export import export

        path = WORK / "smollm2-f32.gguf"  # the same file compare.py writes
        if not path.is_file():
            os.replace(export(ensure_smollm2(), path.with_name(path.name + ".tmp"), "f32"), path)
        return path
    from benchmarks.synthetic_gguf import SHAPES, parameter_count, vocab_size, write

    path = WORK / f"{model}-f32.gguf"
    if not path.is_file():
        tok = ensure_smollm2()  # the synthetic model copies its tokenizer: its vocabulary
        gb = parameter_count(vocab=vocab_size(tok), **SHAPES[model]) * 4e-9
        progress(f"writing the synthetic model {model} (F32 GGUF, ~{gb:.1f} GB)")
        write(path, tok, **SHAPES[model])
    return path


def cell_files(model: str, precision: str, threads: int, entity_copy: bool = True) -> dict:
    """The GGUF of one cell (made by llama.cpp's quantizer from the F32 GGUF) and, where this
    cell runs one, the `.entity` converted from the F32 GGUF. The F32 GGUF is written only when
    a file has to be made from it (an 8B one is 28.7 GB: its quantized files may outlive it)."""
    from benchmarks.compare import stale

    out = WORK / "matrix"
    out.mkdir(parents=True, exist_ok=True)
    if precision == "F32":
        files = {"gguf": source_f32(model)}
    else:
        files = {"gguf": out / f"{model}-{precision}.gguf"}
        if not files["gguf"].is_file():
            progress(f"quantizing {model} to {precision} (llama_model_quantize)")
            quantize(source_f32(model), files["gguf"], PRECISIONS[precision], threads)
    quant = ENTITY_IN.get(precision)
    if quant and ENTITY_COPY[model] and entity_copy:
        import entity

        files["entity"] = out / f"{model}-{quant}.entity"
        if stale(files["entity"]):
            progress(f"converting {model} to .entity {quant}")
            entity.convert(str(source_f32(model)), str(files["entity"]), quant=quant, force=True)
    return files


def weight_bytes(path: Path) -> int:
    if path.suffix == ".gguf":
        from gguf import GGUFReader

        return decode_bytes([(t.name, int(t.n_bytes)) for t in GGUFReader(str(path)).tensors])
    return path.stat().st_size  # .entity: the whole file (weights + a small header/tokenizer)


def prompts(args) -> dict:
    """Token ids (SmolLM2's tokenizer; the synthetic model copies it): ordinary text for the
    prefill/context lengths, the chat prompt for greedy agreement."""
    from entity.gguf.loader import load_gguf
    from entity.smollm2 import ensure_smollm2
    from lucy.bench import prompt_ids

    model = load_gguf(ensure_smollm2(), keep_quantized=True)
    chat = list(model.prompt_ids([{"role": "user", "content": CHAT_PROMPT}], chat=True))
    longest = max(args.prefill + args.contexts + [8])
    return {"text": prompt_ids(model, longest), "chat": chat}


# --- measuring ---------------------------------------------------------------------------------


def engine_specs(model: str, precision: str, files: dict, args) -> dict[str, dict]:
    n_ctx = max(args.prefill + [args.agree_new + 64]) + max(args.contexts) + args.new + 16
    base = {"threads": args.threads}
    ours = dict(base, kind="poly", kv_cache=args.kv_cache, n_ctx=n_ctx)
    specs = {"poly": dict(ours, path=str(files["gguf"]))}
    if "entity" in files and not args.no_entity:
        specs[f"poly-entity-{ENTITY_IN[precision]}"] = dict(ours, path=str(files["entity"]))
    llama = dict(kind="llama", path=str(files["gguf"]), n_ctx=n_ctx, buffers=args.llama_buffers,
                 kv="q8_0" if args.kv_cache == "q8_0" else "f16")  # fmt: skip
    specs["llama"] = dict(base, **llama)
    if precision == "F32" and not args.no_hf:
        specs["hf"] = dict(base, kind="hf", path=str(files["gguf"]))
    return specs


def start(specs: dict, label: str, entries: dict, ids: dict, args) -> list[Worker]:
    """Start and warm up each engine (weights paged in, poly's thread count chosen); a failed
    one gets an "error" entry and is left out. Every file is read once first: the engine started
    first would pay for a cold page cache in its load time."""
    for path in {spec["path"] for spec in specs.values()}:
        warm_page_cache(path)
    workers = []
    for name, spec in specs.items():
        try:
            w = start_worker(name, spec, {"op": "decode", "ids": ids["text"][:8], "new": 12})
        except (RuntimeError, OSError, ValueError) as exc:
            entries[name] = {"error": str(exc)}
            progress(f"{label} {name}: {exc}")
            continue
        entries[name].update(load_s=w.load_s, rss_mb=w.rss, buffers=spec.get("buffers"))
        note = f", {spec['buffers']} buffers" if spec.get("kind") == "llama" else ""
        progress(f"{label} {name}: loaded in {w.load_s:.2f} s, {w.rss:.0f} MB{note}")
        workers.append(w)
    return workers


def round_ops(args, ids: dict) -> list[tuple[str, int, dict]]:
    ops = [("prefill", n, {"op": "prefill", "ids": ids["text"][:n]}) for n in args.prefill]
    for c in args.contexts:
        req = {"op": "decode", "ids": ids["text"][: max(c, 1)], "new": args.new}
        ops.append(("decode", c, req))
    return ops


def rounds(label: str, workers: list[Worker], entries: dict, args, ids: dict) -> dict:
    """Each op: `args.warmup` untimed runs per engine (the thread tuners and caches settle on
    this op's shape), then its rounds, engines in turn; tok/s per engine, op kind and key."""
    samples: dict = {w.name: {"prefill": {}, "decode": {}} for w in workers}
    for kind, key, req in round_ops(args, ids):
        for r in range(-args.warmup, args.runs):
            parts = []
            turn = workers[r % len(workers) :] + workers[: r % len(workers)] if workers else []
            for w in turn:  # the order rotates: no engine always follows the same one
                time.sleep(SETTLE)  # the previous engine's spinning threads go to sleep first
                try:
                    res = w.ask(req)
                except RuntimeError as exc:
                    entries[w.name]["error"] = str(exc)
                    workers.remove(w)
                    continue
                if kind == "prefill":
                    tok_s = len(req["ids"]) / res["prefill_s"]
                else:
                    tok_s = args.new / res["decode_s"]
                if r >= 0:
                    samples[w.name][kind].setdefault(str(key), []).append(tok_s)
                parts.append(f"{w.name} {tok_s:.1f}")
            what = f"prefill {key}" if kind == "prefill" else f"decode @{key}"
            which = f"round {r + 1}/{args.runs}" if r >= 0 else "warm-up"
            progress(f"{label} {which} {what} tok/s: " + ", ".join(parts))
    return samples


def run_cell(model: str, precision: str, args, ids: dict, base_tokens: list | None) -> dict:
    label = f"[{model} {precision}]"
    files = cell_files(model, precision, args.threads, not args.no_entity)
    specs = engine_specs(model, precision, files, args)
    entries = {
        n: {"path": s["path"], "bytes_per_token": weight_bytes(Path(s["path"]))}
        for n, s in specs.items()
    }
    workers = start(specs, label, entries, ids, args)
    if model == "smollm2" and precision in AGREE_IN:  # our engines vs our f32, once, not timed
        for w in [w for w in workers if w.name.startswith("poly")]:
            try:
                res = w.ask({"op": "decode", "ids": ids["chat"], "new": args.agree_new})
                entries[w.name]["tokens"] = res["tokens"]
            except RuntimeError as exc:
                entries[w.name]["error"] = str(exc)
                workers.remove(w)
    samples = rounds(label, workers, entries, args, ids)
    for w in workers:
        w.close()
        entries[w.name]["rss_mb"] = w.rss
    for name, s in samples.items():
        if "error" not in entries[name]:
            for kind in ("prefill", "decode"):
                entries[name][kind] = {k: stats(v) for k, v in s[kind].items()}
        toks = entries[name].get("tokens")
        if base_tokens is not None and toks is not None:
            entries[name]["agree"] = sum(a == b for a, b in zip(base_tokens, toks))
    return {"model": model, "precision": precision, "engines": entries}


def run(args) -> dict:
    WORK.mkdir(parents=True, exist_ok=True)
    machine = machine_info(args)
    progress(f"CPU {machine['cpu']['model']}; measuring read bandwidth")
    bws = []  # before each cell and at the end: this VM's bandwidth moves during a run
    ids = prompts(args)
    cells = []
    for model in args.models:
        base = None
        for precision in args.precisions:
            bws.append(read_bandwidth(args.threads))
            cell = run_cell(model, precision, args, ids, base)
            cell["bandwidth"] = bws[-1]
            if model == "smollm2" and precision == "F32":
                base = cell["engines"].get("poly", {}).get("tokens")
                if base is not None:
                    cell["engines"]["poly"]["agree"] = len(base)
            cells.append(cell)
    machine["bandwidth_runs"] = bws + [read_bandwidth(args.threads)]
    # the rooflines' base: the median (one outlier of 11, 63.8 GB/s against 28-35, made the best
    # of them meaningless in session 22)
    machine["bandwidth"] = statistics.median(machine["bandwidth_runs"])
    machine["bandwidth_stat"] = "median"
    return {"machine": machine, "args": vars(args), "prompts": ids, "cells": cells}


def prepare(args) -> None:
    """Write every cell's files (synthetic model, quantized GGUFs, .entity copies) up front: it
    needs no quiet machine, the measuring run then starts at once."""
    WORK.mkdir(parents=True, exist_ok=True)
    for model in args.models:
        for precision in args.precisions:
            files = cell_files(model, precision, args.threads, not args.no_entity)
            progress(f"{model} {precision}: " + ", ".join(str(f) for f in files.values()))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.prepare:
        prepare(args)
        return
    if args.json == "-":  # JSON alone on stdout: the tables go to stderr
        with contextlib.redirect_stdout(sys.stderr):
            report = run(args)
            print(render(report))
        print(json.dumps(report))
        return
    report = run(args)
    print(render(report))
    if args.json:
        from entity.atomic import atomic_output

        with atomic_output(args.json, force=True) as f:  # temp, fsync, rename: never half a file
            f.write(json.dumps(report, indent=1).encode())


if __name__ == "__main__":
    main()

"""Decode speed of poly vs llama.cpp (llama-cpp-python) on the same GGUF file, for synthetic
Gemma-2-shaped and GPT-OSS-shaped models of ~0.5 B parameters (issue 58, acceptance 3).

    python -m benchmarks.family_gguf_decode [--families gemma2 gpt_oss] [--types Q8_0 Q4_K_M]
        [--prompt 96] [--tokens 32] [--rounds 5] [--threads 2] [--dir DIR] [--out JSON]

Each model: a random HF checkpoint (tests/hf_fixtures.make_tiny_checkpoint at the shapes of
SHAPES, initializer 0.02), llama.cpp's own converter to F16 (benchmarks/llama_convert.py), then
llama.cpp's quantizer (llama_model_quantize) to each type; both engines load that file. Decode:
greedy tokens after a prompt past the sliding windows, tokens per second of wall time and of the
process's CPU time (one thread by default: on a machine shared by many processes llama.cpp's
spinning thread barriers lost 20x at 2 threads, and a one-thread run's CPU time is what the
others do not take); the engines alternate for --rounds rounds and the medians are compared.
The machine's load average is recorded beside each round (the ratio is the number, not the
times).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

# ~0.5 B parameters each (vocabulary: the fixtures' small tokenizer)
SHAPES = {
    "gemma2": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=32,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                   query_pre_attn_scalar=128, sliding_window=64),
    "gpt_oss": dict(hidden_size=1024, intermediate_size=1024, num_hidden_layers=10,
                    num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                    num_local_experts=16, num_experts_per_tok=4, sliding_window=64,
                    layer_types=["sliding_attention", "full_attention"] * 5),
}  # fmt: skip
FTYPES = {"Q8_0": 7, "Q4_K_M": 15}  # llama.h LLAMA_FTYPE_MOSTLY_*


def make(family: str, types: list[str], root: Path) -> dict[str, Path]:
    """The family's GGUF file per type (made once under root)."""
    import llama_cpp

    from benchmarks.llama_convert import convert, converter_dir
    from tests.hf_fixtures import make_tiny_checkpoint
    from tests.test_families_gemma import CASES as _GEMMA  # registers gemma2's fixture config

    _ = _GEMMA
    f16 = root / f"{family}.f16.gguf"
    out = {t: root / f"{family}.{t}.gguf" for t in types}
    if all(p.is_file() for p in out.values()):
        return out
    if not f16.is_file():
        over = dict(SHAPES[family], initializer_range=0.02, max_position_embeddings=512)
        tied = family != "gpt_oss"  # llama.cpp's gpt-oss needs its own output.weight
        src = make_tiny_checkpoint(root / family, family, tied=tied, seed=1, config_overrides=over)
        convert(src, f16, "f16", converter_dir())
    for t, path in out.items():
        if not path.is_file():
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = FTYPES[t]
            params.nthread = 2
            rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(path).encode(), params)
            if rc:
                raise RuntimeError(f"llama_model_quantize {t} failed ({rc})")
    return out


def _poly(path: Path, ids: list[int], new: int, threads: int):
    from entity.gguf.loader import load_gguf
    from poly.runtime import fused, kernels

    kernels.set_backend("c")
    kernels.set_num_threads(threads)
    model = load_gguf(path, keep_quantized=True, max_seq_len=len(ids) + new + 8)
    assert fused.plan(model) is not None, "the fused step does not take this model"

    def run() -> tuple[float, list[int]]:
        model.reset()
        logits, out = model.forward(ids), []
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(new):
            out.append(int(np.argmax(logits)))
            logits = model.forward([out[-1]])
        return new / (time.perf_counter() - t0), new / (time.process_time() - c0), out

    return run


def _llama(path: Path, ids: list[int], new: int, threads: int):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(ids) + new + 8, n_threads=threads,
                          n_threads_batch=threads, n_batch=512, verbose=False)  # fmt: skip

    def run() -> tuple[float, list[int]]:
        llm.reset()
        llm.eval(ids)
        out = []
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(new):
            ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
            out.append(int(np.argmax(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)))))
            llm.eval([out[-1]])
        return new / (time.perf_counter() - t0), new / (time.process_time() - c0), out

    return run


def bench(path: Path, a) -> dict:
    ids = [int(t) for t in np.random.default_rng(0).integers(10, 250, a.prompt)]
    runs = {
        "poly": _poly(path, ids, a.tokens, a.threads),
        "llama.cpp": _llama(path, ids, a.tokens, a.threads),
    }
    for run in runs.values():
        run()  # warm-up: the weights paged in, one-time layouts made
    tok_s: dict[str, list[float]] = {k: [] for k in runs}
    cpu_s: dict[str, list[float]] = {k: [] for k in runs}
    load, first = [], {}
    for _ in range(a.rounds):
        load.append(round(os.getloadavg()[0], 2))
        for k, run in runs.items():
            v, c, toks = run()
            tok_s[k].append(round(v, 2))
            cpu_s[k].append(round(c, 2))
            first[k] = toks[:8]
    med = {k: statistics.median(v) for k, v in tok_s.items()}
    cmed = {k: statistics.median(v) for k, v in cpu_s.items()}
    return {"file": path.name, "mbytes": round(path.stat().st_size / 2**20, 1),
            "wall_tok_s": tok_s, "cpu_tok_s": cpu_s,
            "median_wall_tok_s": {k: round(v, 2) for k, v in med.items()},
            "median_cpu_tok_s": {k: round(v, 2) for k, v in cmed.items()},
            "poly_over_llama_wall": round(med["poly"] / med["llama.cpp"], 3),
            "poly_over_llama_cpu": round(cmed["poly"] / cmed["llama.cpp"], 3),
            "load_avg_1m_per_round": load, "first_tokens": first}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=list(SHAPES))
    ap.add_argument("--types", nargs="+", default=list(FTYPES))
    for name, default in (("prompt", 96), ("tokens", 32), ("rounds", 5), ("threads", 1)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache/poly/bench-families")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from benchmarks.mxfp4_moe import cpu_model
    from poly.runtime import ckernels

    a.dir.mkdir(parents=True, exist_ok=True)
    flags = open("/proc/cpuinfo").read().split("flags\t\t: ", 1)[1].split("\n", 1)[0].split()
    res = {"benchmark": "family_gguf_decode: decode tok/s, poly vs llama.cpp on one GGUF file",
           "cpu": cpu_model(), "cpu_flags": [f for f in flags if f.startswith(("avx", "fma", "f16c"))],
           "isa": ckernels.info().get("isa"), "threads": a.threads,
           "settings": {k: v for k, v in vars(a).items() if k != "dir"} | {"dir": str(a.dir)},
           "shapes": SHAPES, "uptime_before": os.popen("uptime").read().strip(), "runs": []}  # fmt: skip
    for fam in a.families:
        for t, path in make(fam, a.types, a.dir).items():
            res["runs"].append({"family": fam, "type": t, **bench(path, a)})
            print(json.dumps(res["runs"][-1]), flush=True)
    res["uptime_after"] = os.popen("uptime").read().strip()
    text = json.dumps(res, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

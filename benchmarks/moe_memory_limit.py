"""poly with an expert budget vs llama.cpp (llama-cpp-python) on one MoE GGUF inside a cgroup
memory limit smaller than the file: decode tokens/s (medians of --runs), peak memory, and poly's
expert-cache report; the same model without a limit for reference.

    python -m benchmarks.moe_memory_limit MODEL.gguf --limit 3G [--new-tokens 64] [--runs 3]
        [--threads 2] [--json benchmarks/results/moe-memory-limit-DATE.json]

Needs root and the cgroup memory controller: v1 (/sys/fs/cgroup/memory) or v2
(/sys/fs/cgroup/cgroup.controllers lists "memory"). Each run is a child process moved into a
fresh cgroup (memory.limit_in_bytes / memory.max = --limit) before it loads the model; the
file's pages are dropped from the page cache first (posix_fadvise DONTNEED on that file only),
so every run reads the model from disk as a cold start would. poly's budget is `--memory
LIMIT` (`entity.fit`: the dense part, a KV cache of --ctx tokens, the experts that fit);
llama.cpp maps the whole file (its default) and relies on the kernel's page cache; engine
"llama" runs off that mapping (use_extra_bufts off: its CPU repacked copies of the weights,
engine "llama_repack", would hold the model twice and are killed under any limit). Both run
the same token loop: a --prompt-tokens prompt, then --new-tokens decode steps fed a fixed
token sequence (a random model's greedy picks repeat one token, which would route every step
to the same experts); the argmax of each step is recorded (poly's must not depend on the limit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")

CHILD = r"""
import json, sys, time
import numpy as np
engine, path, budget, n_prompt, n_new, threads, ctx = sys.argv[1:8]
n_prompt, n_new, threads, ctx = int(n_prompt), int(n_new), int(threads), int(ctx)
prompt = [5 + (7 * i) % 400 for i in range(n_prompt)]
t0 = time.perf_counter()
if engine.startswith("llama"):
    import llama_cpp
    import llama_cpp.llama_cpp as low
    defaults = low.llama_model_default_params
    def no_repack():  # run off the mapping: the CPU repacked copies double the memory
        p = defaults()
        p.use_extra_bufts = engine == "llama_repack"
        return p
    low.llama_model_default_params = no_repack
    llm = llama_cpp.Llama(path, n_ctx=ctx, n_threads=threads, verbose=False, logits_all=True)
    def first(ids):
        llm.eval(ids)
        return llm.scores[llm.n_tokens - 1]
    step = lambda t: first([t])
else:
    import entity
    from poly.runtime import kernels
    kernels.use_threads(threads)
    kw = {} if budget == "all" else {"memory": budget}
    from lucy.actions import load_model
    tf = load_model(path, max_seq_len=ctx, **kw) if kw else load_model(path, max_seq_len=ctx)
    first = step = lambda ids: tf.forward(ids if isinstance(ids, list) else [ids])
load_s = time.perf_counter() - t0
t1 = time.perf_counter()
logits = first(prompt)
t2 = time.perf_counter()
out = []
feed = [5 + (37 * i + 11) % 500 for i in range(n_new)]  # text-like variety: a random model's
for i in range(n_new):                                   # own greedy picks repeat one token
    out.append(int(np.argmax(logits)))
    logits = step(feed[i])
t3 = time.perf_counter()
status = {l.split(":")[0]: l.split()[1] for l in open("/proc/self/status") if l.startswith("Vm")}
rep = {"load_s": load_s, "prefill_s": t2 - t1, "decode_s": t3 - t2, "tokens": out,
       "decode_tok_s": n_new / (t3 - t2), "vm_hwm": int(status["VmHWM"]) * 1024}
pager = None if engine.startswith("llama") else getattr(tf, "expert_pager", None)
rep["experts"] = None if pager is None else pager.report()
print(json.dumps(rep))
"""


def _cgroup_root() -> tuple[str, Path]:
    if (V1 / "memory.limit_in_bytes").exists():
        return "v1", V1
    if "memory" in (V2 / "cgroup.controllers").read_text().split():
        return "v2", V2
    raise SystemExit("no cgroup memory controller (v1 /sys/fs/cgroup/memory or v2 'memory')")


@contextmanager
def cgroup(limit: int | None):
    """A fresh memory cgroup with `limit` bytes (None: no cgroup); yields (procs file, peak())."""
    if limit is None:
        yield None, lambda: None
        return
    kind, root = _cgroup_root()
    path = root / f"poly_moe_bench_{os.getpid()}_{time.monotonic_ns()}"
    path.mkdir()
    try:
        if kind == "v1":
            (path / "memory.limit_in_bytes").write_text(str(limit))
            peak = path / "memory.max_usage_in_bytes"
        else:
            (path / "memory.max").write_text(str(limit))
            (path / "memory.swap.max").write_text("0")
            peak = path / "memory.peak"
        yield path / "cgroup.procs", lambda: int(peak.read_text()) if peak.exists() else None
    finally:
        for _ in range(50):  # the child has exited; its pages may take a moment to leave
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _evict(path: str) -> None:
    """This file's clean pages out of the page cache (a cold start; no global drop_caches)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_once(engine: str, model: str, limit: int | None, a) -> dict:
    _evict(model)
    budget = "all" if limit is None or engine != "poly" else str(limit)
    argv = [sys.executable, "-c", CHILD, engine, model, budget, str(a.prompt_tokens),
            str(a.new_tokens), str(a.threads), str(a.ctx)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(a.threads))
    with cgroup(limit) as (procs, peak):

        def enter() -> None:  # in the child, before exec: its memory counts from the start
            if procs is not None:
                procs.write_text(str(os.getpid()))

        res = subprocess.run(argv, env=env, capture_output=True, text=True, preexec_fn=enter,
                             timeout=a.timeout)  # fmt: skip
        if res.returncode:
            return {"error": (res.stderr.strip().splitlines() or ["killed"])[-1],
                    "returncode": res.returncode}  # fmt: skip
        out = json.loads(res.stdout.strip().splitlines()[-1])
        out["cgroup_peak"] = peak()
    return out


def _summary(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0]["error"], "runs": runs}
    med = {k: statistics.median(r[k] for r in ok) for k in ("decode_tok_s", "load_s", "prefill_s")}
    return {**med, "vm_hwm": max(r["vm_hwm"] for r in ok),
            "cgroup_peak": max((r["cgroup_peak"] or 0) for r in ok), "tokens": ok[0]["tokens"],
            "experts": ok[0]["experts"], "failed_runs": len(runs) - len(ok),
            "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs]}  # fmt: skip


def machine() -> dict:
    info = {"platform": platform.platform(), "cpus": os.cpu_count()}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            info["cpu"] = value.strip()
        if key.strip() == "flags":
            flags = set(value.split())
            info["flags"] = sorted(flags & {"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw",
                                            "avx512_vnni", "avxvnni", "bmi2"})  # fmt: skip
            break
    info["mem_total"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    info["load_average"] = os.getloadavg()  # the machine is shared: tok/s move with it
    return info


def main(argv: list[str] | None = None) -> None:
    from entity.fit import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--limit", required=True, help="cgroup memory limit, e.g. 3G")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--engines", default="poly,llama")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    limit = parse_size(a.limit, "--limit")
    result = {"model": a.model, "file_bytes": os.path.getsize(a.model), "limit": limit,
              "machine": machine(), "settings": {k: v for k, v in vars(a).items()
                                                 if k not in ("json", "model")}}  # fmt: skip
    for engine in a.engines.split(","):
        for name, lim in (("limited", limit), ("unlimited", None)):
            runs = [run_once(engine, a.model, lim, a) for _ in range(a.runs)]
            result[f"{engine}_{name}"] = _summary(runs)
            print(engine, name, {k: v for k, v in result[f"{engine}_{name}"].items()
                                 if k != "tokens"}, flush=True)  # fmt: skip
    p, q = result.get("poly_limited", {}), result.get("poly_unlimited", {})
    result["poly_identical"] = bool(p.get("tokens")) and p.get("tokens") == q.get("tokens")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

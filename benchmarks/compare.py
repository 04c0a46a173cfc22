"""Side-by-side decode/prefill speed: poly vs llama.cpp (llama-cpp-python) vs HF transformers.

Every engine lives in its own worker process (so its peak RSS is its own), loads once, warms up,
then the parent asks the workers for one measured run each in turn, round after round
(alternating engines, so load drifts on a shared machine hit all of them alike). Per run and
prompt: prefill seconds, then `new` greedy decode steps. Reported: medians, min-max, ratios to
every peer, peak RSS, the greedy tokens/texts and how many tokens our 4-bit paths share with our
f32 path.

    python -m benchmarks.compare [--runs 5] [--new 64] [--threads 2] [--json out.json]
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
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from lucy.rss import peak_rss_mb  # noqa: E402

CHAT_PROMPT = "What is the capital of France? Answer in two sentences."
ENGINES = (
    "poly-f32",
    "poly-gguf-q4_1",
    "poly-entity-q4",
    "poly-entity-q8",
    "poly-entity-f16",
    "llama-f32",
    "llama-f16",
    "llama-q4_1",
    "hf-f32",
)
WORK = Path(os.environ.get("POLY_BENCH_DIR", Path(tempfile.gettempdir()) / "poly-bench"))


# --- engines (run inside workers) --------------------------------------------------------------


class PolyEngine:
    def __init__(self, name: str, gguf: Path):
        import entity
        from entity.gguf.loader import load_gguf

        if name == "poly-f32":
            self.model = load_gguf(gguf, keep_quantized=False)
        elif name == "poly-gguf-q4_1":
            self.model = load_gguf(gguf, keep_quantized=True)
        else:
            quant = name.rsplit("-", 1)[1]
            self.model = entity.load(str(WORK / f"smollm2-{quant}.entity"))

    def run(self, ids: list[int], new: int) -> tuple[float, float, list[int]]:
        m = self.model
        m.reset()
        t0 = time.perf_counter()
        logits = m.forward(ids)
        t1 = time.perf_counter()
        out = []
        for _ in range(new):
            out.append(int(np.argmax(logits)))
            logits = m.forward([out[-1]])
        return t1 - t0, time.perf_counter() - t1, out

    def batch(self, ids: list[int], new: int, size: int) -> float:
        from poly.runtime.batch import greedy_batch

        _, seconds = greedy_batch(self.model, [ids] * size, new)
        return size * new / seconds


def _llama_plain_buffers() -> None:
    """Keep llama.cpp's weights in plain CPU buffers: its "extra" buffer types (AMX / repacked
    Q4 layouts) crash llama-cpp-python 0.3.36 in llama_decode on this VM (AMX tiles not granted
    to the guest) for the Q4_1 file. llama-cpp-python has no keyword for it, so the default
    model params are wrapped."""
    import llama_cpp
    import llama_cpp.llama as llama_mod

    if getattr(llama_cpp.llama_model_default_params, "_poly_plain", False):
        return
    original = llama_cpp.llama_model_default_params

    def plain():
        params = original()
        params.use_extra_bufts = False
        return params

    plain._poly_plain = True
    llama_cpp.llama_model_default_params = plain
    llama_mod.llama_cpp.llama_model_default_params = plain


class LlamaEngine:
    def __init__(self, name: str, gguf: Path, threads: int):
        from llama_cpp import Llama

        _llama_plain_buffers()

        path = gguf if name == "llama-q4_1" else WORK / f"smollm2-{name.split('-')[1]}.gguf"
        self.llm = Llama(
            model_path=str(path), n_ctx=512, n_threads=threads, n_batch=512, verbose=False
        )

    def last_logits(self) -> np.ndarray:
        """The last evaluated token's logits, read from the context: `llm.scores` is only
        filled with logits_all=True (which would make llama.cpp compute every prompt row)."""
        import llama_cpp

        ptr = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.llm.n_vocab(),))

    def run(self, ids: list[int], new: int) -> tuple[float, float, list[int]]:
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        out = []
        for _ in range(new):
            out.append(int(np.argmax(self.last_logits())))
            llm.eval([out[-1]])
        return t1 - t0, time.perf_counter() - t1, out


class HFEngine:
    def __init__(self, hf_dir: Path, threads: int):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()

    def run(self, ids: list[int], new: int) -> tuple[float, float, list[int]]:
        torch = self.torch
        with torch.inference_mode():
            t0 = time.perf_counter()
            res = self.model(torch.tensor([ids]), use_cache=True)
            t1 = time.perf_counter()
            out = []
            for _ in range(new):
                out.append(int(res.logits[0, -1].argmax()))
                res = self.model(
                    torch.tensor([[out[-1]]]), past_key_values=res.past_key_values, use_cache=True
                )
        return t1 - t0, time.perf_counter() - t1, out


def _make(name: str, args) -> object:
    gguf = Path(args.gguf)
    if name.startswith("poly"):
        from poly.runtime import kernels

        kernels.set_num_threads(args.threads)
        return PolyEngine(name, gguf)
    if name.startswith("llama"):
        return LlamaEngine(name, gguf, args.threads)
    return HFEngine(Path(args.hf_dir), args.threads)


def worker(name: str, args) -> None:
    """Line protocol on stdin/stdout: a JSON request per line, a JSON reply per line."""
    engine = _make(name, args)
    reply = sys.stdout
    sys.stdout = sys.stderr  # anything a library prints must not corrupt the protocol
    reply.write(json.dumps({"ready": True, "rss_mb": peak_rss_mb()}) + "\n")
    reply.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "run":
            pre, dec, toks = engine.run(req["ids"], req["new"])
            res = {"prefill_s": pre, "decode_s": dec, "tokens": toks}
        elif req["op"] == "batch":
            res = {"tok_s": engine.batch(req["ids"], req["new"], req["size"])}
        else:
            break
        res["rss_mb"] = peak_rss_mb()
        reply.write(json.dumps(res) + "\n")
        reply.flush()


# --- parent ------------------------------------------------------------------------------------


def _stale(path: Path) -> bool:
    """Missing, or older than the conversion code that writes it (formats change)."""
    import entity

    if not path.is_file():
        return True
    newest = max(f.stat().st_mtime for f in Path(entity.__file__).parent.glob("*.py"))
    return path.stat().st_mtime < newest


def prepare(args) -> tuple[dict[str, list[int]], object]:
    """Write the F32/F16 GGUF and .entity copies once; return the token ids of both prompts."""
    import entity
    from benchmarks.gguf_export import export
    from entity.gguf.loader import load_gguf
    from lucy.bench import prompt_ids

    WORK.mkdir(parents=True, exist_ok=True)
    for kind in ("f32", "f16"):
        if not (WORK / f"smollm2-{kind}.gguf").is_file():
            export(args.gguf, WORK / f"smollm2-{kind}.gguf", kind)
    for quant in ("q4", "q8", "f16"):
        if _stale(WORK / f"smollm2-{quant}.entity"):
            entity.convert(
                args.gguf, str(WORK / f"smollm2-{quant}.entity"), quant=quant, force=True
            )
    model = load_gguf(args.gguf, keep_quantized=True)
    chat = model.prompt_ids([{"role": "user", "content": CHAT_PROMPT}], chat=True)
    return {"chat": list(chat), "p128": prompt_ids(model, 128)}, model.tokenizer


class Worker:
    def __init__(self, name: str, args):
        cmd = [sys.executable, "-m", "benchmarks.compare", "--worker", name]
        cmd += ["--gguf", str(args.gguf), "--hf-dir", str(args.hf_dir)]
        cmd += ["--threads", str(args.threads)]
        self.name, self.rss = name, 0.0
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.rss = self.ask(None)["rss_mb"]

    def ask(self, req: dict | None) -> dict:
        if req is not None:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} died (exit {self.proc.wait()})")
        res = json.loads(line)
        self.rss = max(self.rss, res.get("rss_mb", 0.0))
        return res

    def close(self) -> None:
        self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=60)


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def measure(args, prompts: dict[str, list[int]]) -> dict:
    workers = []
    for name in args.engines:
        try:
            workers.append(Worker(name, args))
        except (RuntimeError, OSError) as exc:
            print(f"skip {name}: {exc}", file=sys.stderr)
    alive = []
    for w in workers:  # warm-up: weights paged in, kernels compiled, poly's thread count chosen
        try:
            w.ask({"op": "run", "ids": prompts["chat"][:8], "new": 12})
            alive.append(w)
        except RuntimeError as exc:  # e.g. a llama.cpp build that crashes in decode
            print(f"skip {w.name}: {exc}", file=sys.stderr)
    workers = alive
    results = {w.name: {"prefill": {}, "decode": {}, "tokens": {}} for w in workers}
    for run in range(args.runs):
        print(f"run {run + 1}/{args.runs} …", file=sys.stderr, flush=True)  # progress
        for key, ids in prompts.items():
            for w in workers:
                res = w.ask({"op": "run", "ids": ids, "new": args.new})
                r = results[w.name]
                r["prefill"].setdefault(key, []).append(len(ids) / res["prefill_s"])
                r["decode"].setdefault(key, []).append(args.new / res["decode_s"])
                r["tokens"][key] = res["tokens"]
    for w in workers:
        if w.name == "poly-f32":
            ids = prompts["chat"]
            one = [w.ask({"op": "batch", "ids": ids, "new": args.new, "size": 1})["tok_s"]]
            four = [w.ask({"op": "batch", "ids": ids, "new": args.new, "size": 4})["tok_s"]]
            for _ in range(args.runs - 1):
                one.append(w.ask({"op": "batch", "ids": ids, "new": args.new, "size": 1})["tok_s"])
                four.append(w.ask({"op": "batch", "ids": ids, "new": args.new, "size": 4})["tok_s"])
            results[w.name]["batch"] = {"b1": _stats(one), "b4": _stats(four)}
        w.close()
        results[w.name]["peak_rss_mb"] = w.rss
        for kind in ("prefill", "decode"):
            results[w.name][kind] = {k: _stats(v) for k, v in results[w.name][kind].items()}
    return results


def agreement(results: dict, prompt: str = "chat") -> dict[str, int]:
    base = results.get("poly-f32", {}).get("tokens", {}).get(prompt)
    if base is None:
        return {}
    out = {}
    for name, r in results.items():
        toks = r["tokens"].get(prompt, [])
        out[name] = sum(a == b for a, b in zip(base, toks))
    return out


def table(results: dict, prompts: dict[str, list[int]]) -> str:
    names = list(results)
    lines = ["| engine | prompt | prefill tok/s | decode tok/s (min-max) | peak RSS MB |"]
    lines.append("|---|---|---|---|---|")
    for name in names:
        r = results[name]
        for key in prompts:
            p, d = r["prefill"][key], r["decode"][key]
            lines.append(
                f"| {name} | {key} ({len(prompts[key])} tok) | {p['median']:.0f} | "
                f"{d['median']:.1f} ({d['min']:.1f}-{d['max']:.1f}) | {r['peak_rss_mb']:.0f} |"
            )
    lines += ["", "Decode ratios (chat prompt, median / median; rows = ours):", ""]
    peers = [n for n in names if not n.startswith("poly")]
    lines.append("| ours \\ peer | " + " | ".join(peers) + " |")
    lines.append("|---" * (len(peers) + 1) + "|")
    for name in (n for n in names if n.startswith("poly")):
        d = results[name]["decode"]["chat"]["median"]
        cells = [f"{d / results[p]['decode']['chat']['median']:.2f}x" for p in peers]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="poly vs llama.cpp vs transformers")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", nargs="*", default=list(ENGINES))
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--hf-dir", default=None)
    ap.add_argument(
        "--json", default=None, help="write the report as JSON to this file ('-': stdout only)"
    )
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.json == "-":  # JSON alone on stdout: the table goes to stderr
        with contextlib.redirect_stdout(sys.stderr):
            report = _run(args)
        print(json.dumps(report))
        return
    report = _run(args)
    if args.json:
        from entity.atomic import atomic_output

        with atomic_output(args.json, force=True) as f:  # temp, fsync, rename: never half a file
            f.write(json.dumps(report, indent=1).encode())


def _run(args) -> dict:
    from entity.smollm2 import ensure_smollm2

    args.gguf = args.gguf or str(ensure_smollm2())
    args.hf_dir = args.hf_dir or str(Path(args.gguf).parent / "SmolLM2-135M-Instruct-hf")
    if args.worker:
        worker(args.worker, args)
        return {}
    prompts, tokenizer = prepare(args)
    results = measure(args, prompts)
    texts = {n: tokenizer.decode(r["tokens"]["chat"]) for n, r in results.items()}
    report = {
        "machine": {"cpus": os.cpu_count(), "load": os.getloadavg(), "uname": os.uname()[:3]},
        "args": {k: v for k, v in vars(args).items() if k != "worker"},
        "prompts": prompts,
        "results": results,
        "agreement_with_poly_f32_chat": agreement(results),
        "texts_chat": texts,
    }
    print(table(results, prompts))
    print(
        "\nTokens equal to poly-f32's on the chat prompt:", report["agreement_with_poly_f32_chat"]
    )
    if "poly-f32" in results and "batch" in results["poly-f32"]:
        b = results["poly-f32"]["batch"]
        print(
            f"forward_batch f32: B=1 {b['b1']['median']:.1f} tok/s, B=4 {b['b4']['median']:.1f} "
            f"tok/s ({b['b4']['median'] / b['b1']['median']:.2f}x)"
        )
    return report


if __name__ == "__main__":
    main()

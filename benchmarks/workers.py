"""Engine worker processes shared by the benchmarks (compare.py, matrix.py).

Every engine lives in its own process (so its peak RSS and load time are its own). A worker is
described by a spec (a JSON object: ``kind`` poly | llama | hf, ``path``, ``threads``, and for
poly ``keep_quantized``, for llama ``n_ctx`` and ``buffers``), loads once, then answers one JSON request per
line on stdin with one JSON reply per line on stdout:

- ``{"op": "run", "ids", "new"}``: prefill seconds, decode seconds, greedy tokens;
- ``{"op": "prefill", "ids"}``: seconds of one prefill from an empty context;
- ``{"op": "decode", "ids", "new"}``: prefill ``ids`` (not timed), then the seconds of ``new``
  greedy steps, and their tokens;
- ``{"op": "batch", "ids", "new", "size"}`` (poly only): tokens/s of ``greedy_batch``.

    python -m benchmarks.workers '{"kind": "poly", "path": "model.gguf", "threads": 2}'
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "24")  # as `import poly` does; numpy reads it

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from lucy.rss import peak_rss_mb  # noqa: E402


class Engine:
    """Greedy timing on top of three primitives: `reset()`, `forward(ids) -> last logits` and
    `truncate(n)` (forget cached positions >= n)."""

    context: list[int] | None = None  # the ids in the cache after the last `decode`

    def reset(self) -> None:
        raise NotImplementedError

    def forward(self, ids: list[int]) -> np.ndarray:
        raise NotImplementedError

    def truncate(self, n: int) -> None:
        raise NotImplementedError

    def greedy(self, logits, new: int) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        out = []
        for _ in range(new):
            out.append(int(np.argmax(logits)))
            logits = self.forward([out[-1]])
        return time.perf_counter() - t0, out

    def run(self, ids: list[int], new: int) -> tuple[float, float, list[int]]:
        self.reset()
        self.context = None
        t0 = time.perf_counter()
        logits = self.forward(ids)
        pre = time.perf_counter() - t0
        dec, out = self.greedy(logits, new)
        return pre, dec, out

    def prefill(self, ids: list[int]) -> float:
        self.reset()
        self.context = None
        t0 = time.perf_counter()
        self.forward(ids)
        return time.perf_counter() - t0

    def decode(self, ids: list[int], new: int) -> tuple[float, list[int]]:
        """`new` greedy steps after the context `ids`. When the cache still holds `ids` (the
        previous request was the same decode), it is cut back to them and only the last id is
        fed again, so a long context is prefilled once, not once per round."""
        if self.context == list(ids):
            self.truncate(len(ids) - 1)
            logits = self.forward(list(ids[-1:]))
        else:
            self.reset()
            logits = self.forward(ids)
        self.context = list(ids)
        return self.greedy(logits, new)


class PolyEngine(Engine):
    def __init__(self, path: str, threads: int, keep_quantized: bool = True, kv_cache="f32",
                 n_ctx: int | None = None):  # fmt: skip
        import entity
        from entity.gguf.loader import load_gguf
        from poly.runtime import kernels

        kernels.set_num_threads(threads)
        ctx = {} if n_ctx is None else {"max_seq_len": n_ctx}  # None: the loader's default
        if path.endswith(".entity"):
            self.model = entity.load(path, **ctx)
        else:
            self.model = load_gguf(path, keep_quantized=keep_quantized, **ctx)
        self.model.kv_cache_dtype = kv_cache  # llama.cpp's own default is f16

    def reset(self) -> None:
        self.model.reset()

    def truncate(self, n: int) -> None:
        self.model.truncate(n)

    def forward(self, ids: list[int]) -> np.ndarray:
        return self.model.forward(ids)

    def batch(self, ids: list[int], new: int, size: int) -> float:
        from poly.runtime.batch import greedy_batch

        _, seconds = greedy_batch(self.model, [ids] * size, new)
        return size * new / seconds


def llama_plain_buffers() -> None:
    """Keep llama.cpp's weights in plain CPU buffers: no "extra" buffer types (AMX tiles, the
    Q4_0, Q4_K and more repacked for its gemm, per build and CPU). Only a fallback (`start_worker`):
    those types are llama.cpp's default, and faster (Zen 3, 1B Q4_0: 128-token prompt 40 -> 57
    tok/s, decode 16.6 -> 19.3), but llama-cpp-python 0.3.36 crashed with them in llama_decode
    on a VM that hides AMX from the guest. llama-cpp-python has no keyword for it, so the
    default model params are wrapped."""
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


# llama.cpp's KV cache for the matrix's --kv-cache: f16 (its default), or q8_0 blocks, which its
# V cache holds only under flash attention
LLAMA_KV = {"f16": {}, "q8_0": {"type_k": 8, "type_v": 8, "flash_attn": True}}  # 8: GGML_TYPE_Q8_0


class LlamaEngine(Engine):
    def __init__(
        self, path: str, threads: int, n_ctx: int = 512, buffers: str = "default", kv: str = "f16"
    ):
        from llama_cpp import Llama

        if buffers == "plain":
            llama_plain_buffers()
        self.llm = Llama(
            model_path=path, n_ctx=n_ctx, n_threads=threads, n_batch=512, verbose=False,
            **LLAMA_KV[kv],
        )  # fmt: skip

    def last_logits(self) -> np.ndarray:
        """The last evaluated token's logits, read from the context: `llm.scores` is only
        filled with logits_all=True (which would make llama.cpp compute every prompt row)."""
        import llama_cpp

        ptr = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.llm.n_vocab(),))

    def reset(self) -> None:
        self.llm.reset()

    def truncate(self, n: int) -> None:
        self.llm.n_tokens = n  # the next eval removes the cache cells >= n

    def forward(self, ids: list[int]) -> np.ndarray:
        self.llm.eval(ids)
        return self.last_logits()


class HFEngine(Engine):
    """transformers on float32: an HF snapshot directory, or a GGUF file (dequantized)."""

    def __init__(self, path: str, threads: int):
        os.environ.setdefault("TQDM_DISABLE", "1")  # its GGUF loader's bar, on our stderr
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        torch.set_num_threads(threads)
        self.torch, self.past = torch, None
        p = Path(path)
        if p.is_dir():
            model = AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                str(p.parent), gguf_file=p.name, dtype=torch.float32
            )
        self.model = model.eval()

    def reset(self) -> None:
        self.past = None

    def truncate(self, n: int) -> None:
        drop = self.past.get_seq_length() - n
        if n == 0:
            self.past = None
        elif drop > 0:
            self.past.crop(-drop)  # transformers 5: a negative count removes that many

    def forward(self, ids: list[int]) -> np.ndarray:
        torch = self.torch
        with torch.inference_mode():
            res = self.model(torch.tensor([ids]), past_key_values=self.past, use_cache=True)
        self.past = res.past_key_values
        return res.logits[0, -1].numpy()


def make_engine(spec: dict) -> Engine:
    kind, path, threads = spec["kind"], str(spec["path"]), int(spec.get("threads", 2))
    if kind == "poly":
        return PolyEngine(
            path, threads, bool(spec.get("keep_quantized", True)), spec.get("kv_cache", "f32"),
            spec.get("n_ctx"),
        )  # fmt: skip
    if kind == "llama":
        n_ctx = int(spec.get("n_ctx", 512))
        return LlamaEngine(
            path, threads, n_ctx, spec.get("buffers", "default"), spec.get("kv", "f16")
        )
    if kind == "hf":
        return HFEngine(path, threads)
    raise ValueError(f"unknown engine kind {kind!r}")


def _preimport(kind: str) -> None:
    """Import the engine's libraries before the load clock starts (load time = the model)."""
    if kind == "poly":
        import entity  # noqa: F401
        import poly  # noqa: F401
    elif kind == "llama":
        import llama_cpp  # noqa: F401
    elif kind == "hf":
        import torch  # noqa: F401
        import transformers  # noqa: F401


def answer(engine: Engine, req: dict) -> dict:
    op = req["op"]
    if op == "run":
        pre, dec, toks = engine.run(req["ids"], req["new"])
        return {"prefill_s": pre, "decode_s": dec, "tokens": toks}
    if op == "prefill":
        return {"prefill_s": engine.prefill(req["ids"])}
    if op == "decode":
        dec, toks = engine.decode(req["ids"], req["new"])
        return {"decode_s": dec, "tokens": toks}
    if op == "batch":
        return {"tok_s": engine.batch(req["ids"], req["new"], req["size"])}
    raise ValueError(f"unknown op {op!r}")


def serve(spec: dict) -> None:
    """The worker's side of the line protocol (stdin requests, stdout replies)."""
    _preimport(spec["kind"])
    t0 = time.perf_counter()
    engine = make_engine(spec)
    load_s = time.perf_counter() - t0
    reply = sys.stdout
    sys.stdout = sys.stderr  # anything a library prints must not corrupt the protocol
    reply.write(json.dumps({"ready": True, "rss_mb": peak_rss_mb(), "load_s": load_s}) + "\n")
    reply.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        res = answer(engine, req)
        res["rss_mb"] = peak_rss_mb()
        reply.write(json.dumps(res) + "\n")
        reply.flush()


class Worker:
    """The parent's handle on one engine process; raises RuntimeError when the worker dies."""

    def __init__(self, name: str, spec: dict):
        cmd = [sys.executable, "-m", "benchmarks.workers", json.dumps(spec)]
        self.name, self.spec, self.rss, self.load_s = name, spec, 0.0, 0.0
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.load_s = self.ask(None)["load_s"]

    def ask(self, req: dict | None) -> dict:
        try:
            if req is not None:
                self.proc.stdin.write(json.dumps(req) + "\n")
                self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            raise RuntimeError(f"worker {self.name} died (exit {self.proc.wait()})")
        res = json.loads(line)
        self.rss = max(self.rss, res.get("rss_mb", 0.0))
        return res

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def warm_page_cache(path: str) -> None:
    """Read every byte once: the page cache holds the file (a warm cache: no engine pays for reading it first)."""
    files = sorted(Path(path).iterdir()) if Path(path).is_dir() else [Path(path)]
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def start_worker(name: str, spec: dict, warm: dict) -> Worker:
    """A worker, warmed up by the request `warm` (weights paged in, poly's thread count chosen).
    A llama.cpp worker that dies with its default (repacked) buffers is started again on plain
    ones, and its spec says so (``buffers``): the benchmarks name the peer they measured."""
    try:
        w = Worker(name, spec)
        w.ask(warm)
        return w
    except RuntimeError:
        if spec.get("kind") != "llama" or spec.get("buffers", "default") != "default":
            raise
    spec["buffers"] = "plain"
    w = Worker(name, spec)
    w.ask(warm)
    return w


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))

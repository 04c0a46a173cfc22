"""The program every rank of the tensor-parallel tests runs (tests/test_tp.py launches it with
`mpiexec -n N python -m mpi4py tests/tp_worker.py MODE ...`); `logits` also runs in-process as
the TP = 1 reference. Rank 0 writes the results as .npy / text files into OUT (no pickles)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

PROMPT = [5, 17, 33, 60, 2, 9]
SMOL_CHAT = [{"role": "user", "content": "Write a short poem about a café in Zürich."}]


def load(spec: str, comm, quantized: bool):
    import entity

    kw = {}
    if spec.endswith(".gguf"):
        kw["keep_quantized"] = quantized
    return entity.load(spec, tp=comm, **kw)


def logits_run(model, ids: list[int], all_rows: bool) -> np.ndarray:
    """Prefill logits, 4 greedy decode steps (fused under the C backend), then batched rows (prompts of different
    lengths one by one, then two single-token steps as one batch) -> [rows, V]."""
    model.reset()
    first = model.forward_all(ids) if all_rows else model.forward(ids)[None]
    out = [first]
    tok = int(first[-1].argmax())
    for _ in range(4):
        lg = model.forward([tok])
        out.append(lg[None])
        tok = int(lg.argmax())
    states = [model.new_state(), model.new_state()]
    out.append(model.forward_batch([ids[:3], ids[:5]], states))
    out.append(model.forward_batch([[11], [12]], states))
    out.append(model.forward_batch([[13], [14]], states))
    return np.concatenate(out).astype(np.float32)


def greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens through the decode step (EOS ignored: every step is compared)."""
    model.reset()
    logits, out = model.forward(ids), []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = model.forward([out[-1]])
    return out


def mode_logits(comm, out: Path, quantized: bool, specs: list[str], kv: str | None = None) -> None:
    """kv: every model's KV cache dtype ("f16"), else the default float32."""
    from poly.runtime import ckernels, kernels

    # quantized: the float kernels on both sides (TP = 1 decodes GGUF Q4_1 rows on int8 codes of
    # x, csrc/formats/interleave16.h, ~5e-4 of the logit scale from the float rows that TP ranks' shards take)
    ckernels.set_act_q8(False if quantized else "auto")
    for i, spec in enumerate(specs):
        is_smol = not Path(spec).is_dir()  # the real model: last-position prefill, C only
        for backend in ("c",) if is_smol else ("c", "numpy"):
            kernels.set_backend(backend)
            model = load(spec, comm, quantized)
            if kv is not None:
                model.kv_cache_dtype = kv
            ids = model.prompt_ids(SMOL_CHAT, chat=True) if is_smol else PROMPT
            res = logits_run(model, ids, all_rows=not is_smol)
            if comm.rank == 0:
                np.save(out / f"{i}_{backend}.npy", res)
        kernels.set_backend()
    ckernels.set_act_q8("auto")


def mode_greedy(comm, out: Path, quantized: bool, specs: list[str]) -> None:
    model = load(specs[0], comm, quantized)
    toks = greedy(model, model.prompt_ids(SMOL_CHAT, chat=True), 64)
    if comm.rank == 0:
        (out / "greedy.txt").write_text(" ".join(map(str, toks)))


def mode_fault(comm, out: Path, kind: str, specs: list[str]) -> None:
    """A decode loop that never ends by itself; after 30 steps rank 1 hangs ("hang") or
    waits to be killed ("kill")."""
    model = load(specs[0], comm, False)
    (out / f"pid{comm.rank}").write_text(str(os.getpid()))
    step = 0
    while True:
        model.reset()
        logits = model.forward(PROMPT)
        for _ in range(40):
            step += 1
            if comm.rank == 1 and step == 30:
                (out / "ready").write_text("1")
                while kind == "hang":
                    time.sleep(1)
            logits = model.forward([int(np.argmax(logits))])


def mode_lucy(comm, out: Path, fail_rank: str, argv: list[str]) -> None:
    """`lucy ARGV` with rank `fail_rank` raising in its 5th forward (-1: none)."""
    from lucy.cli import run
    from poly.runtime.tp import TPTransformer

    if comm.rank == int(fail_rank):
        real, calls = TPTransformer.forward, []

        def failing(self, ids):
            calls.append(1)
            if len(calls) == 5:
                raise RuntimeError("injected failure")
            return real(self, ids)

        TPTransformer.forward = failing
    sys.exit(run(argv))


def main() -> None:
    from poly.runtime.comm import world

    mode, out, flag, *specs = sys.argv[1:]
    comm = world()
    out = Path(out)
    if mode == "logits":
        mode_logits(comm, out, flag == "q", specs, "f16" if flag == "h" else None)
    elif mode == "greedy":
        mode_greedy(comm, out, flag == "q", specs)
    elif mode == "fault":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        mode_fault(comm, out, flag, specs)
    elif mode == "lucy":
        mode_lucy(comm, out, flag, specs)


if __name__ == "__main__":
    main()

"""Fused calls or the reference path for a prompt: measured on this machine at first use.

Which path runs a prompt faster depends on the CPU (AVX2 or AVX-512, cache sizes, cores), the
model's width and FFN, its blocks' stored forms and the prompt's length. The shipped rules in
poly/runtime/dispatch.py came from A/B runs on a few machines; here the first prompt of a length
class (`BUCKETS`) on a model shape and block kinds runs a short probe of both paths, and the
faster one is kept in the CPU's tune file (poly/runtime/tune_cache.py) for every later process.

The probe (`measure`): the first 2-5 blocks of the model (fewer on wide models, so that one
path costs ~`WORK` FLOPs; the last is cut to one row's FFN on both paths, as the model's last
block is), the final norm and the LM head, on fresh scratch caches (the model's own caches are
put back untouched), alternating the two paths up to `ROUNDS` times (no further round past
`BUDGET` seconds), the least time of each. A ratio within `TIE` keeps the shipped rule (noise on
a shared host reaches ~15 %, benchmarks/results/README.md). No probe runs while other processes
hold the cores (the times would measure them), with POLY_TUNE=0, or for a plan the fused calls
cannot take; the shipped rule decides then.
"""

from __future__ import annotations

import copy
import time

import numpy as np

from poly.errors import PolyError
from poly.model.block import run_block
from poly.nn import mha
from poly.ops import linear
from poly.quant.schemes import SCHEMES
from poly.runtime import ckernels, fused, kernels, prefill, threadtune

BUCKETS = (16, 32, 64, 128, 256, 512)  # prompt lengths a decision covers (up to and including)
ROUNDS = 7  # alternations of the two paths at most (a cheap probe: the least of many)
BUDGET = 0.5  # seconds after which no further round starts
WORK = 8e9  # FLOPs of a probe's blocks per path (~0.1 s at 2 cores' AVX2 GEMM rate)
MAX_BLOCKS = 4  # whole blocks at most (and the cut one)
TIE = 0.05  # the paths within this fraction of each other: the shipped rule stays

_KIND_NAMES = {r.c_kind: n.removeprefix("gguf_") for n, r in SCHEMES.items()}
LOADED_RETRY = 30.0  # seconds without a probe after the machine was found loaded
_LOADED = {"until": 0.0}
_SEEN: dict[tuple[str, str], bool] = {}  # this process's decisions (force: measured once each)


def bucket(n: int) -> int:
    return next((b for b in BUCKETS if n <= b), BUCKETS[-1])


def entry_name(model, p: fused.Plan, n: int, threads: int) -> str:
    """The tune file's entry: model shape, block kinds, length class, thread count."""
    cfg = model.config
    kinds = "+".join(sorted({_KIND_NAMES.get(k, str(k)) for k in p.block_kinds}))
    shape = f"{cfg.hidden_size}x{cfg.intermediate_size}"
    return f"prompt_path/{shape}/{kinds}/n{bucket(n)}/t{threads}"


def fused_wins(model, p: fused.Plan, n: int, default: bool) -> bool:
    """Whether an n-token prompt runs faster as fused calls than on the reference path: the
    tune file's finding for this class, else a probe now, else `default` (the shipped rule)."""
    from poly.runtime import tune_cache  # hashlib, json, tempfile: not at every start

    mode = tune_cache.mode()
    if mode == "off":
        return default
    threads = kernels.num_threads()
    store = tune_cache.store()
    name = entry_name(model, p, n, threads)
    seen = _SEEN.get((str(store.path), name))
    if seen is not None:
        return seen
    entry = store.get(name) if mode == "on" else None
    if isinstance(entry, dict) and isinstance(entry.get("fused"), bool):
        _SEEN[(str(store.path), name)] = entry["fused"]
        return entry["fused"]
    if time.monotonic() < _LOADED["until"]:
        return default  # found loaded lately: not a look at the load per prompt
    if not threadtune.room_for(threads):  # loaded now: decide later, on a quiet machine
        _LOADED["until"] = time.monotonic() + LOADED_RETRY
        return default
    try:
        got = measure(model, p, min(bucket(n), capacity(p)))
    except (PolyError, MemoryError, OSError):  # a probe never fails the prompt it came before
        got = None
    if got is None:  # the probe cannot run for this model: the rule for the whole process
        _SEEN[(str(store.path), name)] = default
        return default
    t_fused, t_ref = got
    win = decide(t_fused, t_ref, default)
    _SEEN[(str(store.path), name)] = win
    store.put(name, {"fused": win, "fused_s": t_fused, "reference_s": t_ref, "default": default})
    return win


def decide(t_fused: float, t_ref: float, default: bool) -> bool:
    if abs(t_fused / t_ref - 1.0) < TIE:
        return default
    return t_fused < t_ref


def capacity(p: fused.Plan) -> int:
    """The longest probe the scratch caches take."""
    return int(min(a.max_seq_len for a in p.attn))


def probe_blocks(p: fused.Plan, n: int) -> int:
    """Blocks a probe runs: 1 to MAX_BLOCKS whose work for n rows is about WORK FLOPs, plus the
    one both paths cut to the last row's FFN (as they cut the model's last block), so that the
    probe's mix of whole and cut blocks leans, like the model's, to whole ones."""
    per_row = 2 * sum(m * k for m, k in _shapes(p.layers[0]))
    whole = int(max(1, min(MAX_BLOCKS, WORK // max(1, per_row * n))))
    return min(len(p.layers), whole + 1)


def _shapes(args):
    """(m, k) of every matrix record in a layer's argument tuple (fused_args.mat's records)."""
    if isinstance(args, tuple):
        if len(args) in (6, 7) and isinstance(args[0], int) and isinstance(args[1], np.ndarray):
            yield args[3], args[4]
        else:
            for a in args:
                yield from _shapes(a)


def measure(model, p: fused.Plan, n: int) -> tuple[float, float] | None:
    """(fused seconds, reference seconds) of an n-token probe from position 0 through the first
    `probe_blocks` blocks and the head; None when the fused calls do not take this model."""
    if n < 2:  # (a fused plan's blocks are all the plain kind)
        return None
    k = probe_blocks(p, n)
    sub = copy.copy(p)  # the first k blocks' records: fused.prefill_calls reads these fields
    sub.layers, sub.attn = p.layers[:k], p.attn[:k]
    sub.moe = p.moe[: sum(fused.is_moe(a) for a in sub.layers)]
    ids = np.arange(n, dtype=np.int64) % model.config.vocab_size
    x0 = np.ascontiguousarray(model.embed(ids), dtype=np.float32)  # [n, H]
    old = model.swap_state(model.new_state())
    try:
        for layer in sub.attn:  # the scratch caches' pages, written once before any timing
            cache = mha.live_cache(layer)
            cache.k[:n], cache.v[:n] = 0, 0
        return _rounds(model, p, sub, x0, k)
    finally:
        model.swap_state(old)


def _rounds(model, p: fused.Plan, sub, x0: np.ndarray, k: int) -> tuple[float, float] | None:
    """The least time of each path over up to ROUNDS alternations (a probe past BUDGET: one;
    its one-time costs are small beside it), on the thread count the fused calls take now (the reference path's prefill tuner
    would pick the same under load)."""
    full = kernels.num_threads()
    nt = prefill.fused_threads(full)
    best = [float("inf"), float("inf")]
    start = time.perf_counter()
    try:
        kernels.use_threads(nt)
        for _ in range(ROUNDS):
            for i, run in enumerate((_fused, _reference)):
                model.truncate(0)
                t0 = time.perf_counter()
                if run(model, p, sub, x0.copy(), k, nt) is None:
                    return None
                best[i] = min(best[i], time.perf_counter() - t0)
            if time.perf_counter() - start > BUDGET:
                break
    finally:
        kernels.use_threads(full)
        model.truncate(0)
    return best[0], best[1]


def _fused(model, p, sub, x: np.ndarray, k: int, nt: int):
    """fused.prefill_calls on the first k blocks, on nt threads (its look at the load, up to
    ~12 ms on a busy machine, stays out of the time)."""
    n = x.shape[0]
    calls = -(-n // sub.call_rows)
    caches = fused._prompt_caches(sub, n)
    if caches is None:
        return None
    for i in range(calls):  # rows as prefill_calls splits them: equal calls, contiguous
        rows = x[n * i // calls : n * (i + 1) // calls]
        logits = fused._prompt_call(sub, rows, caches, i == calls - 1, nt)
    return logits


def _reference(model, p, sub, x: np.ndarray, k: int, nt: int):
    """hidden_states' loop over the first k blocks, then the final norm and the head."""
    for j, i in enumerate(p.index[:k]):
        rows = slice(-1, None) if j == k - 1 else None
        x = run_block(model.network.layers[i], x, rows=rows, cfg=model.config)
    return linear(model.norm_final(x[-1:]), model.lm_head)[0]


def table(model, rule, lengths=BUCKETS) -> list[dict]:
    """Measure every length class now (as POLY_TUNE=force would), keep the findings and return
    one row each: {"tokens", "blocks", "fused_s", "reference_s", "fused", "default"}; `rule`:
    the shipped rule, rule(model, plan, n) -> bool (dispatch.shipped_rule; `lucy bench --tune`)."""
    from poly.runtime import tune_cache  # as in `fused_wins`

    p = fused.plan(model) if ckernels.SIMD else None
    if p is None or model.activation_dtype != np.float32:
        return []
    store, threads, rows = tune_cache.store(), kernels.num_threads(), []
    for n in sorted({min(bucket(n), capacity(p)) for n in lengths}):
        default = rule(model, p, n)
        got = measure(model, p, n)
        if got is None:
            continue
        win = decide(*got, default)
        name = entry_name(model, p, n, threads)
        _SEEN[(str(store.path), name)] = win
        store.put(
            name, {"fused": win, "fused_s": got[0], "reference_s": got[1], "default": default}
        )
        rows.append({"tokens": n, "blocks": probe_blocks(p, n), "fused_s": got[0],
                     "reference_s": got[1], "fused": win, "default": default})  # fmt: skip
    return rows

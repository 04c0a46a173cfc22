"""The fused decode step: one call into poly.runtime.native.ckernels.decode per generated token.
For a model whose blocks the C step knows (plain pre-norm blocks and the recipes of
`poly.recipe`) and whose matrices are forms the C kernels read, a one-token forward runs every
block, the final norm and the LM head inside one OpenMP region (csrc/decode/step.h). The Python
path stays the reference and the fallback (forms or options without a C kernel, numpy backend).
The call's argument tuples are built once per Generations value (`Plan`) and checked again in C.
"""

from __future__ import annotations

import time

import numpy as np

from poly.errors import ContextOverflowError
from poly.model.block import is_recipe_block, slots
from poly.nn import mha
from poly.nn.kvcache import window_rows
from poly.runtime import ckernels, fused_rope, kernels, prefill
from poly.runtime.fused_args import is_f32, layer_args, mat, norm_args
from poly.runtime.threadtune import SHARED, ThreadTuner
from poly.weights import Generations, PlanCache

_F32 = np.dtype(np.float32)


class Plan:
    """The argument tuples of one model's fused step; `ok` False when the step does not apply."""

    def __init__(self, model):
        self.ok = False
        self.index = [i for i, b in enumerate(model.network.layers) if not b.is_disabled]
        blocks = [model.network.layers[i] for i in self.index]
        cfg = model.config
        if not blocks or not all(is_recipe_block(b, cfg.block) for b in blocks):
            return
        layers = tuple(layer_args(b, cfg) for b in blocks)
        lm = mat(model.lm_head, getattr(model, "lm_head_bias", None))
        final = norm_args(model.final_norm_layer)
        if lm is None or final is None or not is_f32(final[0]) or any(a is None for a in layers):
            return
        at = slots(cfg.block)["attn"]
        self.attn = [b.sequential_layers[at] for b in blocks]
        # MoE layers and their `chosen` arrays: the experts each call used, for the pager
        mlp = slots(cfg.block)["mlp"]
        self.moe = [
            (b.sequential_layers[mlp], a[14][7]) for b, a in zip(blocks, layers) if is_moe(a)
        ]
        self.layers = layers
        self.lrope = fused_rope.records(self.attn, layers)  # dynamic / longrope tables
        self.kinds = frozenset(_kinds((layers, lm)))
        self.block_kinds = frozenset(_kinds(layers, True))  # all, repacked or not; no LM head
        # HF bfloat16 arrays: exact rows in the auto mode too (ckernels.Q8_EXACT_BF16)
        self.exact_bf16 = any(w.dtype.name == "bfloat16" for w in _weights((layers, lm)))
        self.head = (final[0], float(cfg.rms_norm_eps), lm) + (
            () if final[1] is None else final[1:]
        )
        # model-level multipliers on the logits (the embedding scale: the callers' model.embed)
        self.logit_scale, self.softcap = float(cfg.logit_scale), float(cfg.final_logit_softcap)
        self.call_rows = call_rows(self.attn)
        self.vocab = lm[3]
        self.tuners: dict[int, ThreadTuner] = {}  # decode threads per batch size
        self.ok = True


def is_moe(layer_args: tuple) -> bool:
    """Whether a layer's C tuple has an MoE FFN (its 15th item)."""
    return len(layer_args) >= 15 and layer_args[14] is not None


def call_rows(attn_layers) -> int:
    """The most rows of one fused call that share a cache: STEP_ROWS, or for a layer whose
    sliding window's cache moves its rows (KVCache.make_room), W + 1 (what its rows hold beside
    the W - 1 + W/2 positions kept)."""
    out = ckernels.STEP_ROWS
    for a in attn_layers:
        w = a.sliding_window
        if w and window_rows(a.max_seq_len, w) < a.max_seq_len:
            out = min(out, w + 1)
    return out


def _finish(p: Plan, logits: np.ndarray) -> np.ndarray:
    """The model's logit scale and final soft-capping, in place (as Transformer.logits)."""
    if p.logit_scale != 1:
        logits *= np.float32(p.logit_scale)
    if p.softcap:
        cap = np.float32(p.softcap)
        np.tanh(logits / cap, out=logits)
        logits *= cap
    return logits


def _room(rows: list[list]) -> bool:
    """Make room in each sliding-window cache of rows[i] for the rows that write it (a cache
    several rows share: that many); False when one cannot take them (the reference path)."""
    counts: dict[int, list] = {}
    for r in rows:
        for c in r:
            if c.window:
                counts.setdefault(id(c), [c, 0])[1] += 1
    return all(c.make_room(k) is not None for c, k in counts.values())


def _kv(c) -> tuple:
    """A cache's (k, v) call items: k as (k, start) when its row 0 is not position 0; a q8_0
    cache's are its int8 rows of codes and scales (kvcache.q8_rows)."""
    k, v = (c.k, c.v) if c.kb is None else (c.kb, c.vb)
    return ((k, c.start) if c.start else k), v


def _kinds(args, repacked=False):
    """The C kinds of the matrix records inside the nested argument tuples: those not repacked by
    16 (fused_args.mat's 6-tuples; a repacked one's rows are alike on every path; Q4_K/Q6_K rows by 8
    serve decode rows alone, a prompt takes the int8 panels), or all of them."""
    if isinstance(args, tuple):
        if len(args) in (6, 7) and isinstance(args[0], int) and isinstance(args[1], np.ndarray):
            if len(args) == 6 or repacked or args[0] in (ckernels.Q4_K, ckernels.Q6_K):
                yield args[0]
        else:
            for a in args:
                yield from _kinds(a, repacked)


def _weights(args):
    """The stored rows (w) of every matrix record inside the nested argument tuples."""
    if isinstance(args, tuple):
        if len(args) in (6, 7) and isinstance(args[0], int) and isinstance(args[1], np.ndarray):
            yield args[1]
        else:
            for a in args:
                yield from _weights(a)


def rows_alike(model) -> bool:
    """Whether a row's results in a fused call of at most MAX_N rows are the same whatever the
    other rows (prompt rows beside decode rows): false without the fused step, and in the q8
    "auto" mode for K-quant matrices, whose one-prompt rows take the int8 panels (on 8-lane
    builds Loom Q4 matrices not repacked by 16 too: ckernels.prompt_kinds)."""
    p = plan(model)
    if p is None:
        return False
    kinds = p.kinds - {ckernels.BF16} if p.exact_bf16 else p.kinds
    return not kinds & ckernels.prompt_kinds()


def plan(model) -> Plan | None:
    """The model's fused plan, or None when the fused step does not apply. Cached per
    Generations value: any weight, layer, head or backend change since it was built bumps the
    counter, so the check per token is one integer compare."""
    if kernels.backend() != "c" or not ckernels.AVAILABLE:
        return None
    cache = model.__dict__.get("plan_cache")
    if cache is None:
        cache = model.plan_cache = PlanCache()
    got = cache.get("fused", Generations.value, lambda: Plan(model))
    return got if got.ok else None


def prepare(model) -> bool:
    """Make the model's fused plan and its one-time copies (`repack.copy_for`) now, not in the
    first forward (SmolLM2 Q4_1's first prompt: 0.38 s, the next 0.05 s); entity.load calls it
    once the model is complete. True when the fused step applies."""
    if getattr(model, "activation_dtype", None) != _F32:
        return False
    return plan(model) is not None


def _report_experts(p: Plan, n: int) -> None:
    """Tell each paged MoE layer's expert cache the experts the step used (ascending id, like
    the reference forward), so its stats and its resident budget follow the C path too."""
    for layer, chosen in p.moe:
        cache = getattr(layer, "expert_cache", None)
        if cache is not None:
            for e in np.unique(chosen[:n]):
                cache.use(int(e))


def _positions(rows: list[list]) -> tuple[int, ...] | None:
    """Each row's next position (its caches must agree); None when they do not."""
    out = []
    for caches in rows:
        pos = caches[0].length
        if any(c.length != pos for c in caches):
            return None  # caches out of step (edited by hand): the Python path handles it
        if any(c.capacity <= pos for c in caches):
            raise ContextOverflowError(
                f"context overflow: {pos} cached + 1 new token > max_seq_len {caches[0].capacity}"
            )
        out.append(pos)
    return tuple(out)


def _run(
    p: Plan, x: np.ndarray, rows: list[list], reduce=None, pos=None, out_rows=None, tune=None
) -> np.ndarray | None:
    """x [n, d] (overwritten) with row i continuing the KVCaches rows[i] -> logits [n, V].
    `pos` (optional): each row's position, for rows that share caches (a prompt's tokens, in
    ascending order); by default each row's caches' length. `out_rows` (optional, ascending):
    the logits of those rows only, [len(out_rows), V]. `tune`: the thread tuner's key (default n)."""
    if pos is None:
        pos = _positions(rows)
        if pos is None:
            return None
    elif any(c.capacity <= at for r, at in zip(rows, pos) for c in r):
        raise ContextOverflowError(
            f"context overflow: position {max(pos)} >= max_seq_len {rows[0][0].capacity}"
        )
    if not _room(rows) or not fused_rope.call(p, rows, pos, rows):
        return None
    caches = []
    for li in range(len(p.attn)):  # block-major: (k, v) of row 0, row 1, ...
        for r in rows:
            caches += _kv(r[li])
    logits, out = _logits(p, x.shape[0], out_rows)
    tuner = p.tuners.setdefault(x.shape[0] if tune is None else tune, ThreadTuner(shared=SHARED))
    nt = tuner.threads(kernels.num_threads())
    t0 = time.perf_counter()
    hook = None
    if reduce is not None:  # tensor parallel: reduce(buf) sums [n, d] over the ranks in place
        buf = np.empty_like(x)  # [n, d]
        hook = (buf, lambda: reduce(buf))
    ckernels.decode(p.layers, tuple(caches), p.head, x, out, pos, nt, None, hook, p.exact_bf16)
    tuner.record(nt, time.perf_counter() - t0)
    _report_experts(p, x.shape[0])
    for r, at in zip(rows, pos):
        for cache in r:
            cache.length = at + 1
    return _finish(p, logits)


def _logits(p: Plan, n: int, out_rows) -> tuple[np.ndarray, object]:
    """The logits array [k, V] of a call over n rows, and the C call's logits argument."""
    if out_rows is None:
        logits = np.empty((n, p.vocab), dtype=np.float32)  # [n, V]
        return logits, logits
    logits = np.empty((len(out_rows), p.vocab), dtype=np.float32)  # [k, V]
    return logits, (logits, tuple(int(r) for r in out_rows))


def step(model, p: Plan, x: np.ndarray, reduce=None) -> np.ndarray | None:
    """Logits [V] for one token whose embedding is x [d] (overwritten), appended to the model's
    own caches; None when they are not all at one position (the Python path then runs)."""
    caches = [[mha.live_cache(layer) for layer in p.attn]]
    logits = _run(p, x.reshape(1, -1), caches, reduce)  # x [1, d]
    return None if logits is None else logits[0]


def prefill_calls(model, p: Plan, x: np.ndarray) -> np.ndarray | None:
    """Logits [V] of the last of a prompt: x [n, d] (overwritten, n >= 2) the embeddings of n
    new tokens continuing the model's own caches, in ceil(n / STEP_ROWS) fused calls of equal
    size (none of one row). A call's rows share each block's cache (row i at position start +
    i): no Python per block. The LM head runs in the last call, for its last row only; the other
    calls stop at their last block's k and v (no later call reads more of them). None when the
    caches are not at one position (the reference path then runs)."""
    n = x.shape[0]
    calls = -(-n // p.call_rows)
    caches = _prompt_caches(p, n)
    if caches is None:
        return None
    nt = prefill.fused_threads(kernels.num_threads())  # one look at the load per prompt
    end = caches[0].length + n  # a length-dependent rope's: the whole prompt's (fused_rope)
    for i in range(calls):  # rows n * i // calls .. n * (i + 1) // calls, contiguous
        rows = x[n * i // calls : n * (i + 1) // calls]
        logits = _prompt_call(p, rows, caches, i == calls - 1, nt, end)
    return logits


def _prompt_caches(p: Plan, n: int) -> list | None:
    """The model's caches for n prompt rows (every block's at one position, room for n more),
    or None where the fused call does not take them (the reference path then runs)."""
    if any(getattr(layer, "expert_cache", None) is not None for layer, _ in p.moe):
        return None  # paged experts: the grouped path reports each before use (the budget holds)
    caches = [mha.live_cache(layer) for layer in p.attn]
    start = caches[0].length
    if any(c.length != start for c in caches):
        return None
    if any(c.capacity < start + n for c in caches):
        raise ContextOverflowError(
            f"context overflow: {start} cached + {n} new tokens > max_seq_len {caches[0].capacity}"
        )
    return caches


def verify_rows(model, p: Plan, x: np.ndarray) -> np.ndarray | None:
    """Logits [n, V] of every row: x [n, d] (overwritten, 1 <= n <= STEP_ROWS) the embeddings of
    n tokens continuing the model's own caches, in one fused call (speculative decoding checks
    each proposed token against its row). None when the caches are not at one position."""
    n = x.shape[0]
    if not 1 <= n <= p.call_rows:
        return None
    caches = _prompt_caches(p, n)
    if caches is None:
        return None
    # threads as decode steps (prefill.fused_threads' look at the load: ~25 ms), a tuner per span
    # of n: adaptive proposals vary n and a new tuner tries fewer threads; a span's passes ~1.6x
    start = caches[0].length
    key = ("verify", (n - 1).bit_length())  # spans 2, 3-4, 5-8, ...
    return _run(p, x, [caches] * n, pos=tuple(range(start, start + n)), tune=key)


def _prompt_call(p: Plan, x: np.ndarray, caches: list, head: bool, nt: int = 0, end: int = 0):
    """One fused call over the rows x [n, d] of a prompt, appended to `caches` on `nt` threads
    (0: `prefill.fused_threads`): logits [V] of the last row, or (head False) None and only the
    last block's k and v. `end`: the position the whole prompt reaches (0: this call's end)."""
    n, start = x.shape[0], caches[0].length
    if not _room([caches] * n):  # (prefill_calls' calls of at most call_rows always fit)
        raise ContextOverflowError(f"a sliding-window cache cannot take {n} rows in one call")
    pos = tuple(range(start, start + n))
    fused_rope.call(p, [caches] * n, pos, [caches] * n, max(end, start + n))  # one sequence: True
    pairs = []
    for c in caches:
        pairs += _kv(c) * n  # every row of block li reads and writes the same cache
    logits = np.empty((1, p.vocab), dtype=np.float32) if head else None  # [1, V]: the last row's
    nt = nt or prefill.fused_threads(kernels.num_threads())
    ckernels.decode(p.layers, tuple(pairs), p.head, x, logits, pos, nt, None, None, p.exact_bf16)
    _report_experts(p, n)
    for c in caches:
        c.length = start + n
    return None if logits is None else _finish(p, logits)[0]


def step_rows(p: Plan, x: np.ndarray, states: list[list], reduce=None) -> np.ndarray | None:
    """Batched decode: x [B, d] (overwritten), row b continuing states[b] (one KVCache or None
    per block, created here on first use) -> logits [B, V]; None = use the Python path."""
    if not 1 <= x.shape[0] <= ckernels.STEP_ROWS or len(states) != x.shape[0]:
        return None
    rows = []
    for st in states:
        for li, layer in zip(p.index, p.attn):
            st[li] = mha.cache_for(layer, st[li])
        rows.append([st[li] for li in p.index])
    return _run(p, np.ascontiguousarray(x, dtype=np.float32), rows, reduce)


def prompt_rows(p: Plan, x: np.ndarray, states: list[list], lengths: list[int]):
    """Several prompts in one call: x [n, d] (overwritten) the embeddings of every prompt's new
    tokens in order, prompt b (lengths[b] tokens, n = sum <= STEP_ROWS) continuing states[b]
    (one KVCache or None per block, created here) -> logits [B, V] of each prompt's last row
    (the LM head runs for those rows only); None when a state's caches are not at one position
    (the reference path then runs)."""
    rows, pos = [], []
    for st, n in zip(states, lengths):
        for li, layer in zip(p.index, p.attn):
            st[li] = mha.cache_for(layer, st[li])
        caches = [st[li] for li in p.index]
        start = caches[0].length
        if any(c.length != start for c in caches):
            return None
        rows += [caches] * n
        pos += range(start, start + n)
    last = np.cumsum(lengths) - 1
    return _run(p, np.ascontiguousarray(x, dtype=np.float32), rows, pos=tuple(pos), out_rows=last)


def step_paged(
    p: Plan,
    x: np.ndarray,
    pools: list,
    pos: tuple,
    tables: tuple,
    page_size: int,
    out_rows=None,
    reduce=None,
):
    """Batched decode over a paged KV pool -> logits [n, V] (or of `out_rows` only). x [n, d]
    (overwritten); pools[j] the (k, v) arrays [pages * page_size, kv_heads, head_dim] of enabled
    block p.index[j]; row i writes position pos[i] and reads its earlier ones through its int32
    page table tables[i]. `reduce`: a tensor-parallel shard's all-reduce (as `_run`). None when
    a length-dependent rope's rows disagree (poly.serving.paged then takes the reference path)."""
    n = x.shape[0]
    if not fused_rope.call(p, [None] * n, pos, list(tables)):
        return None
    caches = []
    for k, v in pools:
        caches += (k, v) * n
    logits, out = _logits(p, n, out_rows)
    tuner = p.tuners.setdefault(n, ThreadTuner())
    nt = tuner.threads(kernels.num_threads())
    t0 = time.perf_counter()
    hook = None
    if reduce is not None:
        buf = np.empty_like(x)  # [n, d]
        hook = (buf, lambda: reduce(buf))
    ckernels.decode(
        p.layers,
        tuple(caches),
        p.head,
        x,
        out,
        pos,
        nt,
        (page_size, tables),
        hook,
        p.exact_bf16,
    )
    tuner.record(nt, time.perf_counter() - t0)
    _report_experts(p, n)
    return _finish(p, logits)

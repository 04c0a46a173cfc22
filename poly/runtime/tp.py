"""Tensor parallelism: one loaded Transformer split over the ranks of a communicator.

The Megatron split (docs/parallel.md): Q/K/V and gate/up (a plain MLP's up) are column-parallel (each rank keeps
whole KV groups with their query heads, and a range of the intermediate dimension in whole
quant blocks); O and down are row-parallel (the matching columns), each followed by one
all-reduce sum of the [n, d] partial outputs. Their biases count once (rank 0 keeps them).
Embeddings and the final norm are replicated; the LM head is split by vocabulary rows and the
logits are all-gathered (every rank ends with the same [V] logits). Each rank holds only its
slices; sources that are memory-mapped (.entity, GGUF) are read only for those slices.

Block recipes (poly.recipe.BlockRecipe) split the same way: norms (post-norms, LayerNorm) are
replicated and run after a branch's all-reduce; a parallel block sums both branches before one
all-reduce; soft-capping, windows, sinks (sliced per head) and RoPE options are per head; logit
scale and final soft-capping follow the gather. A q/k norm over all heads (OLMo 2) sums its
squares over the ranks (one [n, 2] all-reduce). MoE layers are refused.

`shard(model, comm)` returns a `TPTransformer`: the same Transformer API (forward, forward_all,
forward_batch, stream, generate) on this rank's shard. The fused C decode step runs on the shard
with the all-reduces called from inside it (poly.runtime.fused `reduce=`); the Python path (prefill,
fallback) runs the same blocks with the all-reduces between them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from poly.errors import TensorParallelError
from poly.layer import LayerType
from poly.model.block import NORM_ROLES, build_block, is_recipe_block, run_block, slots
from poly.model.transformer import Transformer
from poly.network import VolumetricNetwork
from poly.nn import layout
from poly.ops import linear
from poly.runtime import fused
from poly.runtime.shard import (
    Split,
    arrays_of,
    col_grain,
    cols,
    drop_pages,
    make_split,
    mapping_of,
    qk_norm_share,
    rows,
)
from poly.weights import aligned_zeros


class TPTransformer(Transformer):
    """This rank's shard of a Transformer; every rank must make the same calls in step.

    Lockstep driving (poly.runtime.lockstep): with `leading` set (rank 0), every collective
    call (forward, forward_all, forward_batch, reset, truncate, rank_values) is first broadcast
    to the other ranks, which run the same call in `lockstep.follow`: only rank 0 then needs
    the tokenizer, the sampler and the I/O, and the sampled token reaches the others as the
    next forward's ids."""

    comm: Any
    split: Split
    leading = False
    following = False  # in lockstep.follow: logits go to rank 0 only (forward returns None)
    _muted = False  # inside an announced call: its inner calls are not announced again

    def _announce(self, op: str, *args: Any) -> None:
        if self.leading and not self._muted:
            self.comm.bcast([op, *args])

    def reset(self) -> None:
        self._announce("reset")
        super().reset()

    def truncate(self, n: int) -> None:
        self._announce("truncate", int(n))
        super().truncate(n)

    def rank_values(self, value: float | None = None) -> list[float]:
        """`value` of every rank, on every rank (None: each rank's peak RSS in MB)."""
        self._announce("rank_values", None)
        if value is None:
            value = _rank_value()
        got = self.comm.allgather_cols(np.array([[value]], np.float32), (1,) * self.comm.size)
        return [float(v) for v in got[0]]

    def _gather(self, local: np.ndarray) -> np.ndarray | None:
        """Local logits [n, V_rank] -> [n, V] on every rank (lockstep: on rank 0 only)."""
        local = np.ascontiguousarray(local, dtype=self.activation_dtype)
        if self.leading or self.following:
            return self.comm.gather_cols(local, self.split.vocab_counts)
        return self.comm.allgather_cols(local, self.split.vocab_counts)

    def _reduce(self, v: np.ndarray) -> np.ndarray:
        v = np.ascontiguousarray(v, dtype=self.activation_dtype)
        self.comm.allreduce(v)
        return v

    def _block(self, blk, x: np.ndarray, caches: list | None = None, rows=None) -> np.ndarray:
        """The recipe's block (poly.model.block.run_block) with each branch's partial output
        all-reduced; `rows` (an index): only those rows go on through the FFN (every rank cuts
        the same rows)."""
        return run_block(blk, x, caches, rows=rows, cfg=self.config, reduce=self._reduce)

    def hidden_states(self, ids: Sequence[int], last: bool = False) -> np.ndarray:
        """Normed hidden [n, H], or [1, H] with `last` (the last block's MLP on the last row
        only, as Transformer.hidden_states)."""
        x = self.embed(self.check_ids(ids), self.activation_dtype)  # [n, H]
        live = [blk for blk in self.network.layers if not blk.is_disabled]
        for i, blk in enumerate(live):
            x = self._block(blk, x, rows=slice(-1, None) if last and i == len(live) - 1 else None)
        return self.norm_final(x[-1:] if last else x)

    def _head(self, h: np.ndarray) -> np.ndarray | None:
        """Normed rows [n, H] -> logits [n, V]: this rank's vocabulary rows (and bias),
        gathered, then logit_scale and soft-capping (elementwise: after the gather)."""
        local = linear(h, self._lm_head)
        if self.lm_head_bias is not None:
            local += self.lm_head_bias.astype(local.dtype, copy=False)
        out, cfg = self._gather(local), self.config
        if out is None:
            return None
        if cfg.logit_scale != 1:
            out *= np.asarray(cfg.logit_scale, out.dtype)
        if cfg.final_logit_softcap:
            cap = np.asarray(cfg.final_logit_softcap, out.dtype)
            out = np.tanh(out / cap) * cap
        return out

    def forward(self, ids: Sequence[int]) -> np.ndarray:
        arr = self.check_ids(ids)
        self._announce("forward", arr.tolist())
        if arr.size == 1 and self.activation_dtype == np.float32:  # the fused C step on the
            # shard, its all-reduces called from inside it
            p = fused.plan(self)
            if p is not None:
                x = self.embed(arr)[0]  # [H] (times embedding_scale)
                local = fused.step(self, p, x, reduce=self.comm.allreduce)
                if local is not None:
                    return _row0(self._gather(local.reshape(1, -1)))
        return _row0(self._head(self.hidden_states(arr, last=True)))  # [1, H] -> [V]

    def forward_all(self, ids: Sequence[int]) -> np.ndarray:
        self._announce("forward_all", self.check_ids(ids).tolist())
        return self._head(self.hidden_states(ids))

    def forward_batch(
        self, sequences: Sequence[Sequence[int]], states: list | None = None
    ) -> np.ndarray:
        """Logits [B, V]; one token per sequence runs as one batched step (fused when it
        applies), anything else one sequence at a time."""
        if states is None:
            states = [self.new_state() for _ in sequences]
        elif self.leading:
            raise TensorParallelError("a leading rank's forward_batch cannot take states")
        if len(states) != len(sequences):
            raise TensorParallelError("forward_batch needs one state per sequence")
        seqs = [self.check_ids(s) for s in sequences]
        self._announce("forward_batch", [s.tolist() for s in seqs])
        if seqs and all(s.size == 1 for s in seqs):
            return self._batched_step(np.concatenate(seqs), states)
        saved, self._muted = self.swap_state(self.new_state()), True
        out = []
        try:
            for i, seq in enumerate(seqs):
                self.swap_state(states[i])
                out.append(self.forward(seq))
                states[i] = self.swap_state(self.new_state())
        finally:
            self.swap_state(saved)
            self._muted = False
        return None if out[0] is None else np.stack(out)  # [B, V] (None: a following rank)

    def _batched_step(self, ids: np.ndarray, states: list) -> np.ndarray:
        x = self.embed(ids, self.activation_dtype)  # [B, H]
        p = fused.plan(self) if self.activation_dtype == np.float32 else None
        if p is not None:
            local = fused.step_rows(p, x, states, reduce=self.comm.allreduce)
            if local is not None:
                return self._gather(local)
        for li, blk in enumerate(self.network.layers):
            if blk.is_disabled:
                continue
            caches = [st[li] for st in states]
            x = self._block(blk, x, caches)
            for st, cache in zip(states, caches):
                st[li] = cache  # KVCaches created on first use
        return self._head(self.norm_final(x))


def _row0(logits: np.ndarray | None) -> np.ndarray | None:
    return None if logits is None else logits[0]


def _rank_value() -> float:
    """A rank's answer to `rank_values(None)`: its peak RSS in MB (VmHWM on Linux)."""
    import resource
    import sys

    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 / (1024 if sys.platform == "darwin" else 1)


# --- sharding -----------------------------------------------------------------------------------


def _vec(v: Any, sel: slice = slice(None)) -> np.ndarray | None:
    return None if v is None else np.array(v[sel], dtype=np.float32)  # an own copy


def _attn_parts(c: dict, split: Split, head_dim: int, norm_all: bool) -> dict:
    q = slice(split.heads[0] * head_dim, split.heads[1] * head_dim)
    kv = slice(split.kv_heads[0] * head_dim, split.kv_heads[1] * head_dim)
    out = {
        "w_q": rows(c["w_q"], q.start, q.stop),
        "w_k": rows(c["w_k"], kv.start, kv.stop),
        "w_v": rows(c["w_v"], kv.start, kv.stop),
        "w_o": cols(c["w_o"], q.start, q.stop),
        "b_q": _vec(c.get("b_q"), q),
        "b_k": _vec(c.get("b_k"), kv),
        "b_v": _vec(c.get("b_v"), kv),
        "b_o": _row_parallel_bias(c.get("b_o"), split.rank),
    }
    for name, sel in (("q_norm", q), ("k_norm", kv)):
        for comp in (name, f"{name}_bias"):  # shared [head_dim]: whole; [q]/[kv]: this rank's
            if c.get(comp) is not None:
                out[comp] = _vec(c[comp], sel if norm_all else slice(None))
    if c.get("sinks") is not None:  # one logit per query head
        out["sinks"] = _vec(c["sinks"], slice(*split.heads))
    return out


def _mlp_parts(c: dict, split: Split) -> dict:
    """Gate/up rows and down columns of this rank's intermediate range (a plain MLP: up only)."""
    a, b = split.inter
    out = {
        "w_down": cols(c["w_down"], a, b),
        "b_down": _row_parallel_bias(c.get("b_down"), split.rank),
    }
    for w, bias in (("w_gate", "b_gate"), ("w_up", "b_up")):
        if w in c:
            out[w], out[bias] = rows(c[w], a, b), _vec(c.get(bias), slice(a, b))
    return out


def _row_parallel_bias(v: Any, rank: int) -> np.ndarray | None:
    """Added before the all-reduce, so only rank 0 keeps it (the others add zeros)."""
    if v is None:
        return None
    return _vec(v) if rank == 0 else np.zeros(len(v), dtype=np.float32)


def _install(layer, src_store, parts: dict) -> None:
    """Into the float32 master when the source reads its master, else as the same version."""
    if src_store.active is None:
        views = layout.views(layer)
        for name, value in parts.items():
            if value is not None:
                views[name][...] = value
    else:
        layer.weights.set_version(src_store.active, parts)


def _copy_norm(src, dst) -> None:
    """A replicated norm's parameters (gamma; a LayerNorm's beta too) into dst's master."""
    views = layout.views(dst)
    for name, value in layout.components(src).items():
        views[name][...] = value


def _new_block(src, cfg, index: int) -> tuple[Any, list]:
    """An empty local block like `src` (block `index`: its window, RoPE), and its layers that
    need a float32 master."""
    blk = build_block(cfg, allocate=False, index=index)
    blk.is_disabled = src.is_disabled
    s_subs, subs, at = src.sequential_layers, blk.sequential_layers, slots(cfg.block)
    norms = [at[r] for r in NORM_ROLES if r in at]
    for k in norms:
        subs[k].rms_norm_eps = s_subs[k].rms_norm_eps
    attn, mlp = at["attn"], at["mlp"]
    subs[attn].max_seq_len = s_subs[attn].max_seq_len
    subs[attn].rms_norm_eps = s_subs[attn].rms_norm_eps
    subs[mlp].activation = s_subs[mlp].activation
    need = [subs[k] for k in norms]
    need += [subs[k] for k in (attn, mlp) if s_subs[k].weights.active is None]
    return blk, need


def _arena(layers: list) -> None:
    """The masters of `layers` carved from one buffer: one huge-page mapping for the shard
    (each master alone rounds up to whole 2 MB pages: a 2.4 MB one would hold 4 MB)."""
    sizes = [-(-layer.weights.size // 16) * 16 for layer in layers]  # 64-byte aligned starts
    buf = aligned_zeros(sum(sizes))
    off = 0
    for layer, n in zip(layers, sizes):
        layer.weights.master = buf[off : off + layer.weights.size]
        off += n


def _fill_block(src, blk, split: Split, cfg) -> None:
    s_subs, subs, at = src.sequential_layers, blk.sequential_layers, slots(cfg.block)
    for role in NORM_ROLES.intersection(at):
        _copy_norm(s_subs[at[role]], subs[at[role]])
    s_attn, s_mlp = s_subs[at["attn"]], s_subs[at["mlp"]]
    # weights over all heads (olmo2) or one row per head (cohere): sliced by the rank's heads
    norm_all = bool(s_attn.qk_norm and (s_attn.qk_norm_all or s_attn.qk_norm_heads))
    parts = _attn_parts(layout.components(s_attn), split, cfg.head_dim, norm_all)
    _install(subs[at["attn"]], s_attn.weights, parts)
    _install(subs[at["mlp"]], s_mlp.weights, _mlp_parts(layout.components(s_mlp), split))


def _mappings(model) -> list:
    """Every read-only file mapping the model's weights read (.entity, GGUF)."""
    found: dict[int, Any] = {}
    values = [model._embeddings, model._lm_head]
    for layer in model.network.walk():
        if layer.weights is not None and layer.weights.size:
            values += list(layout.components(layer).values())
    for v in values:
        for a in arrays_of(v):
            mm = mapping_of(a)
            if mm is not None:
                found[id(mm)] = mm
    return list(found.values())


def _inter_grain(model) -> int:
    grains = [
        col_grain(layout.components(model.mlp(i))["w_down"]) for i in range(len(model.blocks()))
    ]
    return math.lcm(1, *grains)


def _check_splittable(model: Transformer) -> None:
    """TensorParallelError (one line) for what the split does not cover."""
    cfg = model.config
    for i, b in enumerate(model.blocks()):
        if not b.is_disabled and not is_recipe_block(b, cfg.block):
            raise TensorParallelError(
                f"tensor parallelism needs the decoder blocks as built; block {i} is not "
                "(tiling or an edited block?)"
            )
    if any(model.mlp(i).type == LayerType.MOE for i in range(len(model.blocks()))):
        raise TensorParallelError(
            f"tensor parallelism does not split MoE layers yet ({cfg.architecture})"
        )


def shard(model: Transformer, comm: Any) -> Transformer:
    """This rank's TPTransformer of `model` (the model itself when comm has one rank). Every
    rank must call it with the same model; the source model can be dropped afterwards."""
    if comm.size == 1:
        return model
    _check_splittable(model)
    cfg = model.config
    split = make_split(cfg, comm.size, comm.rank, _inter_grain(model))
    local = dataclasses.replace(
        cfg,
        num_heads=split.heads[1] - split.heads[0],
        num_kv_heads=split.kv_heads[1] - split.kv_heads[0],
        intermediate_size=split.inter[1] - split.inter[0],
    )
    maps = _mappings(model)
    made = [_new_block(blk, local, i) for i, blk in enumerate(model.blocks())]
    _arena([layer for _, need in made for layer in need])
    net = VolumetricNetwork(1, 1, 1, cfg.num_layers)
    share = qk_norm_share(comm, cfg)
    for i, (src, (blk, _)) in enumerate(zip(model.blocks(), made)):
        _fill_block(src, blk, split, cfg)
        attn = blk.sequential_layers[slots(cfg.block)["attn"]]
        if attn.qk_norm and attn.qk_norm_all:
            attn.qk_norm_share = share
        net.set_layer(0, 0, 0, i, blk)
        drop_pages(maps)  # pages read for this block's cuts leave the RSS
    tp = TPTransformer(local, net, activation_dtype=model.activation_dtype)
    tp.comm, tp.split = comm, split
    tp._embeddings = model._embeddings  # replicated (a memmap view stays one)
    tp._lm_head = rows(model._lm_head, *split.vocab)
    if model.lm_head_bias is not None:
        tp.lm_head_bias = _vec(model.lm_head_bias, slice(*split.vocab))
    _copy_norm(model.final_norm_layer, tp.final_norm_layer)
    tp.final_norm_layer.rms_norm_eps = model.final_norm_layer.rms_norm_eps
    for name in ("tokenizer", "chat_template", "eos_token_ids", "generation_defaults"):
        setattr(tp, name, getattr(model, name))
    tp.source = dict(model.source, tp=comm.size, tp_rank=comm.rank)
    drop_pages(maps)
    return tp

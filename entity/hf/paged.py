"""MoE experts of an HF snapshot under an expert budget (``load_hf(max_resident_experts=N)``):
the expert tensors stay mapped from their safetensors files and one
`poly.runtime.expert_cache.ExpertPager` keeps at most N experts resident.

A float32 expert (one tensor per expert, Mixtral/Qwen/OLMoE, or a slab of GraniteMoE's
stacks) runs on its mapped rows as they are. Any other stored form is a `PagedMatrix` per
matrix, read into float32 values (the values the all-resident load widens or unstacks) while
the expert is resident: float16/bfloat16 experts, GPT-OSS's transposed x @ W stacks with gate
and up interleaved, and its MXFP4 blocks (kept as bfloat16, which holds them exactly).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from poly.quant.ggml import dequantize_mxfp4_hf

VIEWS = ("w_gate", "w_up", "w_down")
_STACKS = ("stack.gate_up", "stack.down", "stack.gate_up_t", "stack.down_t")


def is_expert(component: str) -> bool:
    """An MoE component paged by the budget (the expert biases are small: read in)."""
    return component.startswith(("experts.", "mx.")) or component in _STACKS


def expert_names(src) -> list[str]:
    return [n for n, s in src.slots.items() if s.part == "mlp" and is_expert(s.component)]


def _f32(arr: np.ndarray) -> np.ndarray:
    return np.asarray(arr, np.float32)


def _matrix(read, shape, compact: bool = False):
    from poly.runtime.expert_cache import PagedMatrix

    return PagedMatrix(shape, read, compact=compact)


def _as_is(arr: np.ndarray):
    """A mapped [out, in] expert matrix: the rows themselves when float32, else read on load."""
    if arr.dtype == np.float32 and arr.flags.c_contiguous and arr.flags.aligned:
        return arr
    return _matrix(lambda: _f32(arr), arr.shape)


def _expert(comps: dict, e: int, width: int) -> dict[str, Any]:
    """Expert e's w_gate / w_up / w_down from the block's mapped components."""
    if f"experts.{e}.w_gate" in comps:
        return {v: _as_is(comps[f"experts.{e}.{v}"]) for v in VIEWS}
    if "stack.gate_up" in comps:  # granite [E, 2I, d]: the gate rows, then the up rows
        gu = comps["stack.gate_up"][e]
        return {"w_gate": _as_is(gu[:width]), "w_up": _as_is(gu[width:]),
                "w_down": _as_is(comps["stack.down"][e])}  # fmt: skip
    if "stack.gate_up_t" in comps:  # GPT-OSS x @ W [d, 2I]: gate even columns, up odd
        gu, down = comps["stack.gate_up_t"][e], comps["stack.down_t"][e]
        d = gu.shape[0]
        return {"w_gate": _matrix(lambda: _f32(gu).T[0::2], (width, d)),
                "w_up": _matrix(lambda: _f32(gu).T[1::2], (width, d)),
                "w_down": _matrix(lambda: _f32(down).T, (d, width))}  # fmt: skip
    blocks, scales = comps["mx.gate_up.blocks"][e], comps["mx.gate_up.scales"][e]
    dblocks, dscales = comps["mx.down.blocks"][e], comps["mx.down.scales"][e]
    d = dblocks.shape[0]

    def gate_up(part: int):
        return lambda: dequantize_mxfp4_hf(blocks, scales)[part::2]  # rows [2I, d] interleaved

    return {"w_gate": _matrix(gate_up(0), (width, d), compact=True),
            "w_up": _matrix(gate_up(1), (width, d), compact=True),
            "w_down": _matrix(lambda: dequantize_mxfp4_hf(dblocks, dscales), (d, width), True)}  # fmt: skip


def _biases(comps: dict, e: int, sub) -> dict[str, np.ndarray]:
    """GPT-OSS's expert biases (gate even, up odd), or zeros."""
    if "stack.gate_up_bias" in comps:
        gu = _f32(comps["stack.gate_up_bias"][e])
        return {"b_gate": np.ascontiguousarray(gu[0::2]), "b_up": np.ascontiguousarray(gu[1::2]),
                "b_down": np.ascontiguousarray(_f32(comps["stack.down_bias"][e]))}  # fmt: skip
    return {"b_gate": np.zeros(sub.output_height, np.float32),
            "b_up": np.zeros(sub.output_height, np.float32),
            "b_down": np.zeros(sub.input_height, np.float32)}  # fmt: skip


def _ranges(src, names: dict[str, str], e: int, experts: int) -> list[tuple]:
    """(mapping, offset, length) of expert e in every tensor `names` holds for it."""
    out = []
    for comp, name in names.items():
        f, info = src.checkpoint.where[name], src.checkpoint.info(name)
        if comp.startswith("experts."):
            if comp.split(".")[1] == str(e):
                out.append((f.snapshot, f.offset(name), info.nbytes))
        else:  # a stack: expert e's slab
            slab = info.nbytes // experts
            out.append((f.snapshot, f.offset(name) + e * slab, slab))
    return out


def drop_expert_masters(tf) -> None:
    """The routed experts get no float32 masters (they come from the files)."""
    from poly.layer import LayerType
    from poly.nn import moe

    for i in range(tf.config.num_layers):
        if tf.mlp(i).type == LayerType.MOE:
            for sub in moe.experts(tf.mlp(i)):
                sub.weights.master = None


def install(tf, i: int, comps: dict, src, pager) -> dict:
    """Block i's experts as stored versions on their mapped bytes, each known to `pager`;
    returns the components left for the float32 masters (router, shared expert ...)."""
    from poly.nn import moe
    from poly.runtime.expert_cache import PagedMatrix

    layer = tf.mlp(i)
    cfg = layer.moe
    names = {s.component: n for n, s in src.slots.items()
             if s.block == i and s.part == "mlp" and is_expert(s.component)}  # fmt: skip
    for e, sub in enumerate(moe.experts(layer)):
        mats = _expert(comps, e, cfg.expert_intermediate_size)
        sub.weights.set_version("paged", {**_biases(comps, e, sub), **mats}, activate=True)
        paged = [m for m in mats.values() if isinstance(m, PagedMatrix)]
        pager.add(i, e, _ranges(src, names, e, cfg.num_experts), paged)
    layer.expert_cache = pager.handle(i)
    return {k: v for k, v in comps.items() if not is_expert(k) and not k.startswith("stack.")}

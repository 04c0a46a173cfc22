"""Mixture-of-experts GGUF files as llama.cpp's converter writes them (Mixtral as arch ``llama``,
``qwen2moe``, ``qwen3moe``, ``olmoe``, ``granitemoe``, ``gpt-oss``).

Metadata: ``{arch}.expert_count`` (E), ``expert_used_count`` (top-k), ``expert_feed_forward_length``
(expert width; Mixtral files use ``feed_forward_length``), ``expert_shared_feed_forward_length``,
optional ``expert_weights_norm`` and ``expert_gating_func`` (1 softmax, 2 sigmoid). When the norm
key is absent the flag llama.cpp hard-codes per model file applies (llama/Mixtral and qwen3moe
renormalise the top-k weights, qwen2moe does not).

Tensors per sparse block (numpy shapes; ggml lists dims fastest-first):
``ffn_gate_inp`` [E, d] (router), ``ffn_{gate,up}_exps`` [E, I, d], ``ffn_down_exps`` [E, d, I]
(expert e is the slab [e], kept in its quantized blocks and mapped, not copied), the shared
expert ``ffn_{gate,up,down}_shexp`` and its gate ``ffn_gate_inp_shexp`` [1, d]; or the legacy
per-expert ``ffn_{gate,up,down}.<e>.weight``. A block without ``ffn_gate_inp`` is dense.
GPT-OSS adds ``ffn_gate_inp.bias`` [E] (router bias) and ``ffn_{gate,up}_exps.bias`` [E, I],
``ffn_down_exps.bias`` [E, d]; its experts may be MXFP4 (ggml type 39). What llama.cpp hard-codes
per architecture (the gating, the clamped SwiGLU) comes from the family's ``MoENames.options``.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from poly.config import LIMITS, MoEConfig
from poly.errors import GGUFFormatError, LayerConfigError, UnsupportedError

MAX_EXPERTS = LIMITS["num_experts"]  # the table of every format (llama.cpp LLAMA_MAX_EXPERTS)
NORM_DEFAULT = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}
GATING = {0: "softmax", 1: "softmax", 2: "sigmoid"}  # 0 = key absent (llama.cpp's default)
LEGACY = re.compile(r"ffn_(gate|up|down)\.(\d{1,4})\.weight")
STACKED = {"ffn_gate_exps.weight": "w_gate", "ffn_up_exps.weight": "w_up",
           "ffn_down_exps.weight": "w_down"}  # fmt: skip
SHARED = {"ffn_gate_shexp.weight": "w_gate", "ffn_up_shexp.weight": "w_up",
          "ffn_down_shexp.weight": "w_down"}  # fmt: skip
_VIEW = {"gate": "w_gate", "up": "w_up", "down": "w_down"}
BIASES = {"ffn_gate_exps.bias": "b_gate", "ffn_up_exps.bias": "b_up",
          "ffn_down_exps.bias": "b_down"}  # fmt: skip


def _int(gg, key: str, default: int | None = None) -> int | None:
    value = gg.metadata.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GGUFFormatError(
            f"metadata {key} must be an integer >= 0, got {value!r}", path=gg.path
        )
    return value


def moe_config(gg, arch: str, layers: int, ffn: int, options=None) -> MoEConfig | None:
    """The MoEConfig of a GGUF file, None when it has no experts. ``options``: MoEConfig fields
    the family fixes (llama.cpp hard-codes them per architecture); biases follow the tensors."""
    n = _int(gg, f"{arch}.expert_count", 0)
    if not n:
        return None
    k = _int(gg, f"{arch}.expert_used_count", 0)
    if n > MAX_EXPERTS:
        raise GGUFFormatError(f"{arch}.expert_count {n} exceeds {MAX_EXPERTS}", path=gg.path)
    if not 1 <= k <= n:
        raise GGUFFormatError(
            f"{arch}.expert_used_count {k} is outside [1, expert_count {n}]",
            path=gg.path,
        )
    func = _int(gg, f"{arch}.expert_gating_func", 0)
    if func not in GATING:
        raise UnsupportedError(f"{arch}.expert_gating_func {func} is not supported", path=gg.path)
    norm = gg.metadata.get(f"{arch}.expert_weights_norm", NORM_DEFAULT.get(arch, True))
    shared = 0
    if "blk.0.ffn_gate_shexp.weight" in gg.tensors:
        shared = _int(gg, f"{arch}.expert_shared_feed_forward_length", 0) or 0
    dense = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in gg.tensors)
    first = next((i for i in range(layers) if i not in dense), 0)
    opts = {"router_bias": f"blk.{first}.ffn_gate_inp.bias" in gg.tensors,
            "expert_bias": f"blk.{first}.ffn_gate_exps.bias" in gg.tensors,
            "gating": GATING[func], **(options or {})}  # fmt: skip
    try:
        width = _int(gg, f"{arch}.expert_feed_forward_length", 0) or ffn
        return MoEConfig(n, k, width, norm_topk_prob=bool(norm), shared_intermediate_size=shared,
                         dense_layers=dense, **opts)  # fmt: skip
    except LayerConfigError as exc:
        raise GGUFFormatError(f"inconsistent MoE metadata: {exc.message}", path=gg.path) from None


def tensor_shape(cfg, suffix: str, path: str) -> tuple[int, ...] | None:
    """Expected numpy shape of an MoE block tensor (None: not an MoE tensor)."""
    moe, d = cfg.moe, cfg.hidden_size
    if moe is None:
        return None
    n, width, ws = moe.num_experts, moe.expert_intermediate_size, moe.shared_intermediate_size
    if suffix in STACKED:
        return (n, d, width) if suffix.startswith("ffn_down") else (n, width, d)
    if suffix == "ffn_gate_inp.weight":
        return (n, d)
    if moe.router_bias and suffix == "ffn_gate_inp.bias":
        return (n,)
    if moe.expert_bias and suffix in BIASES:
        return (n, d) if suffix.startswith("ffn_down") else (n, width)
    if ws and suffix in SHARED:
        return (d, ws) if suffix.startswith("ffn_down") else (ws, d)
    if ws and suffix == "ffn_gate_inp_shexp.weight":
        return (1, d)
    m = LEGACY.fullmatch(suffix)
    if m:
        if int(m.group(2)) >= n:
            raise GGUFFormatError(
                f"expert index {m.group(2)} in blk.*.{suffix} is out of range (expert_count {n})",
                path=path,
            )
        return (d, width) if m.group(1) == "down" else (width, d)
    return None


def required(cfg, i: int, names) -> list[str]:
    """The tensors sparse block i must have (stacked experts, or every legacy per-expert one)."""
    moe, base = cfg.moe, f"blk.{i}."
    out = [base + "ffn_gate_inp.weight"]
    if base + "ffn_gate_exps.weight" in names or base + "ffn_gate.0.weight" not in names:
        out += [base + s for s in STACKED]
    else:
        out += [f"{base}ffn_{p}.{e}.weight" for e in range(moe.num_experts) for p in _VIEW]
    if moe.shared_intermediate_size:
        out += [base + s for s in (*SHARED, "ffn_gate_inp_shexp.weight")]
    out += [base + "ffn_gate_inp.bias"] if moe.router_bias else []
    out += [base + s for s in BIASES] if moe.expert_bias else []
    return out


def _expert(loader, i: int, e: int, view: str) -> Any:
    """Expert e's matrix: a slab of the stacked tensor (or its legacy tensor)."""
    from poly.quant.qtensor import GGUFMatrix

    gg, name = loader.gg, f"blk.{i}.ffn_{view[2:]}_exps.weight"
    if name not in gg.tensors:
        return loader.matrix(f"blk.{i}.ffn_{view[2:]}.{e}.weight", "expert")
    info = gg.tensors[name]
    if not loader.keep:
        return gg.dequantize(name, rows=slice(e, e + 1))[0]  # [rows, cols]
    raw = gg.tensor_bytes(name)[e]  # [rows, row_bytes], a view on the mapping
    w = GGUFMatrix(raw, info.ggml_type, info.shape[1:])
    if getattr(loader, "paged", False) and int(info.ggml_type) in dequantized_on_load():
        from poly.runtime.expert_cache import PagedMatrix

        # no kernel reads these blocks (no C build): dequantized once per miss (the same row
        # blocks and values as GGUFMatrix's products), bfloat16 when exact (MXFP4's always are)
        return PagedMatrix(w.shape, lambda: w.dequantize(), blockwise=True, compact=True)
    return w


def dequantized_on_load() -> tuple[int, ...]:
    """ggml type ids of expert blocks a paged load keeps as dense copies: MXFP4 (GPT-OSS) when
    the C kernels, which read its blocks as stored (csrc/formats/gguf_blocks.h), are not built."""
    from poly.runtime import ckernels

    return () if ckernels.AVAILABLE else (39,)


PAGED_TENSORS = re.compile(r"blk\.\d+\.ffn_(gate|up|down)(_exps|\.\d+)\.weight")


def expert_ranges(gg, i: int, e: int) -> list[tuple[int, int]]:
    """(offset, length) in the file of expert e of block i: its slab of each stacked tensor,
    or its legacy per-expert tensors."""
    out = []
    for part in ("gate", "up", "down"):
        stacked = gg.tensors.get(f"blk.{i}.ffn_{part}_exps.weight")
        if stacked is not None:
            slab = stacked.nbytes // stacked.shape[0]
            out.append((stacked.offset + e * slab, slab))
        else:
            t = gg.tensors[f"blk.{i}.ffn_{part}.{e}.weight"]
            out.append((t.offset, t.nbytes))
    return out


def attach_pager(tf, gg, max_resident: int) -> None:
    """The experts of every sparse block under one LRU budget (`poly.runtime.expert_cache`):
    their stored bytes stay on the file mapping (``GGUFFile(lazy=PAGED_TENSORS...)``)."""
    from poly.layer import LayerType
    from poly.nn import moe as moe_kind
    from poly.nn import swiglu
    from poly.runtime.expert_cache import ExpertPager, PagedMatrix

    pager = ExpertPager(gg.snapshot, max_resident)
    for i in range(tf.config.num_layers):
        layer = tf.mlp(i)
        if layer.type != LayerType.MOE:
            continue
        for e, sub in enumerate(moe_kind.experts(layer)):
            comps = swiglu.components(sub)
            paged = [comps[v] for v in _VIEW.values() if isinstance(comps[v], PagedMatrix)]
            pager.add(i, e, expert_ranges(gg, i, e), paged)
        layer.expert_cache = pager.handle(i)
    tf.expert_pager = pager


def fill_moe(layer, loader, i: int) -> None:
    """Sparse block i's MoE layer: float32 router (+ shared gate), experts from their slabs."""
    from poly.nn import layout
    from poly.nn import moe as moe_kind

    gg = loader.gg
    layer.weights.ensure_master()
    views = moe_kind.views(layer)
    views.router[...] = gg.dequantize(f"blk.{i}.ffn_gate_inp.weight")
    if views.router_bias is not None:
        views.router_bias[...] = gg.dequantize(f"blk.{i}.ffn_gate_inp.bias").reshape(-1)
    biases = {}  # view -> [E, n] float32: GPT-OSS's expert biases, stacked like the weights
    if layer.moe.expert_bias:
        biases = {v: gg.dequantize(f"blk.{i}.{s}") for s, v in BIASES.items()}
    subs = list(moe_kind.experts(layer))
    sources: list[dict[str, Any]] = [
        {view: _expert(loader, i, e, view) for view in _VIEW.values()} for e in range(len(subs))
    ]
    shared = moe_kind.shared_expert(layer)
    if shared is not None:
        views.shared_gate[...] = gg.dequantize(f"blk.{i}.ffn_gate_inp_shexp.weight").reshape(1, -1)
        subs.append(shared)
        sources.append({v: loader.matrix(f"blk.{i}.{s}", "shexp") for s, v in SHARED.items()})
    for e, (sub, comps) in enumerate(zip(subs, sources)):
        if e < layer.moe.num_experts:  # a routed expert: its row of each stacked bias
            comps.update({v: np.ascontiguousarray(b[e], np.float32) for v, b in biases.items()})
        if loader.keep:
            zeros = {
                "b_gate": sub.output_height,
                "b_up": sub.output_height,
                "b_down": sub.input_height,
            }
            full = {k: np.zeros(n, np.float32) for k, n in zeros.items()}
            sub.weights.set_version("gguf", {**full, **comps}, activate=True)
        else:
            sub.weights.ensure_master()
            sw = layout.swiglu(sub)
            for view, value in comps.items():
                getattr(sw, view)[...] = value

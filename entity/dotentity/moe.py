"""MoE blocks in a `.entity` v2: the blobs of a sparse block's ``mlp`` role.

    blocks.<i>.mlp.router                 float32 [E, d]   (always float32, whatever the scheme)
    blocks.<i>.mlp.shared_gate            float32 [1, d]   (Qwen2-MoE shared expert only)
    blocks.<i>.mlp.router_bias            float32 [E]      (GPT-OSS only)
    blocks.<i>.mlp.experts.<e>            f32 scheme: expert e's whole SwiGLU master (zero-copy)
    blocks.<i>.mlp.experts.<e>.<view>     other schemes: w_gate/w_up/w_down encoded like any SwiGLU
                                          matrix (q4/q8/f16/bf16), b_gate/b_up/b_down float32
    blocks.<i>.mlp.shared[.<view>]        the shared expert, same rules

Each expert is its own blob(s), so a reader maps one expert without touching the others (the
pager of `attach_pager`, `poly.runtime.expert_cache`, pages them in and out). The flat component
names used by the HF importer and `model_blocks` are ``router``, ``shared_gate``,
``experts.<e>.<view>`` and ``shared.<view>``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from entity.dotentity.blobs import as_float, put_matrix, read_matrix, read_vector
from entity.dotentity.container import EntityFile, EntityWriter
from entity.dotentity.native_blocks import native_kind
from poly.config import MoEConfig, TransformerConfig
from poly.errors import EntityFormatError, LayerConfigError

SWIGLU_VIEWS = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")


def is_sparse(cfg: TransformerConfig, i: int) -> bool:
    return cfg.moe is not None and i not in cfg.moe.dense_layers


def _expert_shapes(d: int, width: int) -> dict[str, tuple[int, ...]]:
    return {"w_gate": (width, d), "w_up": (width, d), "w_down": (d, width),
            "b_gate": (width,), "b_up": (width,), "b_down": (d,)}  # fmt: skip


def expert_prefixes(moe: MoEConfig) -> list[tuple[str, int]]:
    """(component prefix, width) of every expert sub-layer, in sub-layer order."""
    out = [(f"experts.{e}", moe.expert_intermediate_size) for e in range(moe.num_experts)]
    if moe.shared_intermediate_size:
        out.append(("shared", moe.shared_intermediate_size))
    return out


def moe_components(layer, source_components) -> dict[str, Any]:
    """A live MoE layer as flat components; ``source_components(sub)`` gives one expert's (float32
    arrays, or native GGUF block matrices: the writer's rule)."""
    from poly.nn import moe

    out: dict[str, Any] = {k: v for k, v in moe.views(layer).as_dict().items() if v is not None}
    for (prefix, _), sub in zip(expert_prefixes(layer.moe), layer.sequential_layers):
        for name, value in source_components(sub).items():
            out[f"{prefix}.{name}"] = value
    return out


def write_moe(
    out: EntityWriter, cfg: TransformerConfig, i: int, got: dict, enc: str, kept: set
) -> None:
    """The blobs of sparse block i's FFN from flat components ``got``."""
    moe, d, base = cfg.moe, cfg.hidden_size, f"blocks.{i}.mlp"
    vectors = {"router": (moe.num_experts, d)}
    if moe.shared_intermediate_size:
        vectors["shared_gate"] = (1, d)
    if moe.router_bias:
        vectors["router_bias"] = (moe.num_experts,)
    for name, shape in vectors.items():
        if name not in got or tuple(np.shape(got[name])) != shape:
            raise LayerConfigError(f"block {i} mlp.{name}: expected shape {shape}")
        out.add(f"{base}.{name}", np.asarray(as_float(got[name]), np.float32))
    for prefix, width in expert_prefixes(moe):
        shapes = _expert_shapes(d, width)
        comps = {}
        for view, shape in shapes.items():
            value = got.get(f"{prefix}.{view}")
            if value is None and view.startswith("b_"):
                value = np.zeros(shape, np.float32)
            if value is None or tuple(np.shape(value)) != shape:
                raise LayerConfigError(f"block {i} mlp.{prefix}.{view}: expected shape {shape}")
            comps[view] = value
        name = f"{base}.{prefix}"
        if enc == "float32":  # the expert's whole SwiGLU master, in layout order
            flat = [np.ravel(as_float(comps[v])) for v in SWIGLU_VIEWS]
            out.add(name, np.concatenate(flat).astype(np.float32))
            continue
        for view, shape in shapes.items():
            if len(shape) == 2:
                put_matrix(out, comps[view], f"{name}.{view}", enc, kept)
            else:
                out.add(f"{name}.{view}", np.asarray(as_float(comps[view]), np.float32))


def _check_moe_blobs(ef: EntityFile, base: str, moe: MoEConfig, enc: str) -> None:
    """Every expert blob present before anything is installed (no half-loaded model)."""
    names = [f"{base}.router"] + ([f"{base}.shared_gate"] if moe.shared_intermediate_size else [])
    names += [f"{base}.router_bias"] if moe.router_bias else []
    for prefix, _ in expert_prefixes(moe):
        if enc == "float32":
            names.append(f"{base}.{prefix}")
        elif not any(n.startswith(f"{base}.{prefix}.w_gate") for n in ef.blobs):
            names.append(f"{base}.{prefix}.w_gate")
    for name in names:
        if name not in ef.blobs:
            raise EntityFormatError(f"MoE blob {name!r} missing (expert_blob)", path=ef.path)
    rec = ef.blobs[f"{base}.router"]
    if tuple(rec.shape) != (moe.num_experts, ef.meta("transformer")["hidden_size"]):
        raise EntityFormatError(
            f"{base}.router has shape {tuple(rec.shape)}, expected "
            f"({moe.num_experts}, {ef.meta('transformer')['hidden_size']}) (router_shape)",
            path=ef.path,
        )


def install_moe(layer, ef: EntityFile, i: int, enc: str) -> None:
    """Fill sparse block i's MoE layer from the file (zero-copy views on the mapping)."""
    moe, d, base = layer.moe, layer.input_height, f"blocks.{i}.mlp"
    _check_moe_blobs(ef, base, moe, enc)
    router = read_matrix(ef, "float32", f"{base}.router", (moe.num_experts, d))
    parts = [np.ravel(router)]
    if moe.shared_intermediate_size:
        parts.append(np.ravel(read_matrix(ef, "float32", f"{base}.shared_gate", (1, d))))
    if moe.router_bias:  # after the shared gate, as in the MoE master (poly.nn.moe.spec)
        parts.append(read_vector(ef, f"{base}.router_bias", moe.num_experts))
    layer.weights.master = parts[0] if len(parts) == 1 else np.concatenate(parts)
    for (prefix, width), sub in zip(expert_prefixes(moe), layer.sequential_layers):
        name = f"{base}.{prefix}"
        if enc == "float32":
            sub.weights.master = read_vector(ef, name, sub.weights.size)
            continue
        comps = {
            view: read_matrix(ef, enc, f"{name}.{view}", shape)
            if len(shape) == 2
            else read_vector(ef, f"{name}.{view}", shape[0])
            for view, shape in _expert_shapes(d, width).items()
        }
        matrices = [v for k, v in comps.items() if k.startswith("w_")]
        sub.weights.set_version("+".join(sorted({native_kind(m) or enc for m in matrices})), comps)


def attach_pager(tf, ef: EntityFile, max_resident: int) -> None:
    """Put the model's MoE experts under an LRU budget of ``max_resident`` resident experts:
    each MoE layer reports expert uses to one `poly.runtime.expert_cache.ExpertPager`
    (``tf.expert_pager``) that knows every expert's byte ranges in the file."""
    from poly.layer import LayerType
    from poly.runtime.expert_cache import ExpertPager, check_budget

    check_budget(max_resident, tf.config.moe)
    pager = ExpertPager(ef.mapping, max_resident)
    for i in range(tf.config.num_layers):
        layer = tf.mlp(i)
        if layer.type != LayerType.MOE:
            continue
        for e in range(layer.moe.num_experts):
            name = f"blocks.{i}.mlp.experts.{e}"
            recs = [r for n, r in ef.blobs.items() if n == name or n.startswith(name + ".")]
            pager.add(i, e, [(r.offset, r.length) for r in recs])
        layer.expert_cache = pager.handle(i)
    tf.expert_pager = pager

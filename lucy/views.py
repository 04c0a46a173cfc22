"""What lucy shows: rich tables for models, the convert catalogue, convert reports, bench,
inspect and the layer suite. Pure formatting: data comes from lucy.catalogue and the library."""

from __future__ import annotations

import dataclasses
import json
import re

from rich.table import Table

from lucy.catalogue import ModelRow, converted, first_field
from lucy.terminal import clean, human_bytes, human_count


def models_table(rows: list[ModelRow], title: str = "local models") -> Table:
    table = Table(title=title)
    for col in ("#", "model", "kind", "architecture", "params", "dtype", "size", "supported"):
        table.add_column(col, justify="right" if col in ("#", "params", "size") else "left")
    for i, r in enumerate(rows, 1):
        ok = "yes" if r.supported else f"no: {clean(r.reason)}"
        table.add_row(
            str(i),
            clean(r.name),
            r.kind,
            clean(r.architecture or "?"),
            human_count(r.parameters),
            clean(r.dtype or "?"),
            human_bytes(r.size_bytes),
            ok,
        )
    return table


def catalogue_table(rows: list[ModelRow]) -> Table:
    """HF model → .entity status and sizes (Loom ENTITY Talk catalogue)."""
    table = Table(title="ENTITY catalogue")
    for col in ("#", "model", "support", ".entity", "HF → .entity"):
        table.add_column(col)
    for i, r in enumerate(rows, 1):
        found = converted(r)
        ent = ", ".join(p.name for p in found) if found else "—"
        size = human_bytes(found[0].stat().st_size) if found else "—"
        table.add_row(
            str(i),
            clean(r.name),
            "yes" if r.supported else clean(r.reason),
            ent,
            f"{human_bytes(r.size_bytes)} → {size}",
        )
    return table


# --- convert ------------------------------------------------------------------------------------


def _as_dict(report) -> dict:
    if isinstance(report, dict):
        return report
    if dataclasses.is_dataclass(report):
        return dataclasses.asdict(report)
    if hasattr(report, "model_dump"):
        return report.model_dump()
    return dict(getattr(report, "__dict__", {}))


def print_convert_report(con, report, seconds: float) -> None:
    data = _as_dict(report)
    out = first_field(data, "dst", "output", "path")
    size = first_field(data, "size_bytes", "output_bytes", "bytes")
    con.print(f"wrote {clean(str(out))} ({human_bytes(size)}) in {seconds:.1f} s", markup=False)
    for note in getattr(report, "notes", ()):
        con.print(f"note: {clean(note)}", markup=False)
    recipe = getattr(report, "recipe", None)
    if recipe is not None and recipe.table:
        con.print(allocation_table(recipe))
    errors = first_field(data, "tensors", "q4_errors", "errors")
    if errors:
        con.print(verify_table(errors))


def allocation_table(recipe) -> Table:
    """The allocation: each tensor's chosen type and its predicted cost (--bpw: the measured
    KL; the default q4: the relative weighted rounding error)."""
    title = "types chosen for the default q4" if recipe.bpw is None else (
        f"types chosen for <= {recipe.bpw:g} bits per weight")  # fmt: skip
    table = Table(title=title)
    cost = "rel. error" if recipe.bpw is None else "predicted KL"
    for c in ("tensor", "params", "type", cost):
        table.add_column(c)
    for name, n, kind, cost in recipe.table:
        table.add_row(clean(name), f"{n:,}", kind, f"{cost:.3g}")
    return table


def verify_table(errors) -> Table:
    """Per-matrix quantization error rows (dicts or records) as a table."""
    rows = [_as_dict(e) for e in (errors.values() if isinstance(errors, dict) else errors)]
    rows = [r for r in rows if len(r.get("shape") or (0, 0)) == 2]  # matrices only
    if isinstance(errors, dict) and rows and not isinstance(next(iter(errors.values())), dict):
        rows = [{"tensor": k, "error": v} for k, v in errors.items()]
    cols = list(rows[0].keys()) if rows else ["tensor"]
    table = Table(title="verify: per-matrix error vs float32")
    for c in cols:
        table.add_column(str(c))
    for r in rows:
        table.add_row(*(_fmt(r.get(c)) for c in cols))
    return table


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return clean(str(v))


# --- bench --------------------------------------------------------------------------------------


def bench_table(result: dict) -> Table:
    table = Table(title=f"bench: {clean(str(result.get('model', '')))}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in (
        "load_s",
        "prompt_tokens",
        "new_tokens",
        "runs",
        "prefill_tok_s",
        "decode_tok_s",
        "first_turn_ttft_s",
        "second_turn_ttft_s",
        "peak_rss_mb",
    ):
        if key in result:
            table.add_row(key, _fmt(result[key]))
    spec = result.get("speculative") or {}
    for key in ("decode_tok_s", "speedup", "acceptance_rate", "tokens_per_pass", "same_tokens"):
        if key in spec:
            table.add_row(f"speculative {key}", _fmt(spec[key]))
    for row in result.get("sweep") or ():
        n = row["prompt_tokens"]
        table.add_row(f"prefill_tok_s at {n}", _fmt(row["prefill_tok_s"]))
        table.add_row(f"decode_tok_s after {n}", _fmt(row["decode_tok_s"]))
    return table


# --- inspect ------------------------------------------------------------------------------------


def _layer_rows(layer, index: str) -> list[dict]:
    """One row per layer, Sequential children indented by index path."""
    from poly.nn import layout

    kind = getattr(layer.type, "label", str(layer.type))
    weights = getattr(layer, "weights", None)
    row = {
        "index": index,
        "type": kind,
        "dtype": getattr(layer.dtype, "label", str(layer.dtype)),
        "weights": _stored_as(weights),
        "active": str(getattr(weights, "active", None) or "float32"),
        "params": int(layout.param_count(layer)),
        "bytes": int(weights.nbytes()) if weights is not None else 0,
    }
    rows = [row]
    if getattr(layer, "moe", None) is not None:  # experts: one summary row, see "experts"
        subs = layer.sequential_layers
        row["params"] += sum(int(layout.param_count(s)) for s in subs)
        row["bytes"] += sum(int(s.weights.nbytes()) for s in subs)
        row["active"] = ",".join(sorted({str(s.weights.active or "float32") for s in subs}))
        row["weights"] = ",".join(sorted({_stored_as(s.weights) for s in subs}))
        return rows
    for j, child in enumerate(getattr(layer, "sequential_layers", None) or []):
        rows += _layer_rows(child, f"{index}.{j}")
    return rows


def _stored_as(weights) -> str:
    """How a layer's matrices are held: the quant schemes of its active version (gguf_q4_1,
    q4 ...), else the float32 masters; "" for a layer without weights. The layer's `dtype` is
    what it computes in, which for quantized files is float32 whatever the file holds."""
    if weights is None:
        return ""
    version = weights.versions.get(weights.active) if weights.active else None
    schemes = {t.scheme for t in (version or {}).values() if getattr(t, "scheme", None)}
    if schemes:
        return ",".join(sorted(schemes))
    return "float32" if int(weights.nbytes()) else ""


def _experts_data(model) -> dict | None:
    """MoE layers: experts, top-k, gating, shared expert; the resident budget when paged."""
    moe_layers = []
    for layer in model.network.walk():
        cfg = getattr(layer, "moe", None)
        if cfg is not None:
            moe_layers.append({"layer": len(moe_layers), "experts": cfg.num_experts,
                               "top_k": cfg.top_k, "gating": cfg.gating,
                               "norm_topk_prob": cfg.norm_topk_prob,
                               "shared_width": cfg.shared_intermediate_size})  # fmt: skip
    if not moe_layers:
        return None
    pager = getattr(model, "expert_pager", None)
    return {"layers": moe_layers, "budget": None if pager is None else pager.report()}


def inspect_data(model) -> dict:
    """Everything `lucy inspect` shows, JSON-able."""
    cfg = model.config
    cfg_dict = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(vars(cfg))
    net = model.network
    grid = {k: getattr(net, k, None) for k in ("depth", "rows", "cols", "layers_per_cell")}
    layers = []
    for i, layer in enumerate(getattr(net, "layers", [])):
        layers += _layer_rows(layer, str(i))
    report = getattr(model, "memory_report", None)
    memory = {str(k): int(v) for k, v in report().items()} if callable(report) else {}
    source = getattr(model, "source", None) or {}
    return {
        "config": json.loads(json.dumps(cfg_dict, default=str)),
        "grid": grid,
        "layers": layers,
        "dtypes": sorted({row["dtype"] for row in layers}),
        "weights": sorted({w for row in layers for w in row["weights"].split(",") if w}),
        "memory": memory,
        "source": json.loads(json.dumps(source, default=str)),
        **({"experts": experts} if (experts := _experts_data(model)) else {}),
    }


# `describe_data`: the same report from a checkpoint's headers (entity.load.describe), no weights.
_BLOCK = re.compile(r"^(?:blk|model\.layers|layers|blocks)\.(\d+)\.(.*)$")
# a block tensor's sub-layer in poly.model.block (0 norm, 1 attention, 3 norm, 4 FFN/MoE), by the
# words the three formats name it with; norms first ("attn_norm" also says "attn")
_SUBLAYER = (
    (("attn_norm", "input_layernorm"), 0),
    (("ffn_norm", "post_attention_layernorm", "mlp_norm"), 3),
    (("attn",), 1),
    (("ffn", "mlp"), 4),
)
_GLOBAL = (
    (("output_norm", "model.norm", "final_norm"), "final_norm"),
    (("token_embd", "embed_tokens", "embeddings"), "embeddings"),
    (("output.", "lm_head"), "lm_head"),
)


def _place(name: str) -> str:
    """Where a tensor of the file belongs: a layer index ("3.1") or a component name."""
    m = _BLOCK.match(name)
    if m:
        rest = m.group(2)
        sub = next((j for words, j in _SUBLAYER if any(w in rest for w in words)), None)
        return f"{m.group(1)}.{sub}" if sub is not None else "other"
    return next((key for words, key in _GLOBAL if any(w in name for w in words)), "other")


def describe_data(desc) -> dict:
    """`inspect_data`'s report from the headers alone: the layer structure of the config,
    parameters from its shapes, and how each layer's tensors are stored in the file (bytes are
    the file's; the memory of a loaded model equals them but for HF snapshots, which load as
    float32)."""
    stored: dict[str, tuple[set, int]] = {}
    for t in desc.tensors:
        kinds, nbytes = stored.get(_place(t.name), (set(), 0))
        stored[_place(t.name)] = (kinds | {t.stored}, nbytes + t.nbytes)
    data = inspect_data(desc.model)  # its layer masters are unallocated: the file says
    for row in data["layers"]:
        kinds, nbytes = stored.get(row["index"], (set(), 0))
        row.update(weights=",".join(sorted(kinds)), bytes=nbytes, active="")
    data["weights"] = sorted({k for kinds, _ in stored.values() for k in kinds})
    kind_of = {row["index"]: row["type"] for row in data["layers"]}
    by_component: dict[str, int] = {}
    for where, (_, nbytes) in stored.items():
        key = kind_of.get(where, where)
        by_component[key] = by_component.get(key, 0) + nbytes
    data["memory"] = {}
    data["stored"] = by_component
    return data


def print_inspect(con, data: dict) -> None:
    cfg = Table(title="config")
    cfg.add_column("field")
    cfg.add_column("value")
    for k, v in data["config"].items():
        cfg.add_row(k, _fmt(v))
    con.print(cfg)
    g = data["grid"]
    con.print(
        f"grid: depth={g['depth']} rows={g['rows']} cols={g['cols']} "
        f"layers_per_cell={g['layers_per_cell']}  weights: {', '.join(data['weights'])}  "
        f"computes in: {', '.join(data['dtypes'])}"
    )
    layers = Table(title="layers")
    active = any(row["active"] for row in data["layers"])  # a loaded model's weight versions
    cols = ("index", "type", "dtype", "weights", *(("active",) if active else ()), "params")
    for col in (*cols, "bytes"):
        layers.add_column(col, justify="right" if col in ("params", "bytes") else "left")
    for row in data["layers"]:
        cells = [row[c] for c in cols[:-1]]
        layers.add_row(*cells, human_count(row["params"]), human_bytes(row["bytes"]))
    con.print(layers)
    if data.get("experts"):
        _print_experts(con, data["experts"])
    if data.get("fit"):
        _print_fit(con, data["fit"])
    for key, title in (("memory", "memory by component"), ("stored", "bytes in the file")):
        if data.get(key):
            mem = Table(title=title)
            mem.add_column("component")
            mem.add_column("bytes", justify="right")
            for k, v in data[key].items():
                mem.add_row(clean(k), human_bytes(v))
            con.print(mem)


def fit_data(fit, fp) -> dict:
    """`lucy inspect --fit`: an `entity.fit.Fit` and the footprint it came from."""
    return {**fit.as_dict(), "experts_total": fp.experts, "expert_bytes": fp.expert_held,
            "expert_stored_bytes": fp.expert_stored}  # fmt: skip


def _print_fit(con, f: dict) -> None:
    budget = "all resident" if f["max_resident"] is None else f"at most {f['max_resident']}"
    con.print(
        f"fits in {human_bytes(f['memory'])}: weights resident {human_bytes(f['dense'])}; "
        f"experts {budget} of {f['experts_total']} ({human_bytes(f['expert_bytes'])} each, "
        f"{human_bytes(f['experts_bytes'])} held); KV cache at {f['ctx']} tokens "
        f"{human_bytes(f['kv_bytes'])}; runtime {human_bytes(f['runtime'])}; estimate "
        f"{human_bytes(f['total'])}. Per token: {human_bytes(f['read_per_token'])} of weights "
        f"read, {human_bytes(f['disk_per_token'])} from the file (uniform routing)"
    )


def _print_experts(con, experts: dict) -> None:
    t = Table(title="mixture of experts")
    for col in ("layer", "experts", "top_k", "gating", "norm_topk_prob", "shared_width"):
        t.add_column(col)
    for row in experts["layers"]:
        t.add_row(*(str(row[c]) for c in ("layer", "experts", "top_k", "gating",
                                           "norm_topk_prob", "shared_width")))  # fmt: skip
    con.print(t)
    b = experts["budget"]
    if b is None:
        con.print("experts: all resident (no --max-experts budget)")
    else:
        con.print(f"experts: at most {b['max_resident']} of {b['experts']} resident "
                  f"({b['resident']} now, {human_bytes(b['resident_bytes'])}); hits {b['hits']}, "
                  f"misses {b['misses']}, read {human_bytes(b['bytes_read'])}")  # fmt: skip


# --- layer suite --------------------------------------------------------------------------------


def layer_suite_table(rows) -> Table:
    table = Table(title="layer test suite: forward vs float32")
    for col in ("layer", "dtype", "max |diff|", "tolerance", "bucket"):
        table.add_column(col)
    for r in rows:
        table.add_row(r.layer, r.dtype, f"{r.max_diff:.3g}", f"{r.tolerance:.0e}", r.bucket)
    return table

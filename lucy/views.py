"""What lucy shows: the local model catalogue and rich tables for models, bench, inspect, convert."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from rich.table import Table

from lucy.chat_ui import clean


def make_console(stderr: bool = False):
    """Rich console; into a pipe it is wide (no truncated tables) and writes no colour codes."""
    from rich.console import Console

    con = Console(stderr=stderr, highlight=False, soft_wrap=True)
    if not con.is_terminal and "COLUMNS" not in os.environ:
        con = Console(stderr=stderr, highlight=False, soft_wrap=True, width=160)
    return con


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"


def human_count(n: int | None) -> str:
    if n is None:
        return "?"
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{suffix}"
    return str(n)


# --- the catalogue ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelRow:
    """One runnable thing: an HF-cache snapshot or an .entity file."""

    name: str
    kind: str  # "hf" | "entity"
    path: str
    architecture: str | None = None
    parameters: int | None = None
    dtype: str | None = None
    size_bytes: int | None = None
    supported: bool = True
    reason: str = ""
    revision: str | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _field(rec, *names, default=None):
    """Read the first present attribute/key among `names` (hf_cache records may be either)."""
    for name in names:
        value = rec.get(name) if isinstance(rec, dict) else getattr(rec, name, None)
        if value is not None:
            return value
    return default


def _snapshot_facts(snapshot: Path) -> tuple[int | None, str | None]:
    """(parameter count, dtype) from the safetensors headers and config.json, best effort."""
    from safetensors import safe_open

    params, dtype = 0, None
    try:
        cfg = json.loads((snapshot / "config.json").read_text(encoding="utf-8"))
        dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    except (OSError, ValueError, AttributeError):
        pass
    try:
        for f in sorted(snapshot.glob("*.safetensors")):
            with safe_open(str(f), framework="numpy") as st:
                for key in st.keys():
                    shape = st.get_slice(key).get_shape()
                    params += int(_prod(shape))
    except Exception:  # noqa: BLE001 - a bad file shows as "?" here; loading reports it properly
        return None, dtype
    return (params or None), (str(dtype) if dtype else None)


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def hf_rows() -> list[ModelRow]:
    from entity.hf.cache import list_cached_models

    rows = []
    for rec in list_cached_models():
        snap = Path(str(_field(rec, "snapshot", "snapshot_path", "path")))
        params, dtype = _snapshot_facts(snap)
        rows.append(
            ModelRow(
                name=str(_field(rec, "repo_id")),
                kind="hf",
                path=str(snap),
                architecture=_field(rec, "architecture"),
                parameters=params,
                dtype=dtype,
                size_bytes=_field(rec, "size_on_disk", "size_bytes", "size"),
                supported=bool(_field(rec, "supported", default=False)),
                reason=str(_field(rec, "reason", default="")),
                revision=_field(rec, "revision", "commit_hash"),
            )
        )
    return rows


def entity_rows() -> list[ModelRow]:
    from entity.paths import entities_dir

    root = entities_dir()
    files = sorted(root.glob("*.entity")) if root.is_dir() else []
    rows = []
    for f in files:
        info = _entity_info(f)
        rows.append(
            ModelRow(
                name=f.stem,
                kind="entity",
                path=str(f),
                architecture=info.get("architecture"),
                parameters=info.get("parameters"),
                dtype=info.get("dtype"),
                size_bytes=f.stat().st_size,
                supported=True,
                reason=".entity",
            )
        )
    return rows


def _entity_info(path: Path) -> dict:
    """Architecture, quant scheme and parameter count from a v2 header (blobs are not read);
    {} if unreadable."""
    from poly.config import TransformerConfig

    try:
        from entity.dotentity.container import EntityFile

        spec = EntityFile(path, verify=False).header
    except Exception:  # noqa: BLE001 - one unreadable file must not break the listing
        return {}
    info = {"architecture": spec.transformer.get("architecture"), "dtype": spec.quant.get("scheme")}
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    try:  # a q4 file's blobs are packed bytes: count from the dims, not the blob shapes
        cfg = TransformerConfig.from_dict(
            {k: v for k, v in spec.transformer.items() if k in fields}
        )
        info["parameters"] = cfg.parameter_count
    except Exception:  # noqa: BLE001 - an odd header shows "?" here; loading reports it
        pass
    return info


def list_models() -> list[ModelRow]:
    return hf_rows() + entity_rows()


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
    out = _field(data, "dst", "output", "path")
    size = _field(data, "size_bytes", "output_bytes", "bytes")
    con.print(f"wrote {clean(str(out))} ({human_bytes(size)}) in {seconds:.1f} s", markup=False)
    for note in getattr(report, "notes", ()):
        con.print(f"note: {clean(note)}", markup=False)
    errors = _field(data, "tensors", "q4_errors", "errors")
    if errors:
        con.print(verify_table(errors))


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
        "peak_rss_mb",
    ):
        if key in result:
            table.add_row(key, _fmt(result[key]))
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
        "active": str(getattr(weights, "active", None) or "float32"),
        "params": int(layout.param_count(layer)),
        "bytes": int(weights.nbytes()) if weights is not None else 0,
    }
    rows = [row]
    for j, child in enumerate(getattr(layer, "sequential_layers", None) or []):
        rows += _layer_rows(child, f"{index}.{j}")
    return rows


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
        "memory": memory,
        "source": json.loads(json.dumps(source, default=str)),
    }


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
        f"layers_per_cell={g['layers_per_cell']}  dtypes: {', '.join(data['dtypes'])}"
    )
    layers = Table(title="layers")
    for col in ("index", "type", "dtype", "active", "params", "bytes"):
        layers.add_column(col, justify="right" if col in ("params", "bytes") else "left")
    for row in data["layers"]:
        layers.add_row(
            row["index"],
            row["type"],
            row["dtype"],
            row["active"],
            human_count(row["params"]),
            human_bytes(row["bytes"]),
        )
    con.print(layers)
    if data["memory"]:
        mem = Table(title="memory by component")
        mem.add_column("component")
        mem.add_column("bytes", justify="right")
        for k, v in data["memory"].items():
            mem.add_row(clean(k), human_bytes(v))
        con.print(mem)


# --- layer suite --------------------------------------------------------------------------------


def layer_suite_table(rows) -> Table:
    table = Table(title="layer test suite: forward vs float32")
    for col in ("layer", "dtype", "max |diff|", "tolerance", "bucket"):
        table.add_column(col)
    for r in rows:
        table.add_row(r.layer, r.dtype, f"{r.max_diff:.3g}", f"{r.tolerance:.0e}", r.bucket)
    return table

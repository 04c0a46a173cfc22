"""The local model catalogue: HF-cache snapshots, `.entity` files and the GGUF files of the
models dir, as `ModelRow`s.

`.entity` names come from `entity.paths` (the one rule `lucy convert`, `lucy demo` and the menu
share), so a file any of them wrote is found by the others.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from poly.quant import schemes as quant_schemes

# Conversion targets (`lucy convert --quant`) and the menu's accepted spellings of them: both come
# from the quant-scheme records (poly.quant.schemes), so a new scheme needs no edit here.
QUANTS = quant_schemes.CLI_QUANTS
QUANT_ALIASES = quant_schemes.cli_aliases()


@dataclasses.dataclass(frozen=True)
class ModelRow:
    """One runnable thing: an HF-cache snapshot or an .entity file."""

    name: str
    kind: str  # "hf" | "entity" | "gguf"
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


def first_field(rec, *names, default=None):
    """The first present attribute/key among `names` (records may be objects or dicts)."""
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
                    count = 1
                    for d in st.get_slice(key).get_shape():
                        count *= int(d)
                    params += count
    except Exception:  # noqa: BLE001 - a bad file shows as "?" here; loading reports it properly
        return None, dtype
    return (params or None), (str(dtype) if dtype else None)


def hf_cache_dir() -> str:
    """The HF hub cache lucy lists (for messages)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def hf_rows() -> list[ModelRow]:
    from entity.hf.cache import list_cached_models

    rows = []
    for rec in list_cached_models():
        snap = Path(str(first_field(rec, "snapshot", "snapshot_path", "path")))
        params, dtype = _snapshot_facts(snap)
        rows.append(
            ModelRow(
                name=str(first_field(rec, "repo_id")),
                kind="hf",
                path=str(snap),
                architecture=first_field(rec, "architecture"),
                parameters=params,
                dtype=dtype,
                size_bytes=first_field(rec, "size_on_disk", "size_bytes", "size"),
                supported=bool(first_field(rec, "supported", default=False)),
                reason=str(first_field(rec, "reason", default="")),
                revision=first_field(rec, "revision", "commit_hash"),
            )
        )
    return rows


def entity_rows() -> list[ModelRow]:
    from entity.paths import entities_dir

    return _file_rows(entities_dir(), "entity", _entity_info)


def _file_rows(root: Path, kind: str, info_of) -> list[ModelRow]:
    """One row per ``*.<kind>`` file of ``root``, described by ``info_of(path)``."""
    files = sorted(root.glob(f"*.{kind}")) if root.is_dir() else []
    rows = []
    for f in files:
        info = info_of(f)
        rows.append(
            ModelRow(
                name=f.stem,
                kind=kind,
                path=str(f),
                architecture=info.get("architecture"),
                parameters=info.get("parameters"),
                dtype=info.get("dtype"),
                size_bytes=f.stat().st_size,
                supported="error" not in info,
                reason=info.get("error", f".{kind}"),
            )
        )
    return rows


def _entity_info(path: Path) -> dict:
    """Architecture, quant scheme and parameter count from a v2 header, read by
    `peek_header` (capped, CRC-checked; the blob table and tokenizer are skipped, never built),
    so a listing stays cheap whatever the files hold. {"error": ...} if the header is bad."""
    from entity.dotentity.container import EntityVersionError, peek_header
    from poly.config import TransformerConfig
    from poly.errors import PolyError

    try:
        spec = peek_header(path, ("transformer", "quant"))
    except EntityVersionError:
        return {}  # a v1 file: loadable through the compatibility reader
    except PolyError as err:
        return {"error": err.code}
    except OSError as err:
        return {"error": err.strerror or "unreadable"}
    tr, quant = spec.get("transformer"), spec.get("quant")
    if not isinstance(tr, dict) or not isinstance(quant, dict):
        return {"error": "bad_entity"}
    info = {"architecture": tr.get("architecture"), "dtype": quant.get("scheme")}
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    try:  # a q4 file's blobs are packed bytes: count from the dims, not the blob shapes
        cfg = TransformerConfig.from_dict({k: v for k, v in tr.items() if k in fields})
        info["parameters"] = cfg.parameter_count
    except Exception:  # noqa: BLE001 - an odd header shows "?" here; loading reports it
        pass
    return info


def gguf_rows() -> list[ModelRow]:
    """The GGUF files of the models dir (`lucy demo` fetches its SmolLM2 there)."""
    from entity.paths import models_dir

    return _file_rows(models_dir(), "gguf", _gguf_info)


def _gguf_info(path: Path) -> dict:
    """Architecture, the matrices' most common tensor type and the parameter count, from the
    GGUF header and tensor table (mapped, never read in full). {"error": ...} if unusable."""
    from collections import Counter

    from entity.gguf.config import gguf_config
    from entity.gguf.reader import open_gguf
    from poly.errors import PolyError

    try:
        gg = open_gguf(path, weights=False)
        cfg = gguf_config(gg)
    except PolyError as err:
        return {"error": err.code}
    types = Counter(t.type_name for t in gg.tensors.values() if len(t.shape) == 2)
    return {
        "architecture": gg.metadata.get("general.architecture"),
        "parameters": cfg.parameter_count,
        "dtype": types.most_common(1)[0][0] if types else None,
    }


def list_models() -> list[ModelRow]:
    return hf_rows() + entity_rows() + gguf_rows()


def entity_path(row: ModelRow, quant: str = "q4") -> Path:
    """The `.entity` that convert, demo and the menu write for ``row`` (entity.paths' rule)."""
    from entity.paths import entities_dir, entity_filename

    return entities_dir() / entity_filename(row.path, quant)


def converted(row: ModelRow) -> list[Path]:
    """The `.entity` files already written for ``row``, in any quant."""
    found = (entity_path(row, q) for q in QUANTS)
    return [p for p in found if p.exists()]

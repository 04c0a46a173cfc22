"""Strict reading of a JSON object file (``config.json``, ``generation_config.json``,
``tokenizer_config.json``): a size cap, no duplicate keys, no NaN/Infinity, typed poly errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from poly.errors import ConfigError, LimitExceededError, PolyError

__all__ = ["MAX_JSON_BYTES", "read_json", "validate_json"]

MAX_JSON_BYTES = 4 * 1024 * 1024  # real configs are a few KB


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"duplicate_key: {key!r} appears twice")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise ConfigError(f"json: non-standard constant {name}")


def read_json(path: Path, error: type[PolyError] = ConfigError) -> dict[str, Any]:
    """Strict JSON object reader: size cap, no duplicate keys, no NaN/Infinity."""
    try:
        if not path.is_file():
            raise error(f"missing: {path.name} not found", path=str(path))
        if path.stat().st_size > MAX_JSON_BYTES:
            raise LimitExceededError(
                f"{path.name} is larger than {MAX_JSON_BYTES} bytes", path=str(path)
            )
        text = path.read_bytes().decode("utf-8")
        data = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except ConfigError as exc:
        exc.path = exc.path or str(path)
        raise
    except (OSError, ValueError, RecursionError) as exc:
        raise error(f"json: cannot parse {path.name}: {exc}", path=str(path)) from None
    if not isinstance(data, dict):
        raise error(f"json: {path.name} is not a JSON object", path=str(path))
    return data


def validate_json(model: type[BaseModel], data: Any, source: str | None) -> Any:
    """`data` as a `model`; a ConfigError naming the first bad key (no pydantic traceback)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "<root>"
        raise ConfigError(f"{key}: {first['msg']}", path=source) from None

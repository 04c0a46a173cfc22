"""Strict reading of a JSON object file (``config.json``, ``generation_config.json``,
``tokenizer_config.json``): a size cap, no duplicate keys, no NaN/Infinity, typed poly errors;
and records checked against name tables (`Field`, `check_fields`, `validate_json`; the `.entity`
header's schema uses the same tables). Checked by hand rather than by pydantic, whose import and
model classes an open would pay in RSS and time (docs/performance.md)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from poly.errors import ConfigError, LimitExceededError, PolyError

__all__ = [
    "MAX_JSON_BYTES",
    "Field",
    "FieldError",
    "JsonRecord",
    "check_fields",
    "read_json",
    "validate_json",
]

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


# --- records checked by name tables -------------------------------------------------------------

REQUIRED = object()  # a Field's default: the key must be present


class Field(NamedTuple):
    """One key of a record: `test` of its value (after `convert`), `what` it must be in words."""

    test: Callable[[Any], bool]
    what: str
    default: Any = None
    convert: Callable[[Any], Any] | None = None


def _number(v: Any) -> bool:  # JSON's 1e999 parses to inf: refused as NaN is
    return type(v) in (int, float) and math.isfinite(v)


def is_int(v: Any) -> bool:  # strict: a bool is not an integer
    return type(v) is int


def is_int_list(v: Any) -> bool:
    return type(v) is list and all(type(x) is int for x in v)


def is_u32(v: Any) -> bool:
    return type(v) is int and 0 <= v < 1 << 32


# The kinds of value config files hold (integers are strict: true is not 1, 1.0 is not 1).
STR = Field(lambda v: type(v) is str, "a string", REQUIRED)
INT = Field(is_int, "an integer", REQUIRED)
FLOAT = Field(_number, "a finite number", REQUIRED, float)
BOOL = Field(lambda v: type(v) is bool, "true or false", REQUIRED)
MAP = Field(lambda v: type(v) is dict, "an object", REQUIRED)
STRS = Field(lambda v: type(v) is list and all(type(x) is str for x in v), "a list of strings",
             REQUIRED)  # fmt: skip
FLOATS = Field(lambda v: type(v) is list and all(_number(x) for x in v), "a list of numbers",
               REQUIRED, lambda v: [float(x) for x in v])  # fmt: skip
TOKEN_IDS = Field(lambda v: type(v) is int or is_int_list(v), "an integer or a list of integers")


def default(kind: Field, value: Any = None) -> Field:
    """`kind`, optional: `value` when the key is absent or null."""
    return kind._replace(default=value)


class JsonRecord:
    """A checked JSON object: its table's keys as attributes; `extra` holds the keys the table
    does not name (kept by ``extra=True``)."""

    def __init__(self, values: dict[str, Any], extra: dict[str, Any]):
        self.__dict__.update(values)
        self.extra = extra
        self._names = tuple(values)

    def as_dict(self) -> dict[str, Any]:
        """Every key: the table's (checked) and the extra ones."""
        return {**self.extra, **{k: getattr(self, k) for k in self._names}}


class FieldError(ValueError):
    """The first key of a record that is not what its table says; str() is "key: problem"."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key}: {problem}")
        self.key = key


def _shown(value: Any) -> str:
    """`value` for an error line, at most 40 characters however big it is (a crafted header can
    put a million-item map where a string belongs: its full repr would take seconds)."""
    import reprlib  # here: only an error shows a value

    short = reprlib.Repr()
    short.maxstring = short.maxother = 40
    text = short.repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_fields(
    fields: dict[str, Field],
    data: dict,
    *,
    refuse_unknown: bool = False,
    null_is_absent: bool = True,
) -> dict[str, Any]:
    """`data`'s values by `fields` (defaults filled in, `convert` applied); FieldError naming the
    first bad key. ``refuse_unknown``: a key `fields` does not name is an error. ``null_is_absent``:
    a null value takes the default, as JSON configs mean it; else it is a value to test."""
    if refuse_unknown:
        for key in data:
            if key not in fields:
                raise FieldError(key, "not a known field")
    values = {}
    for key, (test, what, fallback, convert) in fields.items():
        value = data.get(key)
        if key in data and (value is not None or not null_is_absent):
            if not test(value):
                raise FieldError(key, f"must be {what}, got {_shown(value)}")
            values[key] = value if convert is None else convert(value)
        elif fallback is REQUIRED:
            raise FieldError(key, f"missing (must be {what})")
        else:
            values[key] = fallback
    return values


def validate_json(
    fields: dict[str, Field], data: Any, source: str | None, *, extra: bool = False
) -> JsonRecord:
    """`data` checked against `fields`; a ConfigError naming the first bad key. A null value is
    an absent one. ``extra``: keep the keys `fields` does not name (`JsonRecord.extra`)."""
    if type(data) is not dict:
        raise ConfigError(f"<root>: must be an object, got {type(data).__name__}", path=source)
    try:
        values = check_fields(fields, data)
    except FieldError as exc:
        raise ConfigError(str(exc), path=source) from None
    kept = {k: v for k, v in data.items() if k not in fields} if extra else {}
    return JsonRecord(values, kept)

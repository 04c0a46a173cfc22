"""The `.entity` header's msgpack, decoded under limits whatever its bytes are: a budget of
items, nesting, unique string keys, no ext types, finite numbers (`unpack`); the values an open
does not read stay bytes (`DEFERRED`). Errors are ValueErrors whose message names the fault;
`header` raises them as the file's `EntityFormatError`.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack

MAX_BLOBS = 1 << 17  # a 671B MoE stored per expert has ~60k tensors
# Containers plus their elements, summed over the whole header: each costs ~100 bytes of Python
# objects, so this bounds decoding memory whatever the bytes are (64 MB of one-byte empty arrays
# was 4.6 GB). A blob record is ~12 items: the blob table at its cap fits.
MAX_HEADER_ITEMS = 16 * MAX_BLOBS


class _ItemBudget:
    """Counts containers and elements as msgpack builds them; refuses past MAX_HEADER_ITEMS."""

    def __init__(self) -> None:
        self.items = 0

    def charge(self, n: int) -> None:
        self.items += n + 1
        if self.items > MAX_HEADER_ITEMS:
            raise ValueError(f"header holds more than {MAX_HEADER_ITEMS} values")

    def list_hook(self, value: list) -> list:
        self.charge(len(value))
        return value

    def pairs_hook(self, pairs: list[tuple[Any, Any]]) -> dict:
        self.charge(len(pairs))
        out = dict(pairs)  # the common case checked in C; `_no_dups` names what is wrong
        if len(out) != len(pairs) or not _STR_ONLY.issuperset(map(type, out)):
            return _no_dups(pairs)
        return out


_STR_ONLY = frozenset({str})


def _no_dups(pairs: list[tuple[Any, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if not isinstance(k, str):
            raise ValueError("header map key is not a string")
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} not allowed")


def _all_finite(obj: Any) -> bool:
    """No NaN or infinity anywhere in `obj` (a walk without paths: `_check_finite` names one)."""
    stack = [obj]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is float:
            if not math.isfinite(item):
                return False
        elif kind is dict:
            stack.extend(item.values())
        elif kind is list:
            stack.extend(item)
    return True


def _check_finite(obj: Any, where: str = "header") -> None:
    if isinstance(obj, float) and not math.isfinite(obj):
        raise ValueError(f"non-finite number at {where}")
    if isinstance(obj, dict):
        for k, v in obj.items():
            _check_finite(v, f"{where}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _check_finite(v, f"{where}[{i}]")


def _describe(exc: Exception) -> str:
    """msgpack's StackError (nesting deeper than its limit) has an empty message."""
    if str(exc):
        return str(exc)
    if isinstance(exc, msgpack.exceptions.StackError):
        return "nesting too deep"
    return type(exc).__name__


# Values an open does not read, kept as bytes when they are of their expected kind (anything
# else is decoded and refused as usual): the tokenizer's UTF-8 text (hashed, not decoded, when a
# kept tokenizer matches it: `poly.text.tokenizer_cache`) and the network spec (Loom's grid).
# The schema checks them as these stand-ins of their kind.
DEFERRED = {"tokenizer": ("str", ""), "network": ("map", {})}
_STR_LENGTHS = {0xD9: 1, 0xDA: 2, 0xDB: 4}  # str8/16/32: big-endian length bytes after the marker


def _kind(first: int) -> str:
    if 0xA0 <= first <= 0xBF or first in _STR_LENGTHS:
        return "str"
    if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):
        return "map"
    return "other"


def unpacker(raw: bytes) -> msgpack.Unpacker:
    """An unpacker fed `raw`, under the header's limits (its own item budget)."""
    budget = _ItemBudget()
    up = msgpack.Unpacker(
        raw=False, strict_map_key=True, object_pairs_hook=budget.pairs_hook,
        list_hook=budget.list_hook, ext_hook=_reject_ext, max_buffer_size=len(raw) + 1,
        max_array_len=MAX_BLOBS, max_map_len=MAX_BLOBS,
    )  # fmt: skip
    up.feed(raw)
    return up


def _top_map(up: msgpack.Unpacker, raw: bytes, later: dict[str, bytes]) -> dict[str, Any]:
    """The header map; `DEFERRED` values of their kind go to `later` as bytes (a string's
    UTF-8 payload, a map's msgpack), skipped by msgpack without being built."""
    out: dict[str, Any] = {}
    for _ in range(up.read_map_header()):
        key = up.unpack()
        if type(key) is not str:
            raise ValueError("header map key is not a string")
        if key in out or key in later:
            raise ValueError(f"duplicate key {key!r}")
        start = up.tell()
        kind = _kind(raw[start]) if start < len(raw) else "other"
        if key in DEFERRED and kind == DEFERRED[key][0]:
            up.skip()
            head = 1 + _STR_LENGTHS.get(raw[start], 0) if kind == "str" else 0
            later[key] = raw[start + head : up.tell()]
        else:
            out[key] = up.unpack()
    return out


def unpack(raw: bytes, later: dict[str, bytes] | None = None) -> Any:
    """One msgpack value under the header's limits (items, nesting, unique string keys, no ext
    types, finite numbers); given `later`, a map whose `DEFERRED` values go there."""
    up = unpacker(raw)
    try:
        obj = _top_map(up, raw, later) if later is not None else up.unpack()
        if up.tell() != len(raw):
            raise ValueError("extra data after the value")
        # blob records hold no float that passes their type checks: their values are not walked
        rest = obj if later is None else [v for k, v in obj.items() if k != "blobs"]
        if not _all_finite(rest):
            _check_finite(obj)
    except Exception as exc:  # msgpack raises many kinds (ValueError, StackError, ExtraData...)
        raise ValueError(f"bad msgpack header: {_describe(exc)}") from exc
    return obj


def undefer(key: str, data: bytes) -> Any:
    """A `DEFERRED` value's bytes decoded as `unpack` would have."""
    if DEFERRED[key][0] == "map":
        return unpack(data)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"bad msgpack header: {exc}") from None


def peek(raw: bytes, keys: tuple[str, ...]) -> dict[str, Any]:
    """The values of top-level ``keys`` of a msgpack map; every other value is skipped by
    msgpack without building it."""
    up = unpacker(raw)
    out: dict[str, Any] = {}
    try:
        for _ in range(up.read_map_header()):
            key = up.unpack()
            if key in keys and key not in out:
                out[key] = up.unpack()
            else:
                up.skip()
    except Exception as exc:  # msgpack raises many kinds
        raise ValueError(f"bad msgpack header: {_describe(exc)}") from exc
    return out

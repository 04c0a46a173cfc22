"""``entity.load``: one entry point for every checkpoint format, identified by content.

A directory with config.json is an HF snapshot; a file is recognised by its first bytes
(``GGUF``, ``ENTITY\\0\\0``), never by its extension; anything else that does not exist on
disk is looked up as a model id in the local HF cache. Sibling loaders are imported lazily
so that one missing or broken module does not break the others.
"""

from __future__ import annotations

import importlib
import os
import stat
from pathlib import Path
from typing import Any

from poly.errors import (
    CheckpointError,
    FormatError,
    ModelNotFoundError,
    UnsafeFormatError,
    UsageError,
)

# magic prefix -> (module, function) of the loader for that format.
MAGIC_LOADERS: dict[bytes, tuple[str, str]] = {
    b"GGUF": ("entity.gguf.loader", "load_gguf"),
    b"ENTITY\x00\x00": ("entity.dotentity.read", "load_entity"),
}
# Prefixes of formats that can run code when loaded: refused, never parsed.
UNSAFE_MAGICS: dict[bytes, str] = {
    b"\x80\x02": "pickle",
    b"\x80\x03": "pickle",
    b"\x80\x04": "pickle",
    b"\x80\x05": "pickle",
    b"PK\x03\x04": "zip (torch .bin/.pt or .npz)",
}
PREFIX_BYTES = 16


def _call(module: str, func: str, *args: Any, **kw: Any) -> Any:
    return getattr(importlib.import_module(module), func)(*args, **kw)


def _looks_like_safetensors(head: bytes) -> bool:
    # 8-byte LE header length, then the JSON object (only whitespace may precede "{").
    return len(head) > 8 and head[8:].lstrip(b" \t\r\n")[:1] == b"{"


def _load_file(path: Path, *, entity_text: bool = True, **kw: Any) -> Any:
    try:
        with open(path, "rb") as fh:
            head = fh.read(PREFIX_BYTES)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}", path=str(path)) from None
    if head.startswith(b"ENTITY\x00\x00") and not entity_text:
        kw["text"] = False  # a follower rank: no tokenizer (see `load`)
    for magic, (module, func) in MAGIC_LOADERS.items():
        if head.startswith(magic):
            return _call(module, func, path, **kw)
    for magic, kind in UNSAFE_MAGICS.items():
        if head.startswith(magic):
            raise UnsafeFormatError(
                f"{kind} file refused: it can run code when loaded; convert it to safetensors "
                "in an isolated environment with a trusted tool first",
                path=str(path),
            )
    if not head:
        raise FormatError("empty file", path=str(path))
    if _looks_like_safetensors(head):
        raise FormatError(
            "a bare .safetensors file has no config.json: load its snapshot directory instead",
            path=str(path),
        )
    raise FormatError(
        "unknown checkpoint format (not GGUF, .entity or an HF snapshot dir)", path=str(path)
    )


def _magic(path: Path) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(8)
    except OSError:
        return b""


def load(
    path_or_model_id: str | os.PathLike, *, tp: Any = None, lockstep: bool = False, **kw: Any
) -> Any:
    """Load any supported checkpoint as a ``poly.Transformer``.

    Accepts an HF snapshot dir, a ``.gguf`` or ``.entity`` file (by content), or an HF model id
    found in the local cache (``revision=`` picks a snapshot, default ``refs/main``). Other
    keyword arguments (``max_seq_len``, ``dtype`` ...) go to the format's loader;
    ``max_resident_experts=N`` (a `.entity` MoE model) keeps at most N experts resident.
    ``tp``: a ``poly.runtime.comm`` communicator; the model comes back as this rank's tensor
    parallel shard (``poly.runtime.tp.shard``; memory-mapped sources are read for it only).
    ``lockstep=True`` (the model will be driven from rank 0, `poly.runtime.lockstep`): the other
    ranks never tokenize, so they skip a `.entity`'s tokenizer and chat template (~30 MB of each
    follower's peak RSS for SmolLM2's vocabulary).
    """
    if tp is not None and lockstep and tp.rank != 0:
        kw["entity_text"] = False
    from poly.runtime.fused import prepare

    model = _load(path_or_model_id, **kw)
    if tp is not None:
        from poly.runtime.tp import shard

        model = shard(model, tp)
    prepare(model)  # the one-time repacking now, not in the first turn (issue 55)
    return model


def _load(path_or_model_id: str | os.PathLike, **kw: Any) -> Any:
    target = Path(os.fspath(path_or_model_id)).expanduser()
    if not (target.is_file() and _magic(target) == b"ENTITY\x00\x00"):
        kw.pop("entity_text", None)  # other formats load their tokenizer everywhere
    if kw.get("max_resident_experts") is None:
        kw.pop("max_resident_experts", None)
    elif not (target.is_file() and _magic(target) == b"ENTITY\x00\x00"):
        raise UsageError(
            "an expert budget (--max-experts, max_resident_experts) needs a .entity file "
            "(experts are paged from its mapping; convert first)"
        )
    if target.exists():
        if target.is_dir():
            if not (target / "config.json").is_file():
                raise ModelNotFoundError(
                    f"{target} is a directory without config.json (not an HF snapshot)",
                    path=str(target),
                )
            kw.pop("revision", None)
            return _call("entity.hf.loader", "load_hf", target, **kw)
        if not stat.S_ISREG(target.stat().st_mode):
            raise CheckpointError(f"{target} is not a regular file", path=str(target))
        kw.pop("revision", None)
        return _load_file(target, **kw)
    from entity.hf.cache import resolve_cached

    snapshot = resolve_cached(str(path_or_model_id), revision=kw.pop("revision", None))
    return _call("entity.hf.loader", "load_hf", snapshot, **kw)

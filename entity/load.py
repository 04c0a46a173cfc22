"""``entity.load``: one entry point for every checkpoint format, identified by content.

A directory with config.json is an HF snapshot; a file is recognised by its first bytes
(``GGUF``, ``ENTITY\\0\\0``), never by its extension; anything else that does not exist on
disk is looked up as a model id in the local HF cache. Sibling loaders are imported lazily
so that one missing or broken module does not break the others.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import importlib
import os
import stat
from pathlib import Path
from typing import Any

from poly import timing
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
    ``max_resident_experts=N`` (an MoE model: `.entity`, GGUF or HF) keeps at most N experts
    resident, paged from the file.
    ``tp``: a ``poly.runtime.comm`` communicator; the model comes back as this rank's tensor
    parallel shard (``poly.runtime.tp.shard``; memory-mapped sources are read for it only).
    ``lockstep=True`` (the model will be driven from rank 0, `poly.runtime.lockstep`): the other
    ranks never tokenize, so they skip a `.entity`'s tokenizer and chat template (~30 MB of each
    follower's peak RSS for SmolLM2's vocabulary).
    """
    if tp is not None and lockstep and tp.rank != 0:
        kw["entity_text"] = False
    paused = gc.isenabled()
    gc.disable()  # an open makes a vocabulary of long-lived objects: collecting them is waste
    try:
        return _open(path_or_model_id, tp, kw)
    finally:
        if paused:
            gc.enable()


def _open(path_or_model_id: str | os.PathLike, tp: Any, kw: dict) -> Any:
    from poly.filesnapshot import deferred_reads
    from poly.runtime.cache_files import holding
    from poly.runtime.fused import prepare
    from poly.runtime.heap import trim_heap
    from poly.runtime.kept_pages import KEPT
    from poly.runtime.layout_cache import packing

    # the file mapped; read in at the end (or mapped from the layout cache's copy of those
    # pages) but for what copies replace; the layouts made written as one pack at the end
    with holding(), deferred_reads(KEPT), packing():  # cache files written after the open
        model = _load(path_or_model_id, **kw)
        if tp is not None:
            from poly.runtime.tp import shard
            from poly.text.gendefaults import defaults_of

            found = defaults_of(model)  # known by the whole config: a shard's heads are cut
            model = shard(model, tp)
            model.generation_defaults = found
        with timing.phase("repack"):
            prepare(model)  # the one-time repacking now, not in the first turn (issue 55)
    trim_heap()  # the open's temporaries (vocabulary lists, header records) leave the RSS
    return model


def _load(path_or_model_id: str | os.PathLike, **kw: Any) -> Any:
    target = Path(os.fspath(path_or_model_id)).expanduser()
    if not (target.is_file() and _magic(target) == b"ENTITY\x00\x00"):
        kw.pop("entity_text", None)  # other formats load their tokenizer everywhere
    if kw.get("max_resident_experts") is None:
        kw.pop("max_resident_experts", None)
    elif target.is_file() and _magic(target)[:4] not in (b"ENTI", b"GGUF"):
        raise UsageError(
            "an expert budget (--max-experts, max_resident_experts) needs a .entity or GGUF "
            "file or an HF snapshot (experts are paged from their mapping)"
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


# --- describe: what a checkpoint is, from its headers only --------------------------------------

_FLOAT_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor as the file holds it: ``stored`` is its encoding (gguf_q4_1, float32 ...)."""

    name: str
    stored: str
    shape: tuple[int, ...]
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Description:
    """A checkpoint read without its tensor data: ``model`` is the `poly.Transformer` `load`
    would build, with its config, tokenizer, template and settings but unallocated layer
    weights; ``tensors`` is the file's tensor table."""

    format: str  # "gguf" | "entity" | "hf"
    path: str
    model: Any
    tensors: tuple[StoredTensor, ...]


def describe(path_or_model_id: str | os.PathLike) -> Description | None:
    """`load`'s rules for finding and recognising a checkpoint, but only its headers are read
    (`lucy inspect`: a 540 MB float32 snapshot costs no more memory than a tiny one), and the
    checks `load` makes on them (tokenizer, template, settings, checksums) give its typed
    errors. None for a Loom v1 `.entity`, which only its full reader parses."""
    target = Path(os.fspath(path_or_model_id)).expanduser()
    if not target.exists():
        from entity.hf.cache import resolve_cached

        return _describe_hf(resolve_cached(str(path_or_model_id)))
    if target.is_dir():
        if not (target / "config.json").is_file():
            raise ModelNotFoundError(
                f"{target} is a directory without config.json (not an HF snapshot)",
                path=str(target),
            )
        return _describe_hf(target)
    if not stat.S_ISREG(target.stat().st_mode):
        raise CheckpointError(f"{target} is not a regular file", path=str(target))
    magic = _magic(target)
    if magic.startswith(b"GGUF"):
        return _describe_gguf(target)
    if magic == b"ENTITY\x00\x00":
        return _describe_entity(target)
    return _load_file(target)  # no loader matches: raises the typed error `load` would


def _describe_gguf(path: Path) -> Description:
    from entity.gguf.config import gguf_config
    from entity.gguf.loader import check_tensors
    from entity.gguf.reader import open_gguf
    from entity.gguf.tokenizer import VOCABULARY_KEYS, load_gguf_tokenizer
    from poly.errors import WeightMappingError

    gg = open_gguf(path, weights=False, later=VOCABULARY_KEYS)
    cfg = gguf_config(gg)
    check_tensors(gg, cfg)
    tf = _skeleton(cfg)
    tf.tokenizer, tf.chat_template, _ = load_gguf_tokenizer(gg)
    if tf.tokenizer.vocab_size != cfg.vocab_size:  # as load_gguf checks
        raise WeightMappingError(
            f"tokenizer has {tf.tokenizer.vocab_size} tokens but token_embd has "
            f"{cfg.vocab_size} rows",
            path=gg.path,
        )
    tf.source = {"format": "gguf", "path": str(path), "name": gg.metadata.get("general.name"),
                 "file_type": gg.metadata.get("general.file_type")}  # fmt: skip
    tensors = tuple(
        StoredTensor(
            t.name,
            _FLOAT_NAMES.get(t.type_name) or f"gguf_{t.type_name.lower()}",
            tuple(t.shape),
            int(t.nbytes),
        )
        for t in gg.tensors.values()
    )
    return Description("gguf", str(path), tf, tensors)


def _describe_entity(path: Path) -> Description | None:
    from entity.dotentity.container import EntityVersionError, read_raw_header
    from entity.dotentity.header import PREFIX, decode_header

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw, _, hlen = read_raw_header(f, size, str(path))
            header = decode_header(raw[PREFIX.size :], str(path))
            _check_blobs(f, header.blobs, PREFIX.size + hlen, size, str(path))
    except EntityVersionError:
        return None
    from types import SimpleNamespace

    from entity.dotentity.read import attach_meta

    tf = _skeleton(_entity_config(header, path))
    meta = functools.partial(header.value, path=str(path))
    attach_meta(tf, SimpleNamespace(meta=meta, header=header, path=str(path)))
    return Description("entity", str(path), tf, _entity_tensors(header))


def _skeleton(cfg):
    from poly.model.transformer import Transformer

    return Transformer.from_config(cfg, allocate=False)  # no layer masters: nothing to fill


def _check_blobs(f, blobs, header_end: int, size: int, path: str) -> None:
    """The checks `load` makes before building anything: layout and every blob's checksum
    (streamed through a small buffer: the file is read, never held)."""
    from entity.dotentity.header import align, check_layout, crc_of_range
    from poly.errors import IntegrityError

    check_layout(blobs, align(header_end), size, path)
    for rec in blobs:
        if crc_of_range(f, rec.offset, rec.length) != rec.checksum:
            raise IntegrityError(f"checksum mismatch in blob {rec.path!r}", path=path)


def _entity_config(header, path: Path):
    from poly.config import TransformerConfig
    from poly.errors import EntityFormatError, PolyError

    spec = {k: v for k, v in header.transformer.items() if k != "tied"}
    try:
        return TransformerConfig.from_dict(spec)
    except (PolyError, TypeError, ValueError) as exc:
        raise EntityFormatError(f"bad transformer spec: {exc}", path=str(path)) from exc


def _entity_tensors(header) -> tuple[StoredTensor, ...]:
    from gguf.constants import GGMLQuantizationType

    matrix = str(header.quant.get("matrix"))

    def stored(rec) -> str:
        if rec.ggml_type is not None:
            return "gguf_" + GGMLQuantizationType(rec.ggml_type).name.lower()
        return matrix if rec.dtype == "uint8" else rec.dtype  # packed 4-bit rows

    return tuple(
        StoredTensor(b.path, stored(b), tuple(b.shape), int(b.length)) for b in header.blobs
    )


def _describe_hf(snapshot: Path) -> Description:
    from entity.hf.loader import attach_hf_metadata, open_hf

    src = open_hf(snapshot)
    tf = _skeleton(src.config.to_transformer_config())
    attach_hf_metadata(tf, src)
    tensors = []
    for name in src.checkpoint.names():
        info = src.checkpoint.info(name)
        kind = _FLOAT_NAMES.get(info.dtype, info.dtype.lower())
        tensors.append(StoredTensor(name, kind, tuple(info.shape), int(info.end - info.begin)))
    return Description("hf", str(snapshot), tf, tuple(tensors))

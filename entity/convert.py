"""Convert any loadable checkpoint (HF dir, GGUF, .entity) into a `.entity` v2 file.

HF snapshots are streamed block by block (peak memory ~ one block + the memory-mapped globals);
other sources are loaded with `entity.load` first. Output goes through `atomic_output`, so an
interrupted conversion leaves nothing at the destination. ``verify=True`` re-opens the result and
compares every tensor with the source: exact for f32, bitwise for GGUF blocks kept native
(`entity.dotentity.native_blocks`), error statistics for lossy schemes.
"""

from __future__ import annotations

import os
import time
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from entity.arch import role_shapes, roles
from entity.atomic import check_output
from entity.convert_report import ROW_CHUNK, ConvertReport, TensorStat, error_stat, float_rows
from entity.dotentity.blobs import SCHEMES, check_quant, embed_keep_as
from entity.dotentity.moe import moe_components
from entity.dotentity.native_blocks import (
    below_target,
    check_same_blocks,
    keeps_native,
    native_kind,
)
from entity.dotentity.read import load_entity
from entity.dotentity.write import (
    final_norm_master,
    model_blocks,
    model_meta,
    save_entity,
    source_components,
    write_entity,
)
from entity.quantize import apply_recipe
from poly.errors import ConversionError, IntegrityError, UsageError
from poly.layer import LayerType
from poly.text.gendefaults import GenerationDefaults

__all__ = ["convert", "ConvertReport", "TensorStat", "default_output"]

DELAY_ENV = "POLY_CONVERT_BLOCK_DELAY"  # test hook: seconds to sleep after each block
Progress = Callable[[int, int, str], None]
Blocks = Iterable[tuple[int, dict[str, dict[str, np.ndarray]]]]


# --- sources ------------------------------------------------------------------------------------


@dataclass
class _Source:
    kind: str
    cfg: Any
    meta: dict
    blocks: Callable[[], Blocks]  # a fresh pass over the blocks (float32 components)
    globals_: Callable[[], tuple[Any, Any, np.ndarray]]
    inputs: list
    model: Any = None


def _f32(block: dict[str, dict[str, np.ndarray]]) -> dict[str, dict[str, np.ndarray]]:
    return {
        part: {k: np.asarray(v, np.float32) for k, v in comps.items()}
        for part, comps in block.items()
    }


def _hf_source(path: Path) -> _Source:
    from entity.hf.loader import attach_hf_metadata, iter_hf_blocks, open_hf
    from poly.model.block import build_block
    from poly.network import VolumetricNetwork

    src = open_hf(path)
    cfg = src.config.to_transformer_config(None)
    net = VolumetricNetwork(1, 1, 1, cfg.num_layers)
    for i in range(cfg.num_layers):
        net.set_layer(0, 0, 0, i, build_block(cfg, allocate=False, index=i))
    shell = types.SimpleNamespace(network=net, tokenizer=None, chat_template=None, eos_token_ids=(),
                                  generation_defaults=None, source={"format": "hf", "path": str(path)})  # fmt: skip
    attach_hf_metadata(shell, src)
    meta = model_meta(shell, cfg)
    head = next(iter_hf_blocks(src))[1]

    def blocks() -> Blocks:
        it = iter_hf_blocks(src)
        next(it)  # globals first in HF order; .entity writes them last
        return ((i, _f32(b)) for i, b in it)

    def globals_():
        g = {k: v["value"] for k, v in head.items()}
        final = [g[k] for k in ("final_norm", "final_norm_bias", "lm_head_bias") if k in g]
        return g["embeddings"], g.get("lm_head"), np.concatenate(final).astype(np.float32)

    return _Source("hf", cfg, meta, blocks, globals_, [p for p in _files(path)])


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]


def _model_source(path: Path) -> _Source:
    from entity.load import load

    tf = load(path)
    cfg = tf.config
    final = final_norm_master(tf)
    kind = "entity" if hasattr(tf, "entity_file") else str(tf.source.get("format", "model"))
    return _Source(
        kind, cfg, model_meta(tf), lambda: model_blocks(tf),
        lambda: (tf.embeddings, None if tf.tied else tf.lm_head, final), [path], tf,
    )  # fmt: skip


def _open_source(src: str | os.PathLike) -> _Source:
    path = Path(os.fspath(src)).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return _hf_source(path)
    if not path.exists():
        from entity.hf.cache import resolve_cached

        return _hf_source(Path(resolve_cached(str(src))))
    return _model_source(path)


def default_output(src: str | os.PathLike, quant: str) -> Path:
    """``entities_dir() / entity_filename(src, quant)``: the one `.entity` naming rule."""
    from entity.paths import entities_dir, entity_filename

    return entities_dir() / entity_filename(src, quant)


# --- lossy targets: refuse values they would hide or create (B7-98, llama.cpp#18145) --------------

_FINITE_MAX = {"float16": float(np.finfo(np.float16).max)}  # others: the float32 range


def _check_lossy(name: str, w: Any, enc: str, keep_as: str | None = None) -> None:
    if enc == "float32" or w is None or len(np.shape(w)) != 2:
        return
    if keeps_native(keep_as or enc, w):
        return  # stored bit for bit (entity.dotentity.native_blocks): nothing hidden, nothing created
    limit = _FINITE_MAX.get(enc, float(np.finfo(np.float32).max))
    n, bad = np.shape(w)[0], 0
    for a in range(0, n, ROW_CHUNK):
        rows = np.asarray(float_rows(w, a, min(a + ROW_CHUNK, n)), np.float32)
        bad += rows.size - int(np.count_nonzero(np.abs(rows) <= limit))  # NaN compares False
    if bad:
        raise ConversionError(
            f"{name}: {bad} values are NaN/Inf or beyond the {enc} range; refusing to write them "
            "into a lossy format (overflow)"
        )


def _checked(blocks: Blocks, matrix_enc: str, lower: set[str]) -> Iterator:
    """Refuse values a lossy target would hide; collect into ``lower`` the GGUF kinds of source
    matrices less precise than the target (re-encoded: the file cannot be more precise)."""
    for i, comps in blocks:
        for role, parts in comps.items():
            for name, w in parts.items():
                _check_lossy(f"blocks.{i}.{role}.{name}", w, matrix_enc)
                lower.add(below_target(matrix_enc, w) or "")
        yield i, comps


def _checked_globals(globals_: Callable, embed_enc: str, keep_as: str, lower: set[str]) -> Callable:
    def wrapped():
        emb, head, final = globals_()
        for name, w in (("embeddings", emb), ("lm_head", head)):
            _check_lossy(name, w, embed_enc, keep_as)
            if not keeps_native(keep_as, w):
                lower.add(below_target(embed_enc, w) or "")
        return emb, head, final

    return wrapped


# --- convert ------------------------------------------------------------------------------------


def _delayed(blocks: Blocks) -> Iterator:
    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    for item in blocks:
        yield item
        if delay > 0:
            time.sleep(delay)


def _stat(name: str, ref: Any, got: Any, dst: Path) -> TensorStat:
    """Native GGUF blocks must be the source's bytes (IntegrityError); others: error stats."""
    if native_kind(ref) and native_kind(got):
        check_same_blocks(name, ref, got, str(dst))
        return TensorStat(name, tuple(ref.shape), 0.0, 0.0)
    return error_stat(name, ref, got)


def _verify(source: _Source, dst: Path, tick: Callable[[str], None]) -> list[TensorStat]:
    out = load_entity(dst, verify=True)
    stats: list[TensorStat] = []
    for i, comps in source.blocks():
        for role in roles(out.config):
            layer = out.role(i, role)
            if layer.type == LayerType.MOE:  # router, shared_gate, experts.<e>.<view>, ...
                got = moe_components(layer, source_components)
                names = list(got)
            else:
                got = source_components(layer)
                names = list(role_shapes(out.config, role))
            for name in names:
                ref = comps[role].get(name)
                ref = np.zeros(got[name].shape, np.float32) if ref is None else ref  # absent bias
                stats.append(_stat(f"blocks.{i}.{role}.{name}", ref, got[name], dst))
        tick(f"verified block {i + 1}/{out.config.num_layers}")
    emb, head, final = source.globals_()
    stats.append(_stat("embeddings", emb, out.embeddings, dst))
    if head is not None:
        stats.append(_stat("lm_head", head, out.lm_head, dst))
    stats.append(error_stat("final_norm", final, final_norm_master(out)))
    _check_meta(source.meta, out, dst)
    return stats


def _check_meta(meta: dict, out: Any, dst: Path) -> None:
    checks = {
        "tokenizer": None if out.tokenizer is None else out.tokenizer.to_str(),
        "chat_template": None if out.chat_template is None else out.chat_template.source,
        "eos_token_ids": list(out.eos_token_ids),
        "generation_config": dict(out.generation_defaults.settings),
    }
    for key, value in checks.items():
        if meta[key] != value:
            raise IntegrityError(f"{key} lost in conversion (roundtrip)", path=str(dst))


def _verify_into(report: ConvertReport, source: _Source, out: Path, tick: Callable) -> None:
    """Fill ``report.tensors``; a damaged result (IntegrityError, inexact f32) is removed."""
    try:
        report.tensors = _verify(source, out, tick)
    except IntegrityError:  # lost metadata or changed native blocks: no bad file left
        os.unlink(out)
        raise
    report.verified = True
    if report.quant == "f32" and not report.exact:
        worst = max(report.tensors, key=lambda t: t.max_abs)
        os.unlink(out)
        raise IntegrityError(
            f"f32 conversion is not exact: {worst.name} (roundtrip)", path=str(out)
        )


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike | None = None,
    *,
    quant: str = "q4",
    force: bool = False,
    verify: bool = False,
    progress: Progress | None = None,
    embed_quant: str | None = None,
    generation: Mapping[str, Any] | None = None,
    calibrate: bool | None = None,
    bpw: float | None = None,
    calibration: str | os.PathLike | None = None,
    planner: Any = None,
    to: str = "entity",
) -> ConvertReport:
    """Convert ``src`` (HF dir or cached id, .gguf, .entity) to a `.entity` at ``dst`` (``to=
    "gguf"``: a GGUF file llama.cpp loads, `entity.gguf.export`).

    ``generation``: settings the file carries over the source's own (`poly.text.gendefaults`).

    ``calibrate`` (or ``calibration``, a text file): the importance-weighted q4 recipe
    (`entity.quantize`), the default of q4 from an HF snapshot (``calibrate=False``: the plain
    `.entity` q4 encoding); ``bpw``: per-tensor types chosen under that whole-file budget;
    ``planner``: an `entity.quantize.Planner` of ``src`` already measured (several budgets).

    ``progress(done, total, detail)`` is called after every block. With ``verify`` the output is
    re-opened (checksums verified) and compared tensor by tensor with the source; a lossless (f32)
    conversion that does not match exactly raises `IntegrityError` and the output is removed.
    """
    out_path = _checked_output(src, dst, quant, to, verify, force)
    start = time.perf_counter()
    settings = dict(GenerationDefaults(dict(generation or {})).settings)  # SamplingParamsError
    source = _open_source(src)
    if settings:
        source.meta["generation_config"] = {**source.meta["generation_config"], **settings}
    n = source.cfg.num_layers
    total = n + 2 + (n + 1 if verify else 0)
    cb = progress or (lambda done, total, detail: None)
    lower: set[str] = set()
    write = _writer(source, out_path, to, quant, embed_quant, force, lower, cb, total)
    # the calibrated default applies to float checkpoints (a GGUF's blocks are kept as they are)
    calibrate = quant == "q4" if calibrate is None else calibrate
    calibrate = bool(planner) or (calibrate and source.kind == "hf")
    recipe = _calibrated(src, write, out_path, bpw, calibrate, calibration, cb, planner)
    report = _report(src, out_path, quant, source.kind, recipe, lower)
    if verify:
        step = iter(range(n + 3, total + 1))
        _verify_into(report, source, out_path, lambda d: cb(next(step, total), total, d))
        cb(total, total, "verified")
    report.bytes = out_path.stat().st_size
    report.seconds = time.perf_counter() - start
    return report


def _checked_output(src, dst, quant: str, to: str, verify: bool, force: bool) -> Path:
    """Refuse bad arguments and pick the output path, all before a big source is read."""
    if quant not in SCHEMES:
        raise UsageError(f"unknown quant {quant!r}; choose one of {sorted(SCHEMES)}")
    if to not in ("entity", "gguf"):
        raise UsageError(f"unknown output format {to!r}; choose entity or gguf")
    if to == "gguf" and verify:
        raise UsageError("--verify checks .entity files; load the GGUF to check it")
    out_path = Path(dst) if dst is not None else default_output(src, quant)
    if dst is None and to == "gguf":
        out_path = out_path.with_suffix(".gguf")
    if dst is None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
    check_output(out_path, force=force)  # fail fast, before reading a big source
    return out_path


def _writer(source: _Source, out_path: Path, to, quant, embed_quant, force, lower, cb, total):
    """``write(recipe=None)``: one pass of ``source`` into ``out_path``; ``lower``: `_checked`'s."""
    matrix_enc, embed_enc = check_quant(quant, embed_quant)
    keep_as = embed_keep_as(quant, embed_quant)

    def write(recipe=None) -> None:
        blocks, globals_ = _delayed(source.blocks()), source.globals_
        if recipe is not None:
            blocks, globals_ = apply_recipe(blocks, globals_, recipe)
        if to == "gguf":
            tick = lambda d, _t, x: cb(d, total, x)  # noqa: E731
            _write_gguf(out_path, source, (blocks, globals_), quant, force, tick)
            return
        write_entity(
            out_path, source.cfg, _checked(blocks, matrix_enc, lower),
            _checked_globals(globals_, embed_enc, keep_as, lower), source.meta, quant=quant,
            embed_quant=embed_quant, force=force or recipe is not None, inputs=source.inputs,
            progress=lambda done, _t, detail: cb(done, total, detail),
        )  # fmt: skip

    if to == "gguf":
        from entity.gguf.export import check_exportable

        check_exportable(source.cfg)  # before any calibration work
    return write


def _report(src, out_path: Path, quant: str, kind: str, recipe, lower: set[str]) -> ConvertReport:
    report = ConvertReport(str(src), str(out_path), quant, kind)
    report.recipe = recipe
    if lower - {""}:
        kinds = ", ".join(sorted(lower - {""}))
        report.notes.append(
            f"precision cannot exceed the source: the {quant} file holds the values of its "
            f"{kinds} blocks, re-encoded as {quant}"
        )
    return report


def _write_gguf(out_path: Path, source: _Source, model, quant: str, force: bool, tick) -> None:
    """The GGUF file, written to a temporary name and renamed over ``out_path`` when whole."""
    from entity.atomic import atomic_output
    from entity.gguf.export import write_gguf

    with atomic_output(out_path, force=force, inputs=source.inputs) as f:
        write_gguf(f, source.cfg, source.meta, *model, quant, tick)


def _calibrated(src, write, out_path: Path, bpw, calibrate, calibration, cb, planner=None):
    """Write the file (plain, or by the calibrated recipe); with ``bpw`` re-allocate once when
    the written file came out above its budget. Returns the recipe (None: plain)."""
    from entity.quantize import Planner, check_bpw

    if bpw is None and not calibrate and calibration is None:
        write()
        return None
    limit = None if bpw is None else check_bpw(bpw)
    planner = planner or Planner(src, calibration, lambda d, t, detail: cb(0, 0, detail))
    recipe = planner.default() if limit is None else planner.recipe(limit)
    write(recipe)
    if limit is not None:
        budget = int((limit + 0.05) * planner.params / 8)
        over = out_path.stat().st_size - budget
        if over > 0:  # header and padding above the estimate: take it from the matrices
            recipe = planner.recipe(limit, extra=over + 4096)
            write(recipe)
    return recipe


# Kept for callers that already hold a model: same file, no source re-read.
save = save_entity

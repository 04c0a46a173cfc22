"""The local HuggingFace cache, read offline through huggingface_hub.

``HF_HUB_CACHE`` (or ``HF_HOME``/hub) is read at call time, not at import time, so a caller
(or a test) can point elsewhere. ``refs/main`` decides which snapshot a model id means
(Loom took the first snapshot by name and ignored both the refs and the env vars).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from poly.errors import ModelNotFoundError, PolyError

DEFAULT_REVISION = "main"


def hub_cache_dir() -> Path:
    """The hub cache dir huggingface_hub would use for the current environment."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


@dataclass(frozen=True)
class CachedModel:
    """One model repo of the cache as ``lucy models`` lists it."""

    repo_id: str
    snapshot: Path
    revision: str  # commit hash of the chosen snapshot
    size_on_disk: int  # bytes of that snapshot's files (blobs shared between revisions count once per revision)
    architecture: str | None  # config.json model_type, when readable
    supported: bool
    reason: str  # "ok", or why it cannot be loaded


def resolve_cached(
    repo_id: str, *, revision: str | None = None, cache_dir: str | Path | None = None
) -> Path:
    """The snapshot dir of ``repo_id`` in the local cache (offline); ``ModelNotFoundError`` if absent."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = Path(cache_dir) if cache_dir is not None else hub_cache_dir()
    try:
        path = snapshot_download(
            repo_id,
            revision=revision or DEFAULT_REVISION,
            cache_dir=cache,
            local_files_only=True,
        )
    except (HFValidationError, LocalEntryNotFoundError, ValueError, OSError):
        raise ModelNotFoundError(
            f"{repo_id!r} is not a local path and not in the HF cache", path=str(cache)
        ) from None
    return Path(path)


def list_cached_models(cache_dir: str | Path | None = None) -> list[CachedModel]:
    """Every model repo in the cache, sorted by repo id, with its support status."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    cache = Path(cache_dir) if cache_dir is not None else hub_cache_dir()
    try:
        info = scan_cache_dir(cache)
    except (CacheNotFound, OSError, ValueError):
        return []
    out = []
    for repo in info.repos:
        if repo.repo_type != "model" or not repo.revisions:
            continue
        by_ref = [r for r in repo.revisions if DEFAULT_REVISION in r.refs]
        # No refs/main (e.g. only a pinned revision was fetched): take the newest snapshot.
        rev = by_ref[0] if by_ref else max(repo.revisions, key=lambda r: r.last_modified)
        arch, ok, reason = check_snapshot(Path(rev.snapshot_path))
        out.append(
            CachedModel(
                repo_id=repo.repo_id,
                snapshot=Path(rev.snapshot_path),
                revision=rev.commit_hash,
                size_on_disk=rev.size_on_disk,
                architecture=arch,
                supported=ok,
                reason=reason,
            )
        )
    return sorted(out, key=lambda m: m.repo_id)


def check_snapshot(snapshot: Path) -> tuple[str | None, bool, str]:
    """(model_type, supported, reason) without reading any weights."""
    from entity.hf.config import CONFIG_FILE, load_hf_config
    from entity.hf.safetensors_io import INDEX_FILE, PICKLE_FILES

    if not (snapshot / CONFIG_FILE).is_file():
        return None, False, "missing config.json"
    try:
        cfg = load_hf_config(snapshot)
    except PolyError as exc:
        return _model_type(snapshot), False, f"{exc.code}: {exc.message}"
    has_weights = (snapshot / INDEX_FILE).is_file() or any(snapshot.glob("*.safetensors"))
    if not has_weights:
        pickles = any((snapshot / name).exists() for name in PICKLE_FILES)
        return cfg.model_type, False, "pickle weights only" if pickles else "no .safetensors"
    if not (snapshot / "tokenizer.json").is_file():
        return cfg.model_type, False, "missing tokenizer.json"
    return cfg.model_type, True, "ok"


def _model_type(snapshot: Path) -> str | None:
    from entity.strict_json import read_json

    try:
        value = read_json(snapshot / "config.json").get("model_type")
    except PolyError:
        return None
    return value if isinstance(value, str) else None

"""Offline HF cache resolution and listing against a fabricated cache dir."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from entity.hf.cache import hub_cache_dir, list_cached_models, resolve_cached
from poly.errors import ModelNotFoundError
from tests.hf_fixtures import make_tiny_checkpoint

# Loom took the first snapshot by name; here that is OLD, while refs/main points to NEW.
OLD, NEW = "1" * 40, "f" * 40


def _add_snapshot(repo: Path, commit: str, files: dict[str, bytes]) -> None:
    """Lay files out like huggingface_hub: blobs by content hash, snapshot symlinks to them."""
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / name)


def _set_ref(repo: Path, commit: str) -> None:
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)


def _dir_files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf") / "hub"
    tiny = make_tiny_checkpoint(tmp_path_factory.mktemp("ck"), "llama", tied=True)
    files = _dir_files(tiny)
    repo = root / "models--org--tiny"
    # The old snapshot sorts first by name but holds a gemma config: refs/main must win.
    old_files = dict(files, **{"config.json": b'{"model_type": "gemma"}'})
    _add_snapshot(repo, OLD, old_files)
    _add_snapshot(repo, NEW, files)
    _set_ref(repo, NEW)
    gemma = root / "models--org--gemma-like"
    cfg = json.loads(files["config.json"])
    cfg.update(model_type="gemma", architectures=["GemmaForCausalLM"])
    _add_snapshot(gemma, OLD, dict(files, **{"config.json": json.dumps(cfg).encode()}))
    _set_ref(gemma, OLD)
    pickled = root / "models--org--pickled"
    _add_snapshot(
        pickled, OLD, {"config.json": files["config.json"], "pytorch_model.bin": b"\x80\x04."}
    )
    _set_ref(pickled, OLD)
    return root


def test_resolve_follows_refs_main(cache):
    assert sorted(p.name for p in (cache / "models--org--tiny" / "snapshots").iterdir())[0] == OLD
    snap = resolve_cached("org/tiny", cache_dir=cache)
    assert snap.name == NEW
    assert json.loads((snap / "config.json").read_text())["model_type"] == "llama"


def test_resolve_explicit_revision(cache):
    assert resolve_cached("org/tiny", revision=OLD, cache_dir=cache).name == OLD


def test_env_hf_hub_cache_and_hf_home(cache, monkeypatch):
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert hub_cache_dir() == cache
    assert resolve_cached("org/tiny").name == NEW
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    assert hub_cache_dir() == cache
    assert resolve_cached("org/tiny").name == NEW


@pytest.mark.parametrize("repo_id", ["org/absent", "not a valid/../id", "../../etc"])
def test_unknown_model_is_not_found(cache, repo_id):
    with pytest.raises(ModelNotFoundError):
        resolve_cached(repo_id, cache_dir=cache)


def test_missing_cache_dir(tmp_path):
    assert list_cached_models(tmp_path / "nope") == []
    with pytest.raises(ModelNotFoundError):
        resolve_cached("org/tiny", cache_dir=tmp_path / "nope")


def test_list_cached_models(cache):
    models = {m.repo_id: m for m in list_cached_models(cache)}
    assert sorted(models) == ["org/gemma-like", "org/pickled", "org/tiny"]
    tiny = models["org/tiny"]
    assert tiny.revision == NEW and tiny.snapshot.name == NEW
    assert tiny.architecture == "llama" and tiny.supported and tiny.reason == "ok"
    expected_size = sum(p.stat().st_size for p in tiny.snapshot.iterdir())  # follows symlinks
    assert tiny.size_on_disk == expected_size
    gemma = models["org/gemma-like"]
    assert not gemma.supported and "gemma" in gemma.reason and gemma.architecture == "gemma"
    pickled = models["org/pickled"]
    assert not pickled.supported and "pickle" in pickled.reason


def test_load_model_id_from_cache(cache, monkeypatch):
    pytest.importorskip("poly.model.transformer")
    import entity

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    tf = entity.load("org/tiny")
    assert tf.source["format"] == "hf" and Path(tf.source["path"]).name == NEW


def test_cache_with_broken_snapshot_listing(cache, tmp_path):
    broken = tmp_path / "hub"
    shutil.copytree(cache, broken, symlinks=True)
    snap = broken / "models--org--tiny" / "snapshots" / NEW
    (snap / "config.json").unlink()
    models = {m.repo_id: m for m in list_cached_models(broken)}
    assert not models["org/tiny"].supported and models["org/tiny"].reason == "missing config.json"

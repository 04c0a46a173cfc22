"""Reliability round 2 (issue #18), the HF cache layout (item 8): one test (or more) per item, reproducing the
reported input. Memory bounds are the peak RSS of a child process (`tests.round2_support`),
generous for a loaded machine; no test asserts a tight wall-clock time.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fuzz.corpus import expect_error
from tests.hf_fixtures import make_tiny_checkpoint
from tests.round2_support import lucy

pytestmark = pytest.mark.timeout(300)


# --- item 8: a sharded model in the real HF cache layout loads -----------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache_from(src: Path, cache: Path, repo_id: str) -> Path:
    """Lay ``src`` out as huggingface_hub does: `blobs/<etag>` (sha256 for LFS files, the git
    blob sha1 otherwise), `snapshots/<commit>/<file>` relative symlinks made by the hub's own
    `_create_symlink`, and `refs/main`."""
    import hashlib
    import shutil

    from huggingface_hub import file_download

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / COMMIT
    for f in sorted(src.rglob("*")):
        if not f.is_file():
            continue
        data = f.read_bytes()
        if f.suffix == ".safetensors":
            etag = hashlib.sha256(data).hexdigest()
        else:
            etag = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        blob = repo / "blobs" / etag
        shutil.copyfile(f, blob)
        dst = snap / f.relative_to(src)
        dst.parent.mkdir(parents=True, exist_ok=True)
        file_download._create_symlink(str(blob), str(dst), new_blob=False)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


@pytest.fixture(scope="module")
def sharded_cache(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("r2hub")
    src = make_tiny_checkpoint(base / "src", "llama", shards=3)
    assert (src / "model.safetensors.index.json").exists()
    snap = _hub_cache_from(src, base / "hub", "org/name")
    assert all(p.is_symlink() for p in snap.iterdir())
    assert os.readlink(snap / "config.json").startswith("../../blobs/")
    return src, base / "hub"


def test_item8_sharded_model_in_hub_cache_loads_with_transformers_logits(
    sharded_cache, monkeypatch
):
    import numpy as np
    from huggingface_hub import scan_cache_dir

    import entity
    from tests.hf_fixtures import hf_logits

    src, cache = sharded_cache
    info = scan_cache_dir(cache)  # the hub library reads our layout as its own
    assert [r.repo_id for r in info.repos] == ["org/name"] and not info.warnings
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    tf = entity.load("org/name")
    prompt = [5, 17, 42, 99, 123, 7, 250, 3]
    np.testing.assert_allclose(tf.forward_all(prompt), hf_logits(src, prompt), atol=1e-4, rtol=0)


def test_item8_lucy_chat_with_a_cached_sharded_model(sharded_cache):
    _, cache = sharded_cache
    code, out, err, rss = lucy(
        "chat",
        "org/name",
        "--max-tokens",
        "3",
        stdin="hello\n/quit\n",
        env={"HF_HUB_CACHE": str(cache)},
    )
    assert code == 0, err
    assert "path_escape" not in out + err and "error" not in err


def test_item8_escapes_outside_the_cache_repo_stay_refused(sharded_cache, tmp_path):
    import shutil

    from poly.errors import CheckpointError

    _, cache = sharded_cache
    hub = tmp_path / "hub"
    shutil.copytree(cache, hub, symlinks=True)
    repo = hub / "models--org--name"
    snap = repo / "snapshots" / COMMIT
    shard = sorted(snap.glob("*.safetensors"))[0]
    # A blob of ANOTHER repo of the same cache, and a file outside the cache: both refused.
    other = hub / "models--evil--repo" / "blobs"
    other.mkdir(parents=True)
    for target in (other / "x", tmp_path / "outside.safetensors"):
        shutil.copyfile(shard.resolve(), target)
        shard.unlink()
        shard.symlink_to(os.path.relpath(target, snap))
        import entity

        exc = expect_error(lambda: entity.load(snap), CheckpointError)
        assert "resolves outside the model directory" in str(exc)

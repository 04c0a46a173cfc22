"""The on-disk layout cache stays under POLY_LAYOUT_CACHE_MAX: the directories written longest
ago go first, the one being written stays; a bad value is named by lucy's start-up check."""

from __future__ import annotations

import json
import os

from lucy.environment import problems
from poly.runtime import layout_cache


def _dir(root, name, nbytes, mtime):
    d = root / name
    d.mkdir(parents=True)
    (d / "source.json").write_text(json.dumps({"path": "/nonexistent"}))
    (d / "a.npy").write_bytes(b"\0" * nbytes)
    os.utime(d, (mtime, mtime))
    return d


def test_cap_removes_oldest_until_under(tmp_path, monkeypatch):
    monkeypatch.setenv("POLY_LAYOUT_CACHE_MAX", "2500")
    old = _dir(tmp_path, "old", 1000, 100)
    mid = _dir(tmp_path, "mid", 1000, 200)
    new = _dir(tmp_path, "new", 1000, 300)
    keep = _dir(tmp_path, "keep", 1000, 50)  # the one being written: never removed
    layout_cache._cap(keep)
    assert not old.exists() and not mid.exists()
    assert new.exists() and keep.exists()


def test_cap_counts_the_model_about_to_be_written(tmp_path, monkeypatch):
    # a new directory holds little when the cap is checked: its model's copies (about the
    # file's size) must fit beside the rest, or the cache ends a whole model past its cap
    monkeypatch.setenv("POLY_LAYOUT_CACHE_MAX", "2500")
    old = _dir(tmp_path, "old", 1000, 100)
    new = _dir(tmp_path, "new", 1000, 300)
    keep = _dir(tmp_path, "keep", 0, 50)
    layout_cache._cap(keep, 400)
    assert old.exists() and new.exists()  # 2000 + 400 coming fit
    layout_cache._cap(keep, 1000)
    assert not old.exists() and new.exists() and keep.exists()  # 2000 + 1000 do not


def test_prune_removes_a_killed_writers_temporary_files(tmp_path):
    other = _dir(tmp_path, "other", 10, 100)
    st = os.stat(__file__)  # a live source: the directory stays, its stale temp file goes
    src = {"path": __file__, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    (other / "source.json").write_text(json.dumps(src))
    stale, live = other / ".a.npy-x1.tmp", other / ".b.npy-x2.tmp"
    stale.write_bytes(b"0" * 10)
    live.write_bytes(b"0" * 10)
    os.utime(stale, (1000, 1000))  # untouched for decades: its writer is gone
    keep = _dir(tmp_path, "keep", 0, 50)
    layout_cache._prune(keep)
    assert not stale.exists() and live.exists()


def test_max_bytes_parses_suffixes(monkeypatch):
    for raw, want in (("4G", 4 << 30), ("500M", 500 << 20), ("12k", 12 << 10), ("77", 77)):
        monkeypatch.setenv("POLY_LAYOUT_CACHE_MAX", raw)
        assert layout_cache.max_bytes() == want
    monkeypatch.setenv("POLY_LAYOUT_CACHE_MAX", "lots")
    assert layout_cache.max_bytes() == layout_cache.DEFAULT_MAX_BYTES
    assert any("POLY_LAYOUT_CACHE_MAX" in p for p in problems({"POLY_LAYOUT_CACHE_MAX": "lots"}))
    assert not problems({"POLY_LAYOUT_CACHE_MAX": "4G", "POLY_LAYOUT_CACHE": "0"})

"""A model's layouts in one pack (poly.runtime.layout_pack, issue 62: open time): the open that
makes them writes one pack, later opens map it and repack nothing, with the same logits; a
corrupt pack (a bad index, an object dtype, cut short) is ignored, never unpickled, and written
again; layouts a pack lacks go to .npy files and are read from there."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.hf_fixtures import make_tiny_checkpoint
from tests.test_layout_cache import cached_layouts, home, logits_of, no_repacking  # noqa: F401


@pytest.fixture
def served(tmp_path):
    import entity
    from poly.runtime import ckernels

    if not (ckernels.AVAILABLE and ckernels.EXT.info().get("interleave16")):
        pytest.skip("this build reads the stored rows (no repacked layouts)")
    tiny = make_tiny_checkpoint(tmp_path / "ck", "llama", tied=True)
    path = tmp_path / "m.entity"
    entity.convert(str(tiny), str(path), quant="q8")
    return path


def _pack(root):
    from poly.runtime import layout_pack

    (path,) = root.rglob(layout_pack.NAME)
    return path


def test_an_open_writes_one_pack_and_the_next_maps_it(home, served, monkeypatch):  # noqa: F811
    first = logits_of(served)
    assert not list(home.rglob("*.npy")), "layouts written one file each"
    assert len(cached_layouts(home)) >= 3
    with monkeypatch.context() as m:
        no_repacking(m)
        assert np.array_equal(logits_of(served), first)


def _index(path) -> tuple[dict, int]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[8:16], "little")
    return json.loads(raw[16 : 16 + n]), n


def _rewrite_index(path, index: dict, n: int) -> None:
    """The index replaced in the room before the first layout (at a page boundary)."""
    text = json.dumps(index, separators=(",", ":")).encode()
    assert 16 + len(text) <= 4096
    raw = bytearray(path.read_bytes())
    raw[8:16] = len(text).to_bytes(8, "little")
    raw[16 : 16 + max(n, len(text))] = text.ljust(n)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["object dtype", "past the end", "cut short", "not json"])
def test_a_corrupt_pack_is_ignored_and_written_again(home, served, damage):  # noqa: F811
    first = logits_of(served)
    path = _pack(home)
    index, n = _index(path)
    key = next(iter(index["entries"]))
    if damage == "object dtype":  # np.load of such bytes would unpickle them
        index["entries"][key][1] = "|O"
        _rewrite_index(path, index, n)
    elif damage == "past the end":
        index["entries"][key][0] = path.stat().st_size // 4096 * 4096 + 4096
        _rewrite_index(path, index, n)
    elif damage == "cut short":
        path.write_bytes(path.read_bytes()[:-4096])
    else:
        raw = bytearray(path.read_bytes())
        raw[16:20] = b"\xff\xfe{["
        path.write_bytes(bytes(raw))
    assert np.array_equal(logits_of(served), first)
    from poly.runtime import layout_pack

    assert layout_pack.read(_pack(home)) is not None, "the corrupt pack was not written again"
    assert _index(_pack(home))[0]["entries"][key][1] != "|O"


def test_layouts_a_pack_lacks_go_to_npy_files(home, served, monkeypatch):  # noqa: F811
    from poly.runtime import layout_pack
    from poly.runtime.cache_files import write_renamed

    first = logits_of(served)
    path = _pack(home)
    pack = layout_pack.read(path)
    kept = dict(list(pack.entries.items())[: len(pack.entries) // 2])
    arrays = {k: pack.get(k, shape, np.dtype(d)).copy() for k, (_, d, shape) in kept.items()}
    del pack
    assert write_renamed(path, layout_pack.fill(arrays))
    assert np.array_equal(logits_of(served), first)
    assert len(list(home.rglob("*.npy"))) >= len(arrays) - 1
    assert sorted(layout_pack.read(path).entries) == sorted(arrays), "the pack was rewritten"
    with monkeypatch.context() as m:
        no_repacking(m)
        assert np.array_equal(logits_of(served), first)


def test_an_earlier_versions_npy_files_move_into_a_pack(home, served, monkeypatch):  # noqa: F811
    """A cache of .npy files (as poly wrote before packs) is read, then written as one pack and
    its files removed; the next open maps the pack and repacks nothing."""
    import contextlib

    from poly.runtime import layout_cache

    with monkeypatch.context() as m:
        m.setattr(layout_cache, "packing", contextlib.nullcontext)
        first = logits_of(served)
    names = cached_layouts(home)
    assert len(list(home.rglob("*.npy"))) == len(names) >= 3
    with monkeypatch.context() as m:
        no_repacking(m)
        assert np.array_equal(logits_of(served), first)
    assert not list(home.rglob("*.npy")) and cached_layouts(home) == names
    with monkeypatch.context() as m:
        no_repacking(m)
        assert np.array_equal(logits_of(served), first)

"""The repacked layouts kept on disk between processes (poly.runtime.layout_cache, issue 62): a
model opened again reads them instead of repacking, with the same logits to the bit (and
transformers' logits); a changed model file gets fresh layouts; a corrupt or pickle-bearing
cache file is ignored (never unpickled) and written again."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from tests.hf_fixtures import hf_logits, make_tiny_checkpoint

IDS = [1, 5, 9, 2, 7]


@pytest.fixture
def home(tmp_path, monkeypatch):
    from poly.runtime import ckernels, layout_cache

    if not ckernels.AVAILABLE:  # the layouts are the C kernels': a build without them has none
        pytest.skip("the C kernels are not built")
    monkeypatch.setenv("POLY_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("POLY_LAYOUT_CACHE", raising=False)
    monkeypatch.setattr(layout_cache, "MIN_BYTES", 0)  # the tiny model's matrices too
    monkeypatch.setattr(layout_cache, "FREE_SHARE", 0.0)  # a CI disk may be nearly full
    return tmp_path / "home" / "layouts"


def logits_of(path) -> np.ndarray:
    import entity

    model = entity.load(path)
    out = np.array(model.forward(IDS))
    model.reset()
    return out


def no_repacking(monkeypatch) -> None:
    """Repacking raises: a load that passes read every layout from the cache."""
    from poly.runtime import repack

    def refusing(fn):
        def refuse(*a, **k):
            out = fn(*a, **k)  # None: a shape or kind without a layout (nothing to cache)
            assert out is None, f"{fn.__name__} repacked although cached"
            return out

        return refuse

    for name in (
        "_float_kmajor16_make",
        "interleave16",
        "kquant_interleave8",
        "kquant_interleave8_q6",
    ):
        monkeypatch.setattr(repack, name, refusing(getattr(repack, name)))


def _files(root) -> list:
    return sorted(root.rglob("*.npy"))


def cached_layouts(root) -> list[str]:
    """The cached layouts' names: their .npy files' and their packs' entries."""
    from poly.runtime import layout_pack

    names = [p.stem for p in root.rglob("*.npy")]
    for path in root.rglob(layout_pack.NAME):
        pack = layout_pack.read(path)
        assert pack is not None, f"{path} is not a valid pack"
        names += list(pack.entries)
    return sorted(names)


@pytest.fixture
def npy_only(monkeypatch):
    """Opens write their layouts as .npy files, as layouts made outside an open are."""
    import contextlib

    from poly.runtime import layout_cache

    monkeypatch.setattr(layout_cache, "packing", contextlib.nullcontext)


@pytest.fixture
def tiny(tmp_path):
    return make_tiny_checkpoint(tmp_path / "ck", "llama", tied=True)


@pytest.mark.parametrize("quant", ["f16", "q8"])
def test_cached_entity_layouts_give_the_same_logits(home, tiny, tmp_path, monkeypatch, quant):
    """float16 rows laid out by 16 k-major (float_kmajor16), int8 rows by 16 (interleave16)."""
    import entity
    from poly.runtime import ckernels

    if not (
        ckernels.AVAILABLE
        and ckernels.EXT.info().get("float_kmajor16")
        and ckernels.EXT.info()["interleave16"]
    ):
        pytest.skip("this build reads the stored rows (no repacked layouts)")
    path = tmp_path / f"m-{quant}.entity"
    entity.convert(str(tiny), str(path), quant=quant)
    monkeypatch.setenv("POLY_LAYOUT_CACHE", "0")
    off = logits_of(path)
    assert not home.exists()
    monkeypatch.delenv("POLY_LAYOUT_CACHE")
    cold = logits_of(path)  # repacked, then written
    assert cached_layouts(home), "no layout written"
    with monkeypatch.context() as m:
        no_repacking(m)
        warm = logits_of(path)
    assert np.array_equal(off, cold) and np.array_equal(off, warm)
    ref = hf_logits(tiny, IDS)[-1]
    if quant == "f16":
        np.testing.assert_allclose(warm, ref, rtol=0.05, atol=0.05)
    else:  # int8 rows and codes of x: close, not equal
        assert np.corrcoef(warm, ref)[0, 1] > 0.99


def test_cached_q4_1_rows_give_the_same_logits(home, smollm2_gguf, monkeypatch):
    from poly.runtime import ckernels

    if not (ckernels.AVAILABLE and ckernels.EXT.info().get("interleave16")):
        pytest.skip("no repacked rows in this build")
    monkeypatch.setenv("POLY_LAYOUT_CACHE", "0")
    off = logits_of(smollm2_gguf)
    monkeypatch.delenv("POLY_LAYOUT_CACHE")
    cold = logits_of(smollm2_gguf)
    # a layout per block matrix; q and k (GGUF permutes their rows) their rows in order too
    assert len(cached_layouts(home)) >= 30 * 7
    assert len([f for f in cached_layouts(home) if "-rows-" in f]) == 30 * 2
    with monkeypatch.context() as m:
        no_repacking(m)
        m.setattr(np, "ascontiguousarray", _refuse_reordering(np.ascontiguousarray))
        warm = logits_of(smollm2_gguf)
    assert np.array_equal(off, cold) and np.array_equal(off, warm)


def _refuse_reordering(fn):
    """np.ascontiguousarray refusing row-reordered copies of 64 KB or more (the q/k rows
    of a permuting GGUF are mapped from the cache, not copied)."""

    def refuse(a, *args, **kw):
        assert not (isinstance(a, np.ndarray) and a.base is None and a.nbytes >= 64 << 10), (
            "a reordered copy was made although cached"
        )
        return fn(a, *args, **kw)

    return refuse


def _f16(ck, path):
    import entity

    entity.convert(str(ck), str(path), quant="f16")
    return path


def test_a_changed_file_gets_fresh_layouts(home, tiny, tmp_path):
    served = _f16(tiny, tmp_path / "m.entity")
    first = logits_of(served)
    dirs = sorted(p.name for p in home.iterdir())
    other = make_tiny_checkpoint(tmp_path / "other", "llama", tied=True, seed=3)
    shutil.copy(_f16(other, tmp_path / "o.entity"), served)  # same path, new bytes
    second = logits_of(served)
    assert not np.array_equal(first, second)
    np.testing.assert_allclose(second, hf_logits(other, IDS)[-1], rtol=0.05, atol=0.05)
    now = sorted(p.name for p in home.iterdir())
    assert now != dirs and len(now) == 1, "the stale directory is pruned"


def test_an_older_versions_layouts_are_pruned_another_builds_kept(home, tiny, tmp_path):
    """Layouts of an older VERSION for an unchanged file are never read again: the next fresh
    directory prunes them. Another build's (same VERSION) and a source.json from before the
    version field are kept."""
    import json

    from poly.runtime import layout_cache

    served = _f16(tiny, tmp_path / "m.entity")
    logits_of(served)
    (ours,) = home.iterdir()
    src = json.loads((ours / "source.json").read_text())
    assert src["version"] == layout_cache.VERSION
    kinds = {
        "older": dict(src, version=layout_cache.VERSION - 1),
        "other-build": src,
        "no-field": {k: v for k, v in src.items() if k != "version"},
    }
    for name, body in kinds.items():
        (home / name).mkdir()
        (home / name / "source.json").write_text(json.dumps(body))
        (home / name / "layouts.pack").write_bytes(b"x" * 100)
    shutil.rmtree(ours)
    logits_of(served)  # a fresh directory: the cache is pruned
    assert sorted(p.name for p in home.iterdir()) == sorted([ours.name, "no-field", "other-build"])


class _Boom:
    """Unpickling this writes a marker file: proof that a cache file was unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_corrupt_cache_file_is_ignored_never_unpickled(home, tiny, tmp_path, npy_only):
    served = _f16(tiny, tmp_path / "m.entity")
    good = logits_of(served)
    files = _files(home)
    assert len(files) >= 3
    marker = tmp_path / "unpickled"
    evil = np.empty(4, dtype=object)
    evil[:] = [_Boom(marker)] * 4
    with open(files[0], "wb") as f:  # an object array: np.load would unpickle it
        np.lib.format.write_array(f, evil, allow_pickle=True)
    files[1].write_bytes(files[1].read_bytes()[:-64])  # truncated
    raw = bytearray(files[2].read_bytes())
    raw[:6] = b"\x00" * 6  # not a .npy file
    files[2].write_bytes(bytes(raw))
    again = logits_of(served)
    assert not marker.exists()
    assert np.array_equal(good, again)
    for f in files[:3]:  # rewritten as valid layouts
        arr = np.load(f, allow_pickle=False)
        assert arr.dtype != object and arr.size > 0


def test_a_file_larger_than_the_cap_is_not_cached(home, tiny, tmp_path, monkeypatch):
    # its layouts would evict every other model's, then its own at the next open of another
    served = _f16(tiny, tmp_path / "m.entity")
    first = logits_of(served)
    assert cached_layouts(home)  # under the cap: cached
    shutil.rmtree(home)
    monkeypatch.setenv("POLY_LAYOUT_CACHE_MAX", str(os.path.getsize(served) - 1))
    np.testing.assert_array_equal(logits_of(served), first)
    assert not home.exists() or not cached_layouts(home)


def test_nothing_is_written_where_the_disk_would_be_left_short(home, tiny, tmp_path, monkeypatch):
    """A disk that would keep less than FREE_SHARE of itself free after the model's layouts gets
    none written (the model still opens, repacked in memory); with room they are written."""
    from poly.runtime import layout_cache

    monkeypatch.setattr(layout_cache, "FREE_SHARE", 0.05)
    served = _f16(tiny, tmp_path / "m.entity")
    real = os.statvfs(tmp_path)
    size = os.path.getsize(served)

    class Disk:  # a 1000-block disk whose free blocks hold the model plus 2% (or 10%) of it
        def __init__(self, share):
            self.f_frsize, self.f_blocks = real.f_frsize, 1000
            self.f_bavail = size // real.f_frsize + int(share * 1000) + 1

    monkeypatch.setattr(layout_cache.os, "statvfs", lambda _: Disk(0.02))
    first = logits_of(served)
    assert not home.exists() or not list(home.rglob("*.*"))
    monkeypatch.setattr(layout_cache.os, "statvfs", lambda _: Disk(0.10))
    np.testing.assert_array_equal(logits_of(served), first)
    assert cached_layouts(home) and list(home.rglob("kept-*.bin"))


def test_a_large_models_layouts_are_written_after_the_open(home, tiny, tmp_path, monkeypatch):
    """Past LATER_BYTES the layouts go to the cache writer's thread: written once it is flushed,
    then read by the next open (no repacking) with the same logits."""
    from poly.runtime import cache_files, layout_cache

    monkeypatch.setattr(layout_cache, "LATER_BYTES", 0)
    served = _f16(tiny, tmp_path / "m.entity")
    first = logits_of(served)
    cache_files.flush()
    assert cached_layouts(home)
    no_repacking(monkeypatch)
    np.testing.assert_array_equal(logits_of(served), first)


def test_the_exit_waits_for_the_layouts_being_written(home, tiny, tmp_path):
    """A one-shot process that opened a large model leaves its layouts written at exit."""
    import subprocess
    import sys

    served = _f16(tiny, tmp_path / "m.entity")
    code = (
        "import entity\nfrom poly.runtime import layout_cache\n"
        "layout_cache.MIN_BYTES = layout_cache.LATER_BYTES = 0\n"
        "layout_cache.FREE_SHARE = 0.0\n"  # as the `home` fixture: a CI disk may be nearly full
        "import time\nfrom poly.runtime import cache_files\nwrite = cache_files.write_renamed\n"
        "cache_files.write_renamed = lambda *a: (time.sleep(0.05), write(*a))[1]  # a slow disk\n"
        f"entity.load({str(served)!r})\n"
    )
    env = {**os.environ, "POLY_HOME": str(home.parent)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert cached_layouts(home) and not list(home.rglob("*.tmp"))


def _mapped_files() -> set[str]:
    """The files mapped into this process (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return {line.split()[-1] for line in f if line.count(" ") >= 5 and "/" in line}


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux /proc")
def test_kept_pages_and_layouts_are_mapped_from_the_cache(home, tiny, tmp_path):
    """A second open maps the pages no layout replaces from the cache's kept-*.bin copy and the
    layouts from their pack (nothing read into memory), with the same logits; a short copy is
    ignored and written again."""
    import entity
    from poly.runtime import layout_pack

    served = tmp_path / "m.entity"
    entity.convert(str(tiny), str(served), quant="q8")
    first = logits_of(served)
    kept = sorted(home.rglob("kept-*.bin"))
    assert len(kept) == 1 and kept[0].stat().st_size % os.sysconf("SC_PAGE_SIZE") == 0
    model = entity.load(served)
    maps = _mapped_files()  # while the model holds its mappings
    assert str(kept[0]) in maps
    assert any(f.endswith(layout_pack.NAME) for f in maps)
    assert np.array_equal(np.array(model.forward(IDS)), first)
    model.reset()
    del model
    kept[0].write_bytes(kept[0].read_bytes()[:-4096])  # a short copy: read the file, write anew
    assert np.array_equal(logits_of(served), first)
    assert kept[0].stat().st_size % os.sysconf("SC_PAGE_SIZE") == 0
    assert kept[0].stat().st_size > os.path.getsize(served) // 8


def test_blob_checksums_are_checked_once_per_unchanged_file(home, tiny, tmp_path, monkeypatch):
    """load_entity checks every blob's crc32 at a file's first open, records it in the layout
    cache, and skips them while the file is unchanged; a rewritten file (one byte of a blob) is
    checked again and refused; verify=True always checks."""
    import entity
    from entity.dotentity import container
    from entity.dotentity.read import load_entity
    from poly.errors import IntegrityError

    served = _f16(tiny, tmp_path / "m.entity")
    calls = []
    crc = container.crc32
    monkeypatch.setattr(container, "crc32", lambda *a: calls.append(1) or crc(*a))
    entity.load(served)
    first = len(calls)
    assert first > 5 and len(list(home.rglob("blobs-verified"))) == 1
    entity.load(served)
    assert len(calls) == first + 1, "an unchanged file's blobs were checked again"  # the header's
    load_entity(served, verify=True)
    assert len(calls) == 2 * first + 1
    data = bytearray(served.read_bytes())
    data[-1] ^= 1  # the last blob's last byte
    served.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="checksum"):
        entity.load(served)


def test_a_failed_write_leaves_no_temporary_file(tmp_path):
    """`write_renamed` (the layout and tokenizer caches' writer): a fill that fails (a full disk)
    returns False and leaves neither the file nor its temporary beside it."""
    from poly.runtime.cache_files import write_renamed

    def full(f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    assert write_renamed(tmp_path / "x.npy", full) is False
    assert list(tmp_path.iterdir()) == []
    assert write_renamed(tmp_path / "x.npy", lambda f: f.write(b"ok")) is True
    assert [p.name for p in tmp_path.iterdir()] == ["x.npy"]


def test_the_cache_is_named_by_the_build_not_the_thread_count_or_install_path(monkeypatch):
    """Another thread count, or the same build installed elsewhere (a second checkout, a
    reinstall), finds the layouts already made; a build of other sources does not."""
    from types import SimpleNamespace

    from poly.runtime import ckernels, kernels, layout_cache

    if not ckernels.AVAILABLE or not ckernels.EXT.info().get("build"):
        pytest.skip("no C kernels, or a build without setup.py's key")
    before = layout_cache._ext_identity()
    n = kernels.num_threads()
    try:
        kernels.set_num_threads(1 if n > 1 else 2)
        assert layout_cache._ext_identity() == before
    finally:
        kernels.set_num_threads(n)
    info = ckernels.EXT.info()
    for build, same in ((info["build"], True), ("0" * 16, False)):
        elsewhere = SimpleNamespace(
            __file__="/elsewhere/ckernels.so", info=lambda b=build: {**info, "build": b}
        )
        monkeypatch.setattr(ckernels, "EXT", elsewhere)
        assert (layout_cache._ext_identity() == before) is same

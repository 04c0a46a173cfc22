"""Peak memory of opening a model (issue 62, acceptance 2): an HF float32 snapshot costs no more
than its own bytes. Before, the file was read into memory of our own and then copied into the
float32 masters (and the huge pages of every matrix rounded up to 2 MB): ~2x the file at peak.

Measured in fresh child processes (ru_maxrss): the baseline child imports the same modules and
reads the same snapshot's headers, config and tokenizer (`entity.describe`), the other loads it
and computes logits. No absolute sizes: the model's bytes are the difference."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.hf_fixtures import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KB")

CHILD = r"""
import importlib, json, resource, sys
import entity
from poly.runtime import fused  # the load's own imports, in both children

if sys.argv[2] == "load":
    model = entity.load(sys.argv[1])
    top = int(model.forward(model.tokenizer.encode("hello world")).argmax())
else:
    importlib.import_module("entity.load").describe(sys.argv[1])
    top = None
print(json.dumps({"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "top": top}))
"""
# 3 blocks of hidden 768 / FFN 2048 and a tied 8192 x 768 table: ~100 MB of float32, far above
# what a run's other allocations move
SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=3,
             num_attention_heads=12, num_key_value_heads=4, vocab_size=8192)  # fmt: skip


def _peak(path, what: str, home=None) -> dict:
    env = {**os.environ, **({"POLY_HOME": str(home)} if home else {})}  # its layout cache
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), what], capture_output=True,
                         text=True, timeout=300, check=False, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    out = tmp_path_factory.mktemp("open-memory") / "m"
    return make_tiny_checkpoint(out, "llama", tied=True, config_overrides=SHAPE)


def test_hf_f32_snapshot_peak_rss_is_its_file_size(snapshot):
    snap = snapshot
    size = (snap / "model.safetensors").stat().st_size
    assert size > 90e6  # not trivial: 5 % of it is far above the noise of a run
    base = _peak(snap, "describe")["peak"]
    got = _peak(snap, "load")
    assert got["top"] is not None
    over = (got["peak"] - base) / size
    assert got["peak"] <= base + 1.05 * size, f"peak {over:.2f}x the file above the baseline"


@pytest.mark.slow
def test_f32_gguf_with_a_tied_table_peak_rss_is_its_file_size(snapshot, tmp_path, monkeypatch):
    """The tied table was held twice (its rows pinned for lookups, its LM-head copy by 16) and
    the whole file read in before the copies replaced it: 1.36x the file with the layouts
    cached. A first open (the layouts made and written) may hold a piece of rows twice."""
    from entity.convert import convert
    from poly.runtime import layout_cache

    gguf = tmp_path / "m.gguf"
    convert(snapshot, gguf, quant="f32", to="gguf")
    size = gguf.stat().st_size
    monkeypatch.setenv("POLY_HOME", str(tmp_path))  # the children's layout cache
    if not layout_cache.has_room(size):
        pytest.skip("a disk this full gets no layout cache (poly.runtime.layout_cache.has_room)")
    base = _peak(gguf, "describe", tmp_path)["peak"]
    first = _peak(gguf, "load", tmp_path)  # writes the layout cache under tmp_path
    again = _peak(gguf, "load", tmp_path)
    assert first["top"] == again["top"]
    assert again["peak"] <= base + 1.05 * size, f"{(again['peak'] - base) / size:.2f}x the file"
    assert first["peak"] <= base + 1.10 * size, f"{(first['peak'] - base) / size:.2f}x the file"


def test_a_tied_q8_0_tables_lookups_read_its_copy_by_16_exactly():
    """A tied Q8_0 table's rows are no longer kept for its lookups (30 MB of SmolLM2 Q8_0): they
    are put back together from the LM head's records by 16 and must decode as the stored rows."""
    import numpy as np

    from poly.quant.ggml import GGMLType
    from poly.quant.qtensor import GGUFMatrix
    from poly.runtime import ckernels, repack, tied

    m, k = 64, 256
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(m, k // 32, 34), dtype=np.uint8)
    blocks[..., :2] = np.frombuffer(rng.uniform(-1, 1, m * k // 32).astype(np.float16).tobytes(),
                                    np.uint8).reshape(m, k // 32, 2)  # fmt: skip
    table = GGUFMatrix(blocks.reshape(m, -1), GGMLType.Q8_0, (m, k))
    rp = repack.interleave16(ckernels.Q8_0, table.raw, m, k)
    if rp is None:
        pytest.skip("this build reads the stored rows")
    ids = np.array([0, 15, 16, 17, 63, 5, 5, 40])
    got = tied.q8_0_rows(rp, k)(ids)
    want = np.stack([table.dequantize(int(i), int(i) + 1)[0] for i in ids])
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_a_tied_int8_tables_lookups_read_its_copy_by_16_exactly():
    """The same for `.entity` q8 (int8 rows with a scale each: 28 MB of SmolLM2)."""
    import numpy as np

    from poly.quant.qtensor import CodedMatrix
    from poly.runtime import ckernels, repack, tied

    m, k = 64, 256
    table = CodedMatrix.encode(np.random.default_rng(1).standard_normal((m, k)), "int8")
    rp = repack.interleave16(ckernels.I8, table.encoded.codes, m, k)
    if rp is None:
        pytest.skip("this build reads the stored rows")
    ids = np.array([0, 15, 16, 17, 63, 5, 5, 40])
    got = tied.i8_rows(rp, table.encoded, k)(ids)
    want = np.stack([table.dequantize(int(i), int(i) + 1)[0] for i in ids])
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_an_open_loads_neither_pydantic_nor_openssl(snapshot, tmp_path):
    """pydantic's model classes and OpenSSL's libcrypto (hashlib) are megabytes of RSS and
    milliseconds of every open: an HF snapshot's config is checked by name tables
    (entity.strict_json) and the caches are named by BLAKE2b (poly.digest)."""
    child = (
        "import sys, entity\n"
        "m = entity.load(sys.argv[1])\n"
        "m.forward(m.tokenizer.encode('hello world'))\n"
        "print(sorted(k for k in ('pydantic', '_hashlib') if k in sys.modules))\n"
    )
    for _ in range(2):  # the second open reads the caches the first one wrote
        out = subprocess.run([sys.executable, "-c", child, str(snapshot)], capture_output=True,
                             text=True, timeout=300, check=False,
                             env={**os.environ, "POLY_HOME": str(tmp_path)})  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == "[]"

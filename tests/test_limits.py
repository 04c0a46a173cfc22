"""One bound table for every count a model file declares (issue 56 item 4, poly.config.LIMITS):
a `.entity` header or an HF config.json asking for 10^6 experts fails at once with a typed
LimitExceededError. Before, the header built 10^6 expert objects per layer for 61-82 s and died
in an untyped MemoryError; the config took 23 s and 3.1 GB before its error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from entity.convert import convert
from entity.dotentity.container import EntityFile, EntityWriter
from tests.hf_fixtures import make_tiny_checkpoint

HUGE = 10**6
FAST_S = 10  # before the limits: 23-82 s; 10 leaves room for a loaded machine
CHILD = r"""
import json, sys, time
import entity
from poly.errors import PolyError
t = time.monotonic()  # includes the lazy imports entity.load makes: the bound is loose
try:
    entity.load(sys.argv[1])
    out = "loaded"
except PolyError as exc:
    out = f"{type(exc).__name__}: {exc}"
peak = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print(json.dumps({"outcome": out, "seconds": time.monotonic() - t, "peak_mb": peak / 1024}))
"""


def _open_in_child(path) -> dict:
    res = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr[-600:]
    return json.loads(res.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe") / "q3", "qwen3_moe", seed=56)


def test_entity_header_with_a_million_experts_fails_fast(moe_dir, tmp_path):
    convert(moe_dir, tmp_path / "ok.entity", quant="f32")
    ef = EntityFile(tmp_path / "ok.entity")
    meta = {k: ef.meta(k) for k in ("network", "transformer", "quant", "tokenizer",
            "tokenizer_config", "chat_template", "generation_config", "eos_token_ids", "source")}  # fmt: skip
    meta["transformer"] = dict(
        meta["transformer"], moe=dict(meta["transformer"]["moe"], num_experts=HUGE)
    )
    with EntityWriter(tmp_path / "bomb.entity") as out:  # the same blobs, a header asking for 10^6
        for rec in ef.header.blobs:
            out.add(rec.path, ef.array(rec.path))
        out.finish(meta)
    got = _open_in_child(tmp_path / "bomb.entity")
    assert got["outcome"].startswith(
        "LimitExceededError: num_experts 1000000 exceeds the limit 512"
    )
    assert got["seconds"] < FAST_S and got["peak_mb"] < 400


def test_hf_config_with_a_million_experts_fails_fast(moe_dir, tmp_path):
    snap = tmp_path / "snap"
    snap.mkdir()
    for f in moe_dir.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((snap / "config.json").read_text())
    cfg["num_experts"] = cfg["num_local_experts"] = HUGE
    (snap / "config.json").write_text(json.dumps(cfg))
    got = _open_in_child(snap)
    assert got["outcome"].startswith(
        "LimitExceededError: num_experts: 1000000 exceeds the limit 512"
    )
    assert got["seconds"] < FAST_S and got["peak_mb"] < 400


@pytest.mark.parametrize("name", ["num_layers", "num_heads", "vocab_size", "hidden_size"])
def test_every_format_shares_the_table(name):
    from entity.gguf.config import MAX_LAYERS
    from entity.gguf.moe import MAX_EXPERTS
    from entity.hf.config import HF_KEYS
    from entity.hf.config import LIMITS as HF
    from poly.config import LIMITS, TransformerConfig
    from poly.errors import LimitExceededError

    assert MAX_LAYERS == LIMITS["num_layers"] and MAX_EXPERTS == LIMITS["num_experts"]
    assert all(HF[k] == LIMITS[n] for k, n in HF_KEYS.items())
    dims = dict(vocab_size=8, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2)
    with pytest.raises(LimitExceededError, match=name):
        TransformerConfig(**dict(dims, **{name: LIMITS[name] + 1}))

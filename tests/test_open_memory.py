"""Peak memory of opening a model (issue 62, acceptance 2): an HF float32 snapshot costs no more
than its own bytes. Before, the file was read into memory of our own and then copied into the
float32 masters (and the huge pages of every matrix rounded up to 2 MB): ~2x the file at peak.

Measured in fresh child processes (ru_maxrss): the baseline child imports the same modules and
reads the same snapshot's headers, config and tokenizer (`entity.describe`), the other loads it
and computes logits. No absolute sizes: the model's bytes are the difference."""

from __future__ import annotations

import json
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


def _peak(snapshot, what: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(snapshot), what], capture_output=True,
                         text=True, timeout=300, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_hf_f32_snapshot_peak_rss_is_its_file_size(tmp_path):
    snap = make_tiny_checkpoint(tmp_path / "m", "llama", tied=True, config_overrides=SHAPE)
    size = (snap / "model.safetensors").stat().st_size
    assert size > 90e6  # not trivial: 5 % of it is far above the noise of a run
    base = _peak(snap, "describe")["peak"]
    got = _peak(snap, "load")
    assert got["top"] is not None
    over = (got["peak"] - base) / size
    assert got["peak"] <= base + 1.05 * size, f"peak {over:.2f}x the file above the baseline"

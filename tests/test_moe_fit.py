"""`--memory SIZE` and `lucy inspect MODEL --fit SIZE --ctx N` (issue 60, `entity.fit`): the
arithmetic from the headers against the files as gguf-py and safetensors read them and against
the KV caches a loaded model allocates; a run under the chosen budget holds no more experts
than planned (the pager's own count of resident bytes); too small a budget is one line naming
the minimum."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import entity
from benchmarks.make_moe_gguf import make_moe_gguf
from entity.fit import RUNTIME_BYTES, footprint, parse_size, plan
from entity.load import describe
from poly.errors import UsageError
from poly.nn import mha
from tests.hf_fixtures import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Path:
    return make_moe_gguf(tmp_path_factory.mktemp("fit") / "m.gguf", experts=16, layers=3,
                         experts_type="Q4_K,Q6_K,Q8_0")  # fmt: skip


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fit_hf") / "q", "qwen3_moe", seed=9,
                                dtype="bfloat16")  # fmt: skip


def test_parse_size():
    assert parse_size("6G") == 6 << 30 and parse_size("512MiB") == 512 << 20
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("64k") == 64 << 10
    for bad in ("", "x", "0", "-1G", "6Q", "1e9"):
        with pytest.raises(UsageError, match="is not a size"):
            parse_size(bad)


def test_gguf_footprint_is_the_files_tensor_table(gguf):
    from gguf import GGUFReader

    tensors = GGUFReader(str(gguf)).tensors
    experts = [t for t in tensors if "_exps" in t.name]
    fp = footprint(describe(gguf))
    assert fp.experts == 3 * 16 and fp.top_k == 2 and fp.sparse_layers == 3
    assert fp.expert_stored == fp.expert_held == sum(int(t.n_bytes) for t in experts) // 48
    assert fp.dense == sum(int(t.n_bytes) for t in tensors if "_exps" not in t.name)


def test_hf_footprint_counts_float32_masters(snapshot):
    from safetensors import safe_open

    dense = expert = 0
    with safe_open(str(snapshot / "model.safetensors"), "np") as f:
        for name in f.keys():
            n = math.prod(f.get_slice(name).get_shape())
            if ".experts." in name:
                expert += 4 * n  # bf16 experts are read into float32 copies
            else:
                dense += 4 * n  # and the rest into float32 masters
    fp = footprint(describe(snapshot))
    assert fp.dense == dense and fp.experts * fp.expert_held == expert
    assert fp.expert_stored * 2 == fp.expert_held


@pytest.mark.parametrize("ctx", [64, 300])
def test_kv_bytes_are_the_caches_a_model_allocates(gguf, ctx):
    tf = entity.load(gguf, max_seq_len=ctx)
    tf.forward([5, 6, 7])
    got = sum(c.k.nbytes + c.v.nbytes for c in (mha.live_cache(tf.attn(i)) for i in range(3)))
    assert footprint(describe(gguf)).kv_bytes(ctx) == got


def test_a_run_under_the_plan_holds_what_it_planned(gguf):
    fp = footprint(describe(gguf))
    memory = RUNTIME_BYTES + fp.dense + fp.run_bytes(512) + 10 * fp.expert_held
    got, _ = plan(gguf, memory, 512)
    assert got.ctx == 512 and got.total <= memory
    assert got.max_resident == 10 - fp.transient  # the decode step's top_k per layer on top
    tf = entity.load(gguf, max_resident_experts=got.max_resident, max_seq_len=got.ctx)
    tf.generate(list(range(5, 69)), max_tokens=16, temperature=0.0)
    rep = tf.expert_pager.report()
    assert rep["misses"] > rep["max_resident"]  # the budget was used, and held
    assert rep["resident"] == got.max_resident and rep["resident_bytes"] <= got.experts_bytes
    assert got.read_per_token == fp.dense + 2 * 3 * fp.expert_stored


def test_plan_shrinks_the_default_context_or_refuses(gguf):
    fp = footprint(describe(gguf))
    base = RUNTIME_BYTES + fp.dense + 6 * fp.expert_held  # top_k 2 + the step's 2 x 3 layers...
    got, _ = plan(gguf, base + 8 * fp.expert_held + fp.run_bytes(1024))
    assert 256 <= got.ctx < 2048  # the loader's default context did not fit
    with pytest.raises(UsageError, match=r"the KV cache at 2048 tokens .*: at least"):
        plan(gguf, base + fp.run_bytes(1024), ctx=2048)  # an asked-for context is kept
    assert plan(gguf, 1 << 40)[0].max_resident is None  # everything fits: no budget


def _lucy(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), NO_COLOR="1", COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "lucy", *args], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip


def test_lucy_inspect_fit_and_memory(gguf):
    res = _lucy("inspect", str(gguf), "--fit", "96M", "--ctx", "1024", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)["fit"]
    want, fp = plan(gguf, 96 * MiB, 1024)
    assert data["ctx"] == 1024 and data["kv_bytes"] == want.kv_bytes == fp.kv_bytes(1024)
    assert data["max_resident"] == want.max_resident and data["dense"] == fp.dense
    text = _lucy("inspect", str(gguf), "--fit", "96M").stdout
    assert "weights resident" in text and "from the file" in text
    gen = _lucy("generate", str(gguf), "--prompt", "hello", "--max-tokens", "4", "--greedy",
                "--memory", "79M", "--json")  # fmt: skip
    assert gen.returncode == 0, gen.stderr
    assert json.loads(gen.stdout)["experts"]["max_resident"] == plan(gguf, 79 * MiB)[0].max_resident
    for args, message in ((("--memory", "76M"), "at least"), (("--memory", "6Q"), "not a size"),
                          (("--memory", "1G", "--max-experts", "4"), "not both")):  # fmt: skip
        bad = _lucy("generate", str(gguf), "--prompt", "x", *args)
        assert bad.returncode != 0 and bad.stderr.count("\n") == 1 and message in bad.stderr
    assert np.isfinite(want.total)

"""`--memory` / `lucy inspect --fit` against what a process really holds (issue 60, acceptance 3):
the plan's total within 10 % of the peak RSS (the kernel's VmHWM of a child process) of
SmolLM2-135M-Instruct as the Q4_1 GGUF, its HF snapshot (float32 masters) and a Loom Q4
.entity, each with its KV cache filled to the planned context, with float32 and q8_0 caches; and
a q8_0 KV cache planned at the bytes the loaded model's caches hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import entity
from entity.fit import plan
from poly.nn import mha
from tests.hf_fixtures import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20

# the child: load through `--memory`'s own path (lucy.actions.load_model), fill the planned
# context with one prompt (forward runs it in PREFILL_CHUNK chunks), one decode step, then its
# peak RSS (VmHWM: ru_maxrss keeps the high-water mark of the forked parent across the exec,
# 597 MiB of pytest here) and the plan
CHILD = """
import json, sys
from entity.fit import parse_size, plan
from lucy import actions
spec, memory, ctx, kv = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] or None
got, _ = plan(spec, parse_size(memory), ctx, kv)
model = actions.load_model(spec, kv_cache=kv, memory=memory, max_seq_len=ctx)
ids = [(7 * i) % 1000 + 20 for i in range(got.ctx - 1)]
model.forward(ids)
model.forward([5])
status = open("/proc/self/status").read().split("VmHWM:")[1]
peak = int(status.split()[0]) * 1024
print(json.dumps({"peak": peak, "total": got.total, "ctx": got.ctx}))
"""


def test_q8_0_kv_cache_is_planned_at_its_bytes(tmp_path):
    """A q8_0 cache is int8 codes plus a float16 scale per 32 values: 34/32 bytes a value; the
    plan counted 4 (float32), 3.8 times what the caches hold."""
    over = {"head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2}
    snap = make_tiny_checkpoint(tmp_path / "m", "llama", config_overrides=over)
    ctx = 96
    tf = entity.load(snap, max_seq_len=ctx)
    tf.kv_cache_dtype = "q8_0"
    tf.forward([5, 6, 7])
    caches = [mha.live_cache(tf.attn(i)) for i in range(tf.config.num_layers)]
    assert all(c.k.dtype == np.int8 for c in caches)
    held = sum(c.k.nbytes + c.v.nbytes + c.ks.nbytes + c.vs.nbytes for c in caches)
    got, fp = plan(snap, 1 << 34, ctx, "q8_0")
    assert got.kv_bytes == held == fp.kv_bytes(ctx, 34 / 32)


def _peak(spec: str, memory: str, ctx: int, kv: str | None, **env_extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), POLY_NUM_THREADS="1", OMP_NUM_THREADS="1")
    env.update(env_extra)
    # the dispatch as settled: a first prompt of a length class on a machine may probe both
    # paths on a few blocks (poly.runtime.crossover), once, holding ~20 MiB more for that
    # prompt; whether it ran (the load decides) moved this child's peak 219 -> 238 MiB
    env["POLY_TUNE"] = "0"
    # the on-disk layout cache off: whether an earlier process (a convert) left the repacked
    # copies there changed the peak by 60 MB (their file pages are mapped as well)
    env["POLY_LAYOUT_CACHE"] = "0"
    res = subprocess.run([sys.executable, "-c", CHILD, spec, memory, str(ctx), kv or ""],
                         capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def smol_files(smollm2_gguf, smollm2_hf_dir, tmp_path_factory) -> dict:
    """The GGUF, an HF snapshot and a Loom Q4 .entity of SmolLM2-135M-Instruct."""
    snap = smollm2_hf_dir
    dst = tmp_path_factory.mktemp("fit_rss") / "smollm2.q4.entity"
    entity.convert(smollm2_gguf, dst, quant="q4")
    return {"gguf": str(smollm2_gguf), "hf": str(snap), "entity": str(dst)}


@pytest.mark.slow
@pytest.mark.parametrize("kv", [None, "q8_0"])
@pytest.mark.parametrize("fmt", ["gguf", "hf", "entity"])
def test_memory_plan_within_10_percent_of_peak_rss(smol_files, fmt, kv):
    # the median of three children: a peak is one process's high-water mark
    runs = [_peak(smol_files[fmt], "4G", 1024, kv) for _ in range(3)]
    got = dict(runs[0], peak=sorted(r["peak"] for r in runs)[1])
    assert got["ctx"] == 1024
    err = got["total"] / got["peak"] - 1
    assert abs(err) <= 0.10, f"{fmt} kv={kv}: plan {got['total'] / MiB:.0f} MiB, peak RSS " \
                             f"{got['peak'] / MiB:.0f} MiB ({100 * err:+.1f} %)"  # fmt: skip


@pytest.mark.slow
def test_a_prefills_peak_rss_is_the_same_run_to_run(smol_files):
    """The fused step's scratch grows a few KiB a call (the scores follow the position); from
    the heap, a small object allocated above a freed block made the next call extend the heap:
    the same prompt peaked at 220-253 MiB by the hash seed and address layout (CI failed the
    plan's 10 % on a 253). Mapped and kept per thread (csrc/core/step_buffer.h), the peaks differ
    by less than one such block (3.7 MiB here); a fresh-clone CI's were 1.1 MiB apart."""
    peaks = [_peak(smol_files["gguf"], "4G", 1024, None, PYTHONHASHSEED=str(seed))["peak"]
             for seed in range(1, 7)]  # fmt: skip
    assert max(peaks) - min(peaks) <= 3 * MiB, [p / MiB for p in peaks]

"""MoE models in `.entity` v2 (#14): every expert its own blob(s), router float32 in every scheme,
f32 round trip exact, q8/q4/f16 close; bad MoE files are typed one-line errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import entity
from entity.convert import convert
from entity.dotentity.container import EntityFile, EntityWriter
from entity.dotentity.write import save_entity
from poly.errors import EntityFormatError
from tests.hf_fixtures import hf_greedy, make_tiny_checkpoint
from tests.test_moe_hf import PROMPT

N_NEW = 32


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_entity")
    return {
        "qwen2_moe": make_tiny_checkpoint(root / "q2", "qwen2_moe", seed=51),
        "qwen3_moe": make_tiny_checkpoint(root / "q3", "qwen3_moe", tied=True, seed=52),
    }


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_f32_round_trip_is_exact_and_experts_are_separate_blobs(ckpts, arch, tmp_path):
    tf = entity.load(ckpts[arch])
    ref = tf.forward_all(PROMPT)
    out = tmp_path / "m.entity"
    convert(ckpts[arch], out, quant="f32", verify=True)  # streamed straight from the HF files
    back = entity.load(out)
    assert np.array_equal(back.forward_all(PROMPT), ref)
    ef = EntityFile(out)
    moe = tf.config.moe
    for e in range(moe.num_experts):
        rec = ef.blobs[f"blocks.0.mlp.experts.{e}"]
        assert rec.shape == [
            3 * 64 * moe.expert_intermediate_size + 2 * moe.expert_intermediate_size + 64
        ]
    assert ef.blobs["blocks.0.mlp.router"].dtype == "float32"
    assert back.mlp(0).sequential_layers[0].weights.master.base is not None  # a view on the map


# (mean |error| / mean |logit|, share of positions with the same argmax); measured: q8 0.054 / 0.85,
# f16 0.0015 / 1.0, q4 0.42 / 0.45 (d = 64 with 0.2-scale random weights: routing flips amplify).
@pytest.mark.parametrize(
    "quant,rel,top1", [("q8", 0.1, 0.8), ("f16", 0.005, 1.0), ("q4", 0.6, 0.3)]
)
def test_quantized_experts_are_close(ckpts, quant, rel, top1, tmp_path):
    tf = entity.load(ckpts["qwen2_moe"])
    ref = tf.forward_all(PROMPT)
    out = save_entity(tf, tmp_path / f"m.{quant}.entity", quant=quant)
    ef = EntityFile(out)
    assert ef.blobs["blocks.0.mlp.router"].dtype == "float32"
    assert ef.blobs["blocks.0.mlp.shared_gate"].dtype == "float32"
    assert any(n.startswith("blocks.0.mlp.experts.5.w_down") for n in ef.blobs)
    back = entity.load(out)
    got = back.forward_all(PROMPT)
    assert np.abs(got - ref).mean() <= rel * np.abs(ref).mean()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= top1
    kind = {"q8": "int8", "f16": "float16", "q4": "loom_q4"}[quant]
    assert {e.weights.active for e in back.mlp(0).sequential_layers} == {kind}


@pytest.mark.parametrize("arch,tied", [("qwen3_moe", True), ("qwen2_moe", False)])
def test_q8_greedy_follows_transformers(arch, tied, tmp_path):
    # 0.15-scale weights (as the GGUF tests): with 0.2, per-row int8 rounding flips MoE routing
    # on a few steps (qwen3_moe: 30/32); measured here 32/32 for both.
    src = make_tiny_checkpoint(tmp_path / arch, arch, tied=tied, seed=52,
                               config_overrides={"initializer_range": 0.15})  # fmt: skip
    out = save_entity(entity.load(src), tmp_path / "m.q8.entity", quant="q8")
    want = hf_greedy(src, PROMPT, N_NEW)
    # teacher-forced along transformers' greedy path: top-1 per step (one flip must not cascade)
    logits = entity.load(out).forward_all(PROMPT + want[:-1])[len(PROMPT) - 1 :]
    assert int((logits.argmax(-1) == np.array(want)).sum()) >= 31


def _rewrite(src: Path, dst: Path, *, drop: str | None = None, reshape: str | None = None,
             dense_layers: list | None = None):  # fmt: skip
    """Copy a .entity blob by blob, dropping or truncating one blob or replacing the header's
    moe.dense_layers (a damaged MoE file)."""
    ef = EntityFile(src)
    header = ef.header
    with EntityWriter(dst) as out:
        for rec in header.blobs:
            if rec.path == drop:
                continue
            arr = np.array(ef.array(rec.path))
            if rec.path == reshape:
                arr = arr[:-1]
            out.add(rec.path, arr)
        meta = {k: header.value(k) for k in ("network", "transformer", "quant", "tokenizer",
                "tokenizer_config", "chat_template", "generation_config", "eos_token_ids", "source")}  # fmt: skip
        if dense_layers is not None:
            spec = dict(meta["transformer"])
            spec["moe"] = {**spec["moe"], "dense_layers": dense_layers}
            meta["transformer"] = spec
        out.finish(meta)
    return dst


@pytest.mark.parametrize(
    "change,match",
    [
        ({"drop": "blocks.1.mlp.experts.3"}, "experts.3' missing"),
        ({"reshape": "blocks.0.mlp.router"}, "router has shape"),
        # layers that do not exist were accepted and ignored
        ({"dense_layers": [99, -1]}, r"\[99, -1\] must be distinct layers in \[0, 2\)"),
        ({"dense_layers": [1, 1]}, r"dense_layers \[1, 1\] must be distinct"),
    ],  # fmt: skip
)
def test_damaged_moe_file_is_a_typed_error(ckpts, tmp_path, change, match):
    good = save_entity(entity.load(ckpts["qwen3_moe"]), tmp_path / "good.entity", quant="f32")
    bad = _rewrite(good, tmp_path / "bad.entity", **change)
    with pytest.raises(EntityFormatError, match=match):
        entity.load(bad)

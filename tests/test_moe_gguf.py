"""MoE GGUF files written by llama.cpp's own converter (#14): Mixtral (arch llama with experts),
Qwen2-MoE (shared expert) and Qwen3-MoE. F32 within 1e-4 of transformers with identical greedy
tokens; F16 within 1e-4 of transformers run on the same f16-rounded weights; Q8_0 top-1 equal on
>= 31 of 32 greedy steps. Bad MoE files are typed one-line errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import entity
from benchmarks import llama_convert
from poly.errors import GGUFFormatError, WeightMappingError
from tests.hf_fixtures import hf_greedy, hf_logits, make_tiny_checkpoint
from tests.test_moe_hf import PROMPT, greedy

# Tiny checkpoints llama.cpp can convert (it has no mlp_only_layers for qwen2moe). Weights at
# 0.15 scale: with the fixtures' 0.2, Q8_0 rounding flips MoE routing often enough that llama.cpp
# itself matches transformers' top-1 on only 26-31 of 32 steps (ours: 29-30).
_INIT = {"initializer_range": 0.15}
ARCHS = {
    "mixtral": dict(tied=False, config_overrides=_INIT),
    "qwen2_moe": dict(tied=False, config_overrides={**_INIT, "mlp_only_layers": []}),
    "qwen3_moe": dict(tied=True, config_overrides=_INIT),
}
N_NEW = 32


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = llama_convert.converter_dir()
    if root is None:
        pytest.skip("llama.cpp converter (llama-cpp-python sdist) not available")
    tmp = tmp_path_factory.mktemp("moe_gguf")
    out: dict[tuple[str, str], Path] = {}
    for i, (arch, kw) in enumerate(ARCHS.items()):
        src = make_tiny_checkpoint(tmp / arch, arch, seed=60 + i, **kw)
        out[(arch, "hf")] = src
        for kind in ("f32", "f16", "q8_0"):
            out[(arch, kind)] = llama_convert.convert(src, tmp / f"{arch}.{kind}.gguf", kind, root)
    return out


def _hf_logits_f16(model_dir: Path, ids: list[int]) -> np.ndarray:
    """transformers' logits with the weights the converter stores as F16 rounded to f16: every
    matrix except the routers (mlp.gate / shared_expert_gate), which it keeps F32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and not name.endswith(("gate.weight", "shared_expert_gate.weight")):
                p.copy_(p.half().float())
        return model(torch.tensor([ids]), use_cache=False).logits[0].numpy()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_f32_gguf_matches_transformers(files, arch):
    tf = entity.load(files[(arch, "f32")])
    assert tf.mlp(0).moe is not None
    np.testing.assert_allclose(tf.forward_all(PROMPT), hf_logits(files[(arch, "hf")], PROMPT),
                               atol=1e-4, rtol=0)  # fmt: skip
    want = hf_greedy(files[(arch, "hf")], PROMPT, N_NEW)
    assert greedy(tf, PROMPT, N_NEW, use_cache=True) == want
    assert greedy(tf, PROMPT, N_NEW, use_cache=False) == want


@pytest.mark.parametrize("arch", list(ARCHS))
def test_f16_gguf_matches_transformers_on_rounded_weights(files, arch):
    tf = entity.load(files[(arch, "f16")])
    ref = _hf_logits_f16(files[(arch, "hf")], PROMPT)
    np.testing.assert_allclose(tf.forward_all(PROMPT), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_q8_0_gguf_top1_along_the_greedy_path(files, arch):
    want = hf_greedy(files[(arch, "hf")], PROMPT, N_NEW)
    tf = entity.load(files[(arch, "q8_0")])
    logits = tf.forward_all(PROMPT + want[:-1])[len(PROMPT) - 1 :]  # teacher-forced
    assert int((logits.argmax(-1) == np.array(want)).sum()) >= 31


def rewrite_gguf(src: Path, dst: Path, *, meta: dict | None = None, rename: dict | None = None,
             reshape: str | None = None) -> Path:  # fmt: skip
    """Copy a GGUF with edited metadata / renamed tensors / one tensor truncated (gguf-py)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        value = (meta or {}).get(field.name, field.contents())
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        data = np.array(t.data)
        if t.name == reshape:
            data = data[:-1]
        writer.add_tensor((rename or {}).get(t.name, t.name), data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"meta": {"qwen3moe.expert_used_count": 9}}, GGUFFormatError, r"count 9 is outside"),
        # the message states the range, not "(top_k > E)", which a count of 0 is not
        ({"meta": {"qwen3moe.expert_used_count": 0}}, GGUFFormatError, r"\[1, expert_count 8\] \["),
        (
            {"rename": {"blk.1.ffn_up_exps.weight": "blk.1.ffn_up.8.weight"}},
            GGUFFormatError,
            "expert index 8 .* out of range",
        ),
        (
            {"reshape": "blk.0.ffn_gate_inp.weight"},
            WeightMappingError,
            "ffn_gate_inp.weight' has shape",
        ),
        (
            {"rename": {"blk.1.ffn_down_exps.weight": "blk.1.ffn_down.0.weight"}},
            WeightMappingError,
            "has shape",
        ),
    ],  # fmt: skip
)
def test_bad_moe_gguf_is_a_typed_error(files, tmp_path, change, error, match):
    bad = rewrite_gguf(files[("qwen3_moe", "f32")], tmp_path / "bad.gguf", **change)
    with pytest.raises(error, match=match):
        entity.load(bad)

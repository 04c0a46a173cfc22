"""Issue 58's MoE families (entity/families/olmoe.py, granitemoe.py, gpt_oss.py) against
transformers on tiny random checkpoints (tests/hf_fixtures.py): logits at every position within
1e-4, 32 greedy tokens identical with and without the KV cache, a prompt past 3x GPT-OSS's
sliding window; GPT-OSS's MXFP4 checkpoint form against transformers' own dequantization; the
same through `.entity` f32 (exact, and under an expert budget) and through GGUF files written by
llama.cpp's converter (f32 within 1e-4, Q8_0 greedy >= 31/32, MXFP4 experts; slow). Bad input is
a typed error naming the tensor; the fused C step takes these MoE options."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import entity
from entity.convert import convert
from poly.errors import ConfigError, WeightMappingError
from poly.layer import LayerType
from poly.runtime import fused_args, kernels
from tests.family_helpers import assert_load_error, assert_top1_along, greedy
from tests.hf_fixtures import hf_greedy, hf_logits, make_tiny_checkpoint

ARCHS = ("olmoe", "granitemoe", "gpt_oss")
PROMPT = [5, 17, 42, 99, 123, 7, 250, 3, 64, 128, 200, 11, 33, 77, 1, 180, 222, 9, 150, 299]
N_NEW = 32  # GPT-OSS's window is 6: the prompt alone is 3x past it


def mxfp4_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [E, out, in] -> GPT-OSS's (blocks [E, out, in/32, 16], scales [E, out, in/32]), by
    gguf-py's MXFP4 quantizer (values in ggml's order, repacked to the checkpoint's nibbles)."""
    from gguf.quants import MXFP4

    n, rows, cols = w.shape
    q = MXFP4.quantize_blocks(np.ascontiguousarray(w, np.float32).reshape(-1, 32))  # [nb, 17]
    codes = np.concatenate([q[:, 1:] & 15, q[:, 1:] >> 4], axis=1)  # [nb, 32] value order
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)  # low nibble = even
    scales = np.ascontiguousarray(q[:, 0]).reshape(n, rows, cols // 32)
    return packed.reshape(n, rows, cols // 32, 16), scales


def to_mxfp4(src: Path, dst: Path) -> Path:
    """A copy of a tiny GPT-OSS checkpoint with its experts stored as the released ones are."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name).transpose(0, 2, 1)  # x @ W [E, in, out] -> [E, out, in]
        tensors[name + "_blocks"], tensors[name + "_scales"] = mxfp4_quantize(w)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_families")
    out = {a: make_tiny_checkpoint(root / a, a, seed=60 + i) for i, a in enumerate(ARCHS)}
    out["gpt_oss_mxfp4"] = to_mxfp4(out["gpt_oss"], root / "gpt_oss_mxfp4")
    return out


@pytest.mark.parametrize("arch", [*ARCHS, "gpt_oss_mxfp4"])
def test_logits_and_greedy_match_transformers(ckpts, arch):
    tf = entity.load(ckpts[arch])
    assert {tf.mlp(i).type for i in range(tf.config.num_layers)} == {LayerType.MOE}
    np.testing.assert_allclose(
        tf.forward_all(PROMPT), hf_logits(ckpts[arch], PROMPT), atol=1e-4, rtol=0
    )
    want = hf_greedy(ckpts[arch], PROMPT, N_NEW, use_cache=True)
    assert greedy(tf, PROMPT, N_NEW, use_cache=True) == want
    assert greedy(tf, PROMPT, N_NEW, use_cache=False) == want


@pytest.mark.skipif(not kernels.HAVE_C, reason="needs the C extension")
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_step_takes_the_moe_options(ckpts, arch):
    """GPT-OSS's router bias, top-k softmax, expert biases and clamped SwiGLU, GraniteMoE's top-k
    softmax, OLMoE's unnormalised weights: the MoE record is the C step's (csrc/decode/moe.h)."""
    tf = entity.load(ckpts[arch])
    if arch == "gpt_oss":
        moe = tf.config.moe
        assert moe.extended and moe.gating == "softmax_topk" and moe.activation == "swiglu_oai"
    assert fused_args.moe_args(tf.mlp(0)) is not None


@pytest.mark.parametrize("arch", ARCHS)
def test_entity_f32_is_exact_and_experts_page(ckpts, arch, tmp_path):
    ref = entity.load(ckpts[arch]).forward_all(PROMPT)
    out = tmp_path / f"{arch}.entity"
    convert(ckpts[arch], out, quant="f32", verify=True)
    assert np.array_equal(entity.load(out).forward_all(PROMPT), ref)
    paged = entity.load(out, max_resident_experts=2)  # outputs never depend on the budget
    assert np.array_equal(paged.forward_all(PROMPT), ref)
    assert paged.expert_pager.report()["max_resident"] == 2


def _edit(src: Path, dst: Path, drop: str | None = None, shape: tuple | None = None,
          name: str | None = None) -> Path:  # fmt: skip
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    if drop:
        tensors.pop(drop)
    if shape:
        tensors[name] = np.zeros(shape, tensors[name].dtype)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    "arch,drop,name,shape,match",
    [
        (
            "gpt_oss",
            "model.layers.1.self_attn.sinks",
            None,
            None,
            "missing tensor 'model.layers.1.self_attn.sinks'",
        ),
        (
            "gpt_oss",
            None,
            "model.layers.0.mlp.experts.gate_up_proj",
            (4, 64, 64),
            "model.layers.0.mlp.experts.gate_up_proj' has shape",
        ),
        (
            "gpt_oss_mxfp4",
            None,
            "model.layers.0.mlp.experts.down_proj_scales",
            (4, 64, 3),
            "down_proj_scales' has shape",
        ),
        (
            "granitemoe",
            None,
            "model.layers.1.block_sparse_moe.input_linear.weight",
            (5, 32, 64),
            "input_linear.weight' has shape",
        ),
        (
            "olmoe",
            "model.layers.0.mlp.experts.3.up_proj.weight",
            None,
            None,
            "missing tensor 'model.layers.0.mlp.experts.3.up_proj.weight'",
        ),
    ],  # fmt: skip
)
def test_bad_tensors_are_typed_errors_naming_them(ckpts, tmp_path, arch, drop, name, shape, match):
    bad = _edit(ckpts[arch], tmp_path / "bad", drop, shape, name)
    assert_load_error(bad, WeightMappingError, match)


def test_mxfp4_config_on_another_family_is_refused(ckpts, tmp_path):
    bad = shutil.copytree(ckpts["olmoe"], tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="mxfp4 is not known for olmoe"):
        entity.load(bad)


# --- GGUF files from llama.cpp's own converter ---------------------------------------------------


def _gguf(src: Path, kind: str) -> Path:
    from benchmarks.llama_convert import convert as llama_convert
    from benchmarks.llama_convert import converter_dir

    root = converter_dir()
    if root is None:
        pytest.skip("llama.cpp's converter is not available")
    return llama_convert(src, src.parent / f"{src.name}.{kind}.gguf", kind, root)


@pytest.mark.slow
@pytest.mark.parametrize("arch", [*ARCHS, "gpt_oss_mxfp4"])
def test_gguf_f32_matches_transformers(ckpts, arch):
    path = _gguf(ckpts[arch], "f32")
    if arch == "gpt_oss_mxfp4":  # the converter repacks the checkpoint's MXFP4 experts
        from entity.gguf.reader import open_gguf

        assert open_gguf(path).tensors["blk.0.ffn_up_exps.weight"].ggml_type == 39
    tf = entity.load(path)
    np.testing.assert_allclose(
        tf.forward_all(PROMPT), hf_logits(ckpts[arch], PROMPT), atol=1e-4, rtol=0
    )
    want = hf_greedy(ckpts[arch], PROMPT, N_NEW, use_cache=True)
    assert greedy(tf, PROMPT, N_NEW, use_cache=True) == want
    if arch == "gpt_oss_mxfp4":  # GGUF MXFP4 experts -> .entity f32 (dequantized once)
        out = path.with_suffix(".entity")
        convert(path, out, quant="f32")
        got = entity.load(out).forward_all(PROMPT)
        np.testing.assert_allclose(got, hf_logits(ckpts[arch], PROMPT), atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_q8_0_greedy_follows_transformers(arch, tmp_path):
    # 0.15-scale weights, as tests/test_moe_gguf.py: with 0.2 (and granite's 3x embedding
    # multiplier) per-block int8 rounding flips a routing decision on a step or two
    src = make_tiny_checkpoint(tmp_path / arch, arch, seed=70,
                               config_overrides={"initializer_range": 0.15})  # fmt: skip
    want = hf_greedy(src, PROMPT, N_NEW)
    tf = entity.load(_gguf(src, "q8_0"))
    # teacher-forced along transformers' greedy path: top-1 per step (one flip must not cascade)
    assert_top1_along(tf, PROMPT, want)


def _gguf_without(src: Path, dst: Path, drop: str, truncate: str) -> tuple[Path, Path]:
    """Two damaged copies of a GGUF (gguf-py): one without tensor `drop`, one with `truncate`'s
    last row cut."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(src))
    outs = (dst.with_suffix(".drop.gguf"), dst.with_suffix(".cut.gguf"))
    for out in outs:
        writer = GGUFWriter(str(out), reader.fields["general.architecture"].contents())
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name == "general.architecture":
                continue
            sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
        for t in reader.tensors:
            if out == outs[0] and t.name == drop:
                continue
            data = np.array(t.data)
            writer.add_tensor(t.name, data[:-1] if out == outs[1] and t.name == truncate else data,
                              raw_dtype=t.tensor_type)  # fmt: skip
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return outs


@pytest.mark.slow
def test_damaged_gpt_oss_gguf_is_a_typed_error_naming_the_tensor(ckpts, tmp_path):
    from poly.errors import GGUFFormatError

    dropped, cut = _gguf_without(_gguf(ckpts["gpt_oss"], "f32"), tmp_path / "bad",
                                 "blk.1.attn_sinks.weight", "blk.0.ffn_gate_exps.bias")  # fmt: skip
    with pytest.raises((WeightMappingError, GGUFFormatError), match="blk.1.attn_sinks.weight"):
        entity.load(dropped)
    with pytest.raises((WeightMappingError, GGUFFormatError), match="blk.0.ffn_gate_exps.bias"):
        entity.load(cut)

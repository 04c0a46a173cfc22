"""`convert(..., to="gguf")` / `lucy convert --to gguf` (entity.gguf.export): the file loads in
llama.cpp (llama-cpp-python) unchanged, its logits there equal poly's on the same file, and
llama.cpp reads the tokenizer and chat template poly wrote."""

from __future__ import annotations

import numpy as np
import pytest

import entity
from tests.hf_fixtures import make_tiny_checkpoint

llama_cpp = pytest.importorskip("llama_cpp")

IDS = [5, 17, 42, 99, 3, 250, 7, 8, 120, 64, 33, 200]


def _tiny(tmp_path, arch="llama"):
    # hidden 256: rows long enough for the 256-element K kinds too
    return make_tiny_checkpoint(
        tmp_path / arch, arch, seed=7,
        config_overrides={"hidden_size": 256, "intermediate_size": 512, "head_dim": 64},
    )  # fmt: skip


def _llama_logits(path, ids) -> np.ndarray:
    # KV cache in float32 (llama.cpp's default f16 alone moves the logits ~2e-3)
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_batch=64, logits_all=True, verbose=False,
                          n_threads=2, type_k=0, type_v=0)  # fmt: skip
    try:
        llm.eval(list(ids))
        return np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float_export_runs_in_llama_cpp_with_polys_logits(tmp_path, arch):
    """f32: llama.cpp's logits on the exported file equal poly's on the same file and
    transformers' within 1e-4 of the largest logit (llama-arch q/k rows permuted as llama.cpp
    expects: the wrong order changes every logit by O(1))."""
    from tests.hf_fixtures import hf_logits

    src = _tiny(tmp_path, arch)
    dst = tmp_path / f"{arch}.gguf"
    entity.convert(src, dst, to="gguf", quant="f32")
    theirs = _llama_logits(dst, IDS)
    assert _rel(entity.load(dst).forward_all(IDS), theirs) < 1e-4
    assert _rel(hf_logits(src, IDS), theirs) < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_export_holds_the_recipes_blocks(tmp_path, arch):
    """The q4 default (Q4_0 / Q4_1 / Q8_0) and a --bpw mix (K kinds too): every matrix in the file,
    dequantized by gguf-py (llama.cpp's reference decoders) and put back in HF row order,
    equals the same recipe's `.entity` as poly loads it; llama.cpp runs the file and its logits
    follow poly's (their gap is llama.cpp's int8 activation rounding: on this random tiny model
    its own Q8_0 file differs from poly's run of it by ~8 %)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from entity.gguf.loader import qk_row_order
    from entity.quantize import Planner

    src = _tiny(tmp_path, arch)
    planner = Planner(src)
    cfg = entity.load(src).config
    perm = arch == "llama"
    for name, kw in (("q4", {}), ("bpw", {"bpw": 7.0})):
        dst = tmp_path / f"{arch}-{name}.gguf"
        rep = entity.convert(src, dst, to="gguf", planner=planner, **kw)
        ent = entity.convert(src, tmp_path / f"{name}.entity", planner=planner, **kw)
        assert rep.recipe.types == ent.recipe.types and len(set(rep.recipe.types.values())) > 1
        ref = entity.load(tmp_path / f"{name}.entity")
        tensors = {t.name: t for t in GGUFReader(str(dst)).tensors}
        for i in range(cfg.num_layers):
            for comp, key, heads in (("w_q", "attn_q", cfg.num_heads), ("w_k", "attn_k", cfg.num_kv_heads),
                                     ("w_down", "ffn_down", 0)):  # fmt: skip
                t = tensors[f"blk.{i}.{key}.weight"]
                assert (
                    t.tensor_type.name
                    == rep.recipe.types[f"blocks.{i}.{'mlp' if heads == 0 else 'attn'}.{comp}"].name
                )
                got = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
                if perm and heads:
                    got = got[qk_row_order(heads, cfg.head_dim)]
                want = getattr(ref, "mlp" if heads == 0 else "attn")(i)
                from poly.nn import layout

                w = layout.components(want)[comp]
                np.testing.assert_array_equal(got, np.asarray(w.dequantize(), np.float32))
        theirs, ours = _llama_logits(dst, IDS), entity.load(dst).forward_all(IDS)
        assert np.corrcoef(ours.ravel(), theirs.ravel())[0, 1] > 0.99
        np.testing.assert_allclose(ours, ref.forward_all(IDS), rtol=0, atol=1e-4)


def test_exported_gguf_carries_tokenizer_and_template(tmp_path):
    src = _tiny(tmp_path)
    dst = tmp_path / "t.gguf"
    entity.convert(src, dst, to="gguf", calibrate=False, quant="q8")
    ref = entity.load(src)
    llm = llama_cpp.Llama(str(dst), n_ctx=64, verbose=False, vocab_only=True)
    try:
        text = "hello world, the cat sat on the mat"
        assert llm.tokenize(text.encode(), add_bos=False) == list(ref.tokenizer.encode(text))
        assert llm.metadata.get("tokenizer.chat_template") == ref.chat_template.source
        assert llm.token_eos() in ref.eos_token_ids
    finally:
        llm.close()


def test_unsupported_family_is_a_usage_error_and_leaves_no_file(tmp_path):
    from poly.errors import UsageError

    src = make_tiny_checkpoint(tmp_path / "g", "mixtral", seed=1)  # experts: not exported
    dst = tmp_path / "g.gguf"
    with pytest.raises(UsageError, match="--to gguf"):
        entity.convert(src, dst, to="gguf")
    assert not dst.exists()

"""A GGUF file's float q/k rows (llama.cpp's permuted order) laid out by 16 in the model's order
straight from the file's mapping (poly.runtime.repack.float_kmajor16_stored): no reordered copy
in memory, the logits of transformers' model."""

from __future__ import annotations

import numpy as np
import pytest

from poly.nn import mha
from poly.runtime import ckernels, dispatch, fused, repack
from tests.test_gguf_reader import write_tiny_gguf

needs_c = pytest.mark.skipif(not ckernels.AVAILABLE, reason="the C kernels are not built")


@needs_c
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_permuted_float_rows_are_laid_out_without_a_copy(tmp_path, dtype, each_isa):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from entity.gguf.loader import load_gguf

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, rms_norm_eps=1e-5)  # fmt: skip
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    if dtype == np.float16:  # the reference reads the same float16 values
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.half().float())
    path = tmp_path / "llama.gguf"
    write_tiny_gguf(path, "llama", model, dtype)
    ids = [3, 17, 42, 5, 77, 8, 13, 21, 34, 55, 89, 1, 2, 4, 6, 9, 11, 60]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    tf = load_gguf(path, keep_quantized=True)
    comps = mha.plan(tf.attn(0)).comps
    wq, wk = comps["w_q"], comps["w_k"]
    kind = ckernels.F32 if dtype == np.float32 else ckernels.F16
    laid = repack.float_kmajor16_wanted(kind, 16)
    # the file's order kept: laid out by 16 from it, or read through the rows put in order
    assert wq.order is not None and wk.order is not None
    assert laid or (wq._raw is not None and wk._raw is not None)
    assert fused.plan(tf) is not None
    # laid out or not, float16 blocks count as F16 for the long prompts' fused calls at any width
    assert (fused.plan(tf).block_kinds <= dispatch.CALLS_WIN) == (dtype == np.float16)
    np.testing.assert_allclose(tf.forward_all(ids), ref, atol=2e-4, rtol=0)
    tf.reset()  # and token by token through the fused step
    steps = np.stack([tf.forward([t]) for t in ids])
    np.testing.assert_allclose(steps, ref, atol=2e-4, rtol=0)
    if laid:  # read from the layout alone: the reordered copy was never made
        assert wq._raw is None and wk._raw is None and wq.repacked16.shape == (4, 64, 16)
        np.testing.assert_array_equal(wq.raw, wq.stored[wq.order])  # on demand, in order

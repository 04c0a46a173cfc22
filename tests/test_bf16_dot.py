"""BF16 prompts on vdpbf16ps (csrc/formats/vdpbf16_rows.h, formats/vdpbf16_panels.h): in the default ("auto") scheme, on the
AVX-512 build of a CPU with AVX512_BF16, a prompt's products of GGUF BF16 rows, 4 rows or more,
take x rounded to bfloat16 (nearest even), like llama.cpp's BF16 dots: the result is the stored
weights times those x to float32 rounding. Elsewhere (one row, other builds, q8 off, and HF
bfloat16 weights: parity with transformers) the exact float path."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from poly.runtime import ckernels, fused
from tests.test_ckernels import MAKERS, random_weights
from tests.test_fused import PROMPT
from tests.test_k8 import three_runs

BF16 = ["bfloat16", "gguf_bf16"]


def _dot(isa: str, scheme: str = "gguf_bf16") -> bool:
    return scheme == "gguf_bf16" and isa == "avx512" and bool(ckernels.EXT.info().get("bf16"))


def _bf16(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16).astype(np.float64)


@pytest.mark.parametrize("scheme", BF16)
@pytest.mark.parametrize("n", (1, 3, 4, 7, 16, 17, 40))  # row tiles 4..16, gemm panels from 17
@pytest.mark.parametrize("k", (768, 250))  # 250: a tail of k % 32
def test_bf16_prompts_take_x_in_bf16(scheme, n, k, each_isa):
    assert ckernels.BF16_DOT == _dot(each_isa)
    qt = MAKERS[scheme](random_weights(37, k, seed=n))
    w = qt.dequantize().astype(np.float64)
    x = np.random.default_rng(n).standard_normal((n, k)).astype(np.float32)
    x[:, 3] *= 30.0
    out = qt.matmul(x)
    ref, coded = x.astype(np.float64) @ w.T, _bf16(x) @ w.T
    scale = np.abs(ref).max()
    ckernels.set_act_q8(False)
    try:
        exact = qt.matmul(x)  # the same entry (row kernels or gemm) on the float path
    finally:
        ckernels.set_act_q8("auto")
    if _dot(each_isa, scheme) and n >= 4:
        assert np.abs(out - coded).max() <= 2e-6 * scale  # the stored weights times x in bf16
        assert 1e-4 * scale < np.abs(out - ref).max() <= 1e-2 * scale  # x was rounded
    else:
        assert np.abs(out - ref).max() <= 2e-6 * scale
        np.testing.assert_array_equal(out, exact)


@pytest.mark.parametrize("scheme", BF16)
def test_bf16_model_prompt_in_bf16_decode_in_float(scheme, monkeypatch, each_isa):
    """A BF16 model: the fused step's prompt equals the Python path's (both x in bf16 where the
    dots run: GGUF's rows), within 1e-2 of the float path; its one-row decode steps are the float
    path's. HF bfloat16 weights stay exact."""
    tf, (auto, python, exact) = three_runs(scheme, monkeypatch)
    assert len(PROMPT) >= 4
    # the server's scheduler keeps such prompts apart from decode rows (poly.serving.scheduler)
    assert fused.rows_alike(tf) == (not _dot(each_isa, scheme))
    a, p, e = auto[0], python[0], exact[0]
    assert np.array_equal(a, e) == (not _dot(each_isa, scheme))
    assert np.abs(a - e).max() <= 1e-2 * np.abs(e).max()
    np.testing.assert_allclose(p, a, rtol=0, atol=1e-5 * np.abs(e).max())
    for a, e in zip(auto[1:], exact[1:]):  # decode steps: float rows (after a bf16 prompt's cache)
        assert np.abs(a - e).max() <= 1e-2 * np.abs(e).max()

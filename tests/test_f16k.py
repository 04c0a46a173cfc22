"""float16 rows laid out by 16, k-major (csrc/pk_f16k.h, poly.runtime.repack.f16k): the layout, the
kernels that read it against the same products on the stored rows (bitwise: one order of sums),
and whole models whose float16 rows are mapped from a file against the same weights in memory.

The layout is made on 8-lane builds only (`info()["f16k"]`); the kernel tests take every build
through `each_isa`, the model tests run again on the AVX2 build in tests/test_other_isa.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from poly import layout
from poly.layer import LayerType
from poly.runtime import ckernels, fused, kernels, repack
from poly.runtime.batch import forward_batch
from tests.tiny_model import random_transformer, tiny_cfg

needs_c = pytest.mark.skipif(not ckernels.AVAILABLE, reason="the C kernels are not built")


def _by16(w: np.ndarray) -> np.ndarray:
    m, k = w.shape
    return np.ascontiguousarray(w.reshape(m // 16, 16, k).transpose(0, 2, 1))  # [g, k, 16]


@needs_c
@pytest.mark.parametrize("m, k", [(16, 8), (48, 96), (64, 1000)])
def test_the_layout_is_groups_of_16_rows_k_major(m, k, each_isa):
    w = np.random.default_rng(m).standard_normal((m, k)).astype(np.float16)
    dst = np.zeros((m // 16, k, 16), np.uint16)
    ckernels.EXT.f16k(w.view(np.uint16), dst, m, k)
    np.testing.assert_array_equal(dst, _by16(w.view(np.uint16)))
    with pytest.raises(ValueError):
        ckernels.EXT.f16k(w[:8].view(np.uint16), dst[:0], 8, k)  # rows not a multiple of 16
    with pytest.raises(ValueError):
        ckernels.EXT.f16k(w.view(np.uint16), dst[:-1], m, k)  # dst too short


@needs_c
@pytest.mark.parametrize("m, k", [(48, 96), (64, 1000), (32, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_products_on_the_layout_equal_the_stored_rows_panels(m, k, threads, each_isa):
    """gemm and matmul reading the layout give the gemm panels' sums on the stored rows, bit for
    bit (the same order: a chunk's FMA chain, chunks added in turn), for every input count: the
    decode rows (1 input, groups in pairs), the tiles (2-16), the panels (17+); matmul splits the
    rows evenly between threads, through the middle of a group at m = 48."""
    if not ckernels.EXT.info().get("f16k"):
        pytest.skip("this build reads the stored float16 rows")
    rng = np.random.default_rng(k)
    w = rng.standard_normal((m, k)).astype(np.float16)
    hk = _by16(w)
    old = kernels.num_threads()
    kernels.set_num_threads(threads)
    try:
        for n in (1, 2, 5, 6, 7, 16, 17, 42, 64):
            x = ckernels.aligned(rng.standard_normal((n, k)).astype(np.float32))
            ref = np.empty((n, m), np.float32)
            ckernels.EXT.gemm(ckernels.F16, x, ref, w, None, n, k, m, threads)
            got = np.empty_like(ref)
            ckernels.EXT.gemm(ckernels.F16, x, got, w, None, n, k, m, threads, 0, hk)
            np.testing.assert_array_equal(got, ref, err_msg=f"gemm n={n}")
            if n <= ckernels.MAX_N:
                got[...] = np.nan
                ckernels.EXT.matmul(ckernels.F16, x, got, w, None, n, k, m, 0, hk)
                np.testing.assert_array_equal(got, ref, err_msg=f"matmul n={n}")
            exact = x.astype(np.float64) @ w.astype(np.float64).T
            np.testing.assert_allclose(ref, exact, rtol=0, atol=1e-4 * np.abs(exact).max())
    finally:
        kernels.set_num_threads(old)


@needs_c
def test_a_layout_of_the_wrong_size_is_refused(each_isa):
    if not ckernels.EXT.info().get("f16k"):
        pytest.skip("this build reads the stored float16 rows")
    w = np.zeros((32, 64), np.float16)
    x, out = np.zeros((1, 64), np.float32), np.zeros((1, 32), np.float32)
    with pytest.raises(ValueError):
        ckernels.EXT.gemm(ckernels.F16, x, out, w, None, 1, 64, 32, 1, 0, np.zeros(10, np.uint16))
    with pytest.raises(ValueError):
        ckernels.EXT.matmul(ckernels.F16, x, out, w, None, 1, 64, 32, 0, np.zeros(10, np.uint16))


def _half_model(tmp_path=None, seed=21):
    """A tiny model with float16 matrices: in memory, or mapped from files under tmp_path."""
    tf = random_transformer(
        tiny_cfg(hidden=64, inter=1040, max_seq_len=96, vocab_size=128), seed=seed
    )

    def half(name, a):
        a = np.ascontiguousarray(a).astype(np.float16)
        if tmp_path is None:
            return a
        path = tmp_path / f"{name}.bin"
        a.tofile(path)
        return np.memmap(path, dtype=np.float16, mode="r", shape=a.shape)

    for li, layer in enumerate(tf.network.walk()):
        if layer.type in (LayerType.MHA, LayerType.SWIGLU):
            comps = {
                name: None
                if view is None
                else (
                    half(f"{li}-{name}", view)
                    if name in layout.MATRIX_COMPONENTS
                    else np.array(view, dtype=np.float32)
                )
                for name, view in layout.views(layer).items()
            }
            layer.weights.set_version("float16", comps, activate=True)
    tf.lm_head = half("head", tf.lm_head)
    return tf


@needs_c
def test_a_model_on_mapped_float16_rows_matches_the_same_weights_in_memory(tmp_path):
    """Mapped rows are laid out by 16 when the plan is made (8-lane builds; elsewhere, and for
    arrays in memory, the stored rows are read): prompts in one fused call (3 and 20 tokens),
    a prompt past one call (70 tokens: the reference path's gemm), then decode steps."""
    mapped, memory = _half_model(tmp_path), _half_model()
    assert fused.plan(mapped) is not None and fused.plan(memory) is not None
    laid = bool(ckernels.EXT.info().get("f16k"))
    assert (len(ckernels.F16K) > 0) == laid
    for prompt in ([3, 9, 27], list(range(1, 21)), [(7 * i) % 120 for i in range(70)]):
        outs = []
        for tf in (mapped, memory):
            tf.reset()
            got = [tf.forward(prompt)]
            for _ in range(4):
                got.append(tf.forward([int(np.argmax(got[-1]))]))
            outs.append(got)
        scale = max(float(np.abs(r).max()) for r in outs[1])
        for g, r in zip(*outs):
            np.testing.assert_allclose(g, r, rtol=0, atol=2e-5 * scale)


def _decode(tf, prompts, steps):
    """Each prompt prefilled alone, then the decode steps of all of them as one batch."""
    states = [tf.new_state() for _ in prompts]
    for p, st in zip(prompts, states):
        forward_batch(tf, [p], [st])
    return [forward_batch(tf, [[s[j]] for s in steps], states) for j in range(len(steps[0]))]


@needs_c
def test_a_sequence_decodes_the_same_alone_and_batched_on_the_layout(tmp_path):
    """A row's sums do not depend on the other rows of a call (rows_alike): one sequence's logits
    decoded alone equal its logits decoded beside two others, bit for bit."""
    tf = _half_model(tmp_path, seed=5)
    assert fused.plan(tf) is not None and fused.rows_alike(tf)
    if not ckernels.EXT.info().get("f16k"):
        pytest.skip("the stored float16 rows: the tiles' sums differ from the decode rows'")
    prompts, steps = [[5, 6, 7], [11, 3], [90, 1, 2, 4]], [[20, 21], [30, 31], [40, 41]]
    got = _decode(tf, prompts, steps)
    alone = _decode(tf, [prompts[0]], [steps[0]])
    for a, g in zip(alone, got):
        np.testing.assert_array_equal(g[0], a[0])


def test_arrays_in_memory_are_not_laid_out():
    """A copy of rows held in memory would double the resident weights: only mapped rows are laid out."""
    w = np.zeros((32, 64), np.float16)
    assert repack.f16k(ckernels.F16, w, w, 32, 64) is None

"""float16/float32 rows laid out by 16, k-major (csrc/formats/float_kmajor16.h,
poly.runtime.repack.float_kmajor16): the layout, the kernels that read it against the same
products on the stored rows (bitwise: one order of sums), and whole models whose rows are mapped
from a file against the same weights in memory.

The layout is made on the SIMD builds (`info()["float_kmajor16"]`); the kernel tests take every
build through `each_isa`, the model tests run again on the AVX2 build in tests/test_other_isa.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from poly import layout
from poly.layer import LayerType
from poly.runtime import ckernels, dispatch, fused, kernels, repack
from tests.test_interleave16 import decode_steps
from tests.tiny_model import random_transformer, tiny_cfg

needs_c = pytest.mark.skipif(not ckernels.AVAILABLE, reason="the C kernels are not built")


def _laid(kind: int) -> bool:
    """Whether the build in use lays `kind` out by 16 (float32 and float16 on the SIMD builds)."""
    return bool(ckernels.EXT.info().get("float_kmajor16", 0) >> kind & 1)


def _by16(w: np.ndarray) -> np.ndarray:
    m, k = w.shape
    return np.ascontiguousarray(w.reshape(m // 16, 16, k).transpose(0, 2, 1))  # [g, k, 16]


KINDS = {np.float16: ckernels.F16, np.float32: ckernels.F32}


@needs_c
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("m, k", [(16, 8), (48, 96), (64, 1000)])
def test_the_layout_is_groups_of_16_rows_k_major(m, k, dtype, each_isa):
    w = np.random.default_rng(m).standard_normal((m, k)).astype(dtype)
    es = w.itemsize
    dst = np.zeros((m // 16, k, 16), dtype)
    ckernels.EXT.float_kmajor16(w, dst, m, k, es)
    np.testing.assert_array_equal(dst, _by16(w))
    with pytest.raises(ValueError):
        ckernels.EXT.float_kmajor16(w[:8], dst[:0], 8, k, es)  # rows not a multiple of 16
    with pytest.raises(ValueError):
        ckernels.EXT.float_kmajor16(w, dst[:-1], m, k, es)  # dst too short
    with pytest.raises(ValueError):
        ckernels.EXT.float_kmajor16(w, dst, m, k, 3)  # elements of 2 or 4 bytes


@needs_c
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("m, k", [(48, 96), (64, 1000), (32, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_products_on_the_layout_equal_the_stored_rows_panels(m, k, threads, dtype, each_isa):
    """gemm and matmul reading the layout give the gemm panels' sums on the stored rows, bit for
    bit (the same order: a chunk's FMA chain, chunks added in turn), for every input count: the
    decode rows (1 input, groups in pairs), the tiles (2-16), the panels (17+); matmul splits the
    rows evenly between threads, through the middle of a group at m = 48 (AVX-512: of a panel)."""
    w, kind = np.random.default_rng(k).standard_normal((m, k)).astype(dtype), KINDS[dtype]
    if not _laid(kind):
        pytest.skip("this build reads the stored rows")
    rng = np.random.default_rng(k + 1)
    hk = _by16(w)
    old = kernels.num_threads()
    kernels.set_num_threads(threads)
    try:
        for n in (1, 2, 5, 6, 7, 16, 17, 42, 64):
            x = ckernels.aligned(rng.standard_normal((n, k)).astype(np.float32))
            ref = np.empty((n, m), np.float32)
            ckernels.EXT.gemm(kind, x, ref, w, None, n, k, m, threads)
            got = np.empty_like(ref)
            ckernels.EXT.gemm(kind, x, got, w, None, n, k, m, threads, 0, hk)
            np.testing.assert_array_equal(got, ref, err_msg=f"gemm n={n}")
            if n <= ckernels.MAX_N:
                got[...] = np.nan
                ckernels.EXT.matmul(kind, x, got, w, None, n, k, m, 0, hk)
                np.testing.assert_array_equal(got, ref, err_msg=f"matmul n={n}")
            exact = x.astype(np.float64) @ w.astype(np.float64).T
            np.testing.assert_allclose(ref, exact, rtol=0, atol=1e-4 * np.abs(exact).max())
    finally:
        kernels.set_num_threads(old)


@needs_c
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_inputs_past_the_block_size_run_in_blocks_with_the_same_bits(dtype, each_isa):
    """An x of more than 8 MB (700 tokens of k 4096) runs in blocks of tokens (gemm/gemm.h
    gemm_tblock): every row equals the same row's product in calls of 100 tokens (one block),
    bit for bit, on the layout and on the stored rows, and the float64 product."""
    m, k, n = 48, 4096, 700
    w, kind = np.random.default_rng(5).standard_normal((m, k)).astype(dtype), KINDS[dtype]
    x = ckernels.aligned(np.random.default_rng(6).standard_normal((n, k)).astype(np.float32))
    hk = _by16(w) if _laid(kind) else None
    for extra in ((), (0, hk)) if hk is not None else ((),):
        got = np.full((n, m), np.nan, np.float32)
        ckernels.EXT.gemm(kind, x, got, w, None, n, k, m, 2, *extra)
        for a in range(0, n, 100):
            part = np.full((100, m), np.nan, np.float32)
            ckernels.EXT.gemm(
                kind, ckernels.aligned(x[a : a + 100]), part, w, None, 100, k, m, 2, *extra
            )
            np.testing.assert_array_equal(got[a : a + 100], part, err_msg=f"tokens {a}..{a + 100}")
    exact = x.astype(np.float64) @ w.astype(np.float64).T  # [n, m]
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-4 * np.abs(exact).max())


@needs_c
def test_a_layout_of_the_wrong_size_is_refused(each_isa):
    if not _laid(ckernels.F32):
        pytest.skip("this build reads the stored rows")
    w = np.zeros((32, 64), np.float32)
    x, out = np.zeros((1, 64), np.float32), np.zeros((1, 32), np.float32)
    with pytest.raises(ValueError):
        ckernels.EXT.gemm(ckernels.F32, x, out, w, None, 1, 64, 32, 1, 0, np.zeros(10, np.uint32))
    with pytest.raises(ValueError):
        ckernels.EXT.matmul(ckernels.F32, x, out, w, None, 1, 64, 32, 0, np.zeros(10, np.uint32))


def _model(tmp_path=None, seed=21, dtype=np.float16):
    """A tiny model with float16 (float32) matrices: in memory, or mapped from files under tmp_path."""
    tf = random_transformer(
        tiny_cfg(hidden=64, inter=1040, max_seq_len=96, vocab_size=128), seed=seed
    )

    def stored(name, a):
        a = np.array(a, dtype=dtype)  # a copy of its own
        if tmp_path is None:
            return a
        path = tmp_path / f"{name}.bin"
        a.tofile(path)
        return np.memmap(path, dtype=dtype, mode="r", shape=a.shape)

    for li, layer in enumerate(tf.network.walk()):
        if layer.type in (LayerType.MHA, LayerType.SWIGLU):
            comps = {
                name: None
                if view is None
                else (
                    stored(f"{li}-{name}", view)
                    if name in layout.MATRIX_COMPONENTS
                    else np.array(view, dtype=np.float32)
                )
                for name, view in layout.views(layer).items()
            }
            layer.weights.set_version(np.dtype(dtype).name, comps, activate=True)
    tf.lm_head = stored("head", tf.lm_head)
    return tf


@needs_c
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_a_model_on_mapped_rows_matches_the_same_weights_in_memory(tmp_path, dtype, monkeypatch):
    """Mapped rows are laid out by 16 when the plan is made (SIMD builds; elsewhere, and for
    arrays in memory, the stored rows are read): prompts in one fused call (3 and 20 tokens),
    a prompt past one call (70 tokens: float32 on the reference path's gemm, as a wide model's;
    float16 as fused calls), then decode steps."""
    monkeypatch.setattr(dispatch, "SMALL_WIDTH", 0)
    mapped, memory = _model(tmp_path, dtype=dtype), _model(dtype=dtype)
    assert fused.plan(mapped) is not None and fused.plan(memory) is not None
    assert (id(mapped.lm_head) in ckernels.FLOAT_KMAJOR16) == _laid(KINDS[dtype])
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


@needs_c
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_a_sequence_decodes_the_same_alone_and_batched_on_the_layout(tmp_path, dtype):
    """A row's sums do not depend on the other rows of a call (rows_alike): one sequence's logits
    decoded alone equal its logits decoded beside two others, bit for bit."""
    tf = _model(tmp_path, seed=5, dtype=dtype)
    assert fused.plan(tf) is not None and fused.rows_alike(tf)
    if not _laid(KINDS[dtype]):
        pytest.skip("the stored rows: the tiles' sums differ from the decode rows'")
    prompts, steps = [[5, 6, 7], [11, 3], [90, 1, 2, 4]], [[20, 21], [30, 31], [40, 41]]
    got = decode_steps(tf, prompts, steps)
    alone = decode_steps(tf, [prompts[0]], [steps[0]])
    for a, g in zip(alone, got):
        np.testing.assert_array_equal(g[0], a[0])


def test_arrays_in_memory_are_not_laid_out():
    """A copy of rows held in memory would double the resident weights: only mapped rows are laid out."""
    w = np.zeros((32, 64), np.float16)
    assert repack.float_kmajor16(ckernels.F16, w, w, 32, 64) is None


def test_rows_on_an_anonymous_mapping_keep_their_bytes():
    """poly.weights' huge-page buffers are anonymous mappings: dropping their pages would zero
    the weights (the float32 masters of a dequantized GGUF, a tied embedding table): neither laid
    out nor released."""
    from poly.weights import HUGE, aligned_zeros

    w = aligned_zeros(HUGE // 4, np.float32).reshape(-1, 512)  # [1024, 512] on an anonymous mmap
    w[...] = 1.5
    assert repack.float_kmajor16(ckernels.F32, w, w, *w.shape) is None
    repack.release_mapped(w)
    assert float(w.min()) == 1.5 == float(w.max())

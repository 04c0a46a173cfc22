"""The prefill product `gemm` (csrc/gemm/gemm.h) on every instruction-set build: x @ W.T against
float64 numpy on the reference dequantization (gguf-py's quantizer and decoders for the GGUF
kinds), over ragged row panels, token tails of every tile size and k split into several packed
chunks; and the thread policy that keeps BLAS from waiting on spinning OpenMP workers."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from poly.runtime import attention, ckernels, kernels, repack
from tests.test_ckernels import MAKERS, block_of, random_weights

pytestmark = [
    pytest.mark.skipif(not ckernels.AVAILABLE, reason="poly.runtime.native.ckernels not built"),
    pytest.mark.usefixtures("c_backend"),
]


def _check(qt, n: int, threads: int = 0) -> None:
    m, k = qt.shape
    kind, w, aux = ckernels.operands(qt)
    x = np.random.default_rng(n + k).standard_normal((n, k)).astype(np.float32)
    out = np.full((n, m), np.nan, dtype=np.float32)
    ckernels.gemm(kind, w, aux, x, out, threads)
    ref = x.astype(np.float64) @ qt.dequantize().astype(np.float64).T  # [n, m]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=2e-5 * np.abs(ref).max())


@pytest.mark.parametrize("scheme", sorted(MAKERS))
def test_gemm_matches_the_dequantized_product(scheme, each_isa):
    k = 1280 if block_of(scheme) == 256 else 1120  # > one packed chunk, a ragged last chunk
    qt = MAKERS[scheme](random_weights(75, k, seed=3))  # 75 rows: two full panels and a ragged one
    _check(qt, 29)  # token tiles of 12 / 6 and a tail


@pytest.mark.parametrize("scheme", ["float32", "float16", "bfloat16", "gguf_q8_0"])
@pytest.mark.parametrize("k", [768, 1283])  # x copied at a padded stride; a chunk of 259 columns
def test_gemm_padded_x_and_ragged_columns(scheme, k, each_isa):
    if k % block_of(scheme):
        pytest.skip("whole blocks only")
    _check(MAKERS[scheme](random_weights(70, k, seed=k)), 29, 2)


@pytest.mark.parametrize("n", [1, 5, 6, 7, 11, 12, 13, 17, 24, 100])
def test_gemm_every_token_tail(n, each_isa):
    _check(MAKERS["gguf_q8_0"](random_weights(40, 96, seed=n)), n)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_gemm_thread_counts_agree(threads):
    qt = MAKERS["gguf_q4_1"](random_weights(130, 256, seed=1))
    _check(qt, 33, threads)


def test_prefill_products_route_through_gemm(monkeypatch):
    calls = []
    real = ckernels.EXT

    class Spy:
        def __getattr__(self, name):
            fn = getattr(real, name)
            return (lambda *a: (calls.append(name), fn(*a))[1]) if name == "gemm" else fn

    monkeypatch.setattr(ckernels, "EXT", Spy())
    qt = MAKERS["gguf_q4_0"](random_weights(64, 128, seed=2))
    x = np.random.default_rng(0).standard_normal((40, 128)).astype(np.float32)
    qt.matmul(x)  # a quantized matrix, 40 rows
    kernels.dense_matmul(x, random_weights(64, 128, seed=4))  # a float32 array, 40 rows
    g = ckernels.GEMM_ROWS  # the build's: 17 on AVX-512, 9 on 8 lanes
    qt.matmul(x[:g])  # GEMM_ROWS rows: gemm
    qt.matmul(x[: g - 1])  # fewer: the row kernels' register tiles
    kernels.dense_matmul(x[: g - 1], random_weights(64, 128, seed=4))  # float32 too
    kernels.dense_matmul(x[: ckernels.MAX_N], random_weights(64, 128, seed=4))  # tiles to MAX_N
    assert calls == ["gemm", "gemm", "gemm"]
    kernels.dense_matmul(x[: ckernels.MAX_N + 1], random_weights(64, 128, seed=4))
    assert calls == ["gemm", "gemm", "gemm", "gemm"]


def test_gemm_bad_inputs_raise():
    qt = MAKERS["gguf_q8_0"](random_weights(8, 64, seed=0))
    kind, w, aux = ckernels.operands(qt)
    x = np.zeros((3, 64), np.float32)
    with pytest.raises(ValueError):
        ckernels.EXT.gemm(kind, x, np.zeros((3, 8), np.float32), w[:-1], None, 3, 64, 8, 0)
    with pytest.raises(ValueError):
        ckernels.EXT.gemm(kind, x, np.zeros((3, 7), np.float32), w, None, 3, 64, 8, 0)
    with pytest.raises(ValueError):
        ckernels.EXT.gemm(
            kind, x, np.zeros((3, 8), np.float32), w, np.ones(8, np.float32), 3, 64, 8, 0
        )
    with pytest.raises(ValueError):
        ckernels.EXT.gemm(99, x, np.zeros((3, 8), np.float32), w, None, 3, 64, 8, 0)


def test_blas_runs_one_thread_under_the_c_backend():
    threadpoolctl = pytest.importorskip("threadpoolctl")

    def blas() -> set[int]:  # numpy's BLAS (torch, loaded later by other tests, has its own)
        info = threadpoolctl.threadpool_info()
        return {
            i["num_threads"] for i in info if i["user_api"] == "blas" and "numpy" in i["filepath"]
        }

    n = kernels.num_threads()
    kernels.set_backend("c")
    assert kernels.blas_threads(n) == 1 and blas() <= {1}
    kernels.set_backend("numpy")
    try:
        assert kernels.blas_threads(n) == n and blas() <= {n}
    finally:
        kernels.set_backend("c")


def test_numpy_loaded_by_poly_starts_its_blas_at_one_thread():
    """`poly.openblas`: numpy's OpenBLAS starts at the C backend's one thread, with nothing
    left in the environment and no threadpoolctl import, and can still be raised."""
    pytest.importorskip("threadpoolctl")
    code = """if True:
        import os, sys
        import poly
        from poly.runtime import kernels
        kernels.set_num_threads(2)
        if kernels.backend() != "c":  # no C kernels in this build: BLAS runs the products
            sys.exit(0)
        assert "threadpoolctl" not in sys.modules and "OPENBLAS_NUM_THREADS" not in os.environ
        from threadpoolctl import threadpool_info
        blas = lambda: {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}
        assert blas() == {1}, blas()
        kernels.set_backend("numpy")
        assert blas() == {min(2, os.cpu_count())}, blas()
    """
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


@pytest.mark.parametrize("n,start,groups", [(96, 0, 3), (100, 37, 1), (130, 5, 2), (300, 37, 2)])
def test_c_prefill_attention_matches_numpy(n, start, groups, each_isa, monkeypatch):
    from poly import ops
    from poly.nn import mha

    rng = np.random.default_rng(n)
    kvh, hd = 2, 64
    t = start + n
    q = rng.standard_normal((n, kvh * groups, hd)).astype(np.float32)
    k = rng.standard_normal((t, kvh, hd)).astype(np.float32)
    v = rng.standard_normal((t, kvh, hd)).astype(np.float32)
    got = attention.attend(q, k, v, start, groups)
    assert got is not None and got.shape == q.shape
    monkeypatch.setitem(ops.HOOKS, "attend", None)
    ref = mha._attend(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), start, groups
    )
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("block", [16, 37])
def test_c_prefill_attention_in_short_blocks_matches_numpy(block, monkeypatch):
    """A long context caps a block's scores (ATTEND_SCORES): fewer queries a block, the last
    block partial, still the reference's numbers."""
    from poly import ops
    from poly.nn import mha

    rng = np.random.default_rng(block)
    n, start, groups, kvh, hd = 150, 700, 3, 2, 64
    t = start + n
    monkeypatch.setattr(attention, "ATTEND_SCORES", groups * t * block)
    q = rng.standard_normal((n, kvh * groups, hd)).astype(np.float32)
    k = rng.standard_normal((t, kvh, hd)).astype(np.float32)
    v = rng.standard_normal((t, kvh, hd)).astype(np.float32)
    got = attention.attend(q, k, v, start, groups)
    monkeypatch.setitem(ops.HOOKS, "attend", None)
    ref = mha._attend(*(a.astype(np.float64) for a in (q, k, v)), start, groups)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5)


def test_small_attention_stays_on_numpy():
    q = np.zeros((4, 2, 64), np.float32)
    k = np.zeros((4, 1, 64), np.float32)
    assert attention.attend(q, k, k, 0, 2) is None  # below ATTEND_MIN queries x keys
    assert (
        attention.attend(
            np.zeros((200, 2, 64)), np.zeros((200, 1, 64)), np.zeros((200, 1, 64)), 0, 2
        )
        is None
    )


def test_softmax_causal_bad_inputs_raise():
    with pytest.raises(ValueError):
        ckernels.EXT.softmax_causal(np.zeros((5, 8), np.float32), 2, 0, 0)  # 5 rows, n = 2
    with pytest.raises(ValueError):
        ckernels.EXT.softmax_causal(np.zeros((4, 8), np.float32), 4, 6, 0)  # start + n > T
    with pytest.raises((ValueError, TypeError, BufferError)):
        ckernels.EXT.softmax_causal(np.zeros((4, 8), np.float32)[:, ::2], 4, 0, 0)


@pytest.mark.parametrize("scheme", ["gguf_q4_0", "gguf_q8_0"])
def test_a_long_prompt_on_the_repacked_rows_is_its_8_input_pieces(scheme, each_isa):
    """Past 8 inputs the rows go in blocks of groups (AVX-512: a block's records stay in L2 while
    every 8 inputs pass; k = 8192 makes 3 blocks of 160 rows): bit for bit the pieces' sums."""
    if not ckernels.info().get("interleave16"):
        pytest.skip("no repacked rows in this build")
    rng = np.random.default_rng(8)
    m, k, n = 160, 8192, 20
    qt = MAKERS[scheme](rng.standard_normal((m, k)).astype(np.float32))
    kind, raw, aux = ckernels.operands(qt)
    rp = repack.interleave16(kind, raw, m, k, aux)
    x = ckernels.aligned(rng.standard_normal((n, k)).astype(np.float32))
    got, part = np.empty((n, m), np.float32), np.empty((8, m), np.float32)
    ckernels.EXT.gemm(kind, x, got, raw, aux, n, k, m, 0, ckernels.Q8_AUTO, rp)
    for c in range(0, n, 8):
        p = min(8, n - c)
        args = (kind, ckernels.aligned(x[c : c + p]), part[:p], raw, aux, p, k, m)
        ckernels.EXT.matmul(*args, ckernels.Q8_AUTO, rp)
        np.testing.assert_array_equal(got[c : c + p], part[:p])

"""The K-quant kinds' integer paths of the default ("auto") scheme: one-row products on x's
first int8 code (csrc/formats/kquant_rows.h; both codes with POLY_ACT_Q8=1), 4 rows or more on int8 panels
(csrc/formats/kquant_panels.h), in the kernels alone and inside the fused step."""

from __future__ import annotations

import numpy as np
import pytest

from poly.runtime import ckernels
from tests.test_ckernels import MAKERS, QUANTIZED, block_of, kernel_case, random_weights
from tests.test_fused import K_QUANTS, PROMPT, quantize_all, run_steps, tiny_cfg
from tests.tiny_model import random_transformer

# the kinds whose one-row products take x's first int8 code in the auto mode: the K-quants
# (formats/kquant_rows.h) and the 32-block kinds without repacked rows (rows/int8_rows.h, pq8_kind)
ONE_CODE = [
    s for s in QUANTIZED if s not in ("int8", "loom_q4", "gguf_q4_0", "gguf_q4_1", "gguf_q8_0")
]
PQ8 = ["gguf_q5_0", "gguf_q5_1", "gguf_iq4_nl", "gguf_iq4_xs"]


def test_one_code_kinds():
    assert sorted(ONE_CODE) == sorted(
        PQ8 + [s for s in QUANTIZED if block_of(s) == 256 and "iq4" not in s]
    )


@pytest.mark.parametrize("scheme", ONE_CODE)
def test_auto_scheme_takes_int8_activations_for_one_code_rows_only(scheme):
    """The default ("auto"): a one-row K-quant, Q5_0/Q5_1/IQ4 product takes x as one int8 code
    per element (csrc/formats/kquant_rows.h, rows/int8_rows.h, A->x1, like llama.cpp: one scale per 256 for the K-quants
    (Q8_K), per 32 for the others (Q8_0)): exact on the code grid, within 3e-2 of the exact result
    with a 30x outlier channel, and the stored weights times x's codes (the offsets and mins on
    the codes' sums too); POLY_ACT_Q8=1 two codes per 32 (within 2e-3); several rows the exact
    float path."""
    assert ckernels.act_q8() == ckernels.Q8_AUTO
    group = 256 if block_of(scheme) == 256 and "iq4" not in scheme else 32
    qt, x, ref = kernel_case(scheme, 67, 3, seed=2)
    w = qt.dequantize().astype(np.float64)
    grid = _on_code_grid(1, x.shape[1], seed=4, group=group)
    exact = grid.astype(np.float64) @ w.T
    np.testing.assert_allclose(qt.matmul(grid), exact, rtol=1e-5, atol=2e-6 * np.abs(exact).max())
    x[:, 5] *= 30.0
    ref = x.astype(np.float64) @ w.T
    one, two = qt.matmul(x[:1]), ckernels.matmul(qt, x[:1], q8=True)
    assert not np.array_equal(one, ckernels.matmul(qt, x[:1], q8=False))
    scale = np.abs(ref[:1]).max()
    assert 1e-4 * scale < np.abs(one - ref[:1]).max() <= 3e-2 * scale  # x was rounded
    codes = _int8_codes(x[:1], group) @ w.T  # on x's float sums, the offsets doubled the error
    np.testing.assert_allclose(one, codes, rtol=0, atol=1e-5 * scale)
    assert np.abs(two - ref[:1]).max() <= min(2e-3 * scale, 0.1 * np.abs(one - ref[:1]).max())
    np.testing.assert_array_equal(qt.matmul(x), ckernels.matmul(qt, x, q8=False))


def _on_code_grid(n: int, k: int, seed: int, group: int = 32) -> np.ndarray:
    """x whose int8 codes with one scale per `group` (max |x| / 127) are exact: integers times a
    power of two, each group holding +-127 once."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-126, 127, (n, k)).astype(np.float32)
    x[:, ::group] = 127.0 * np.sign(rng.standard_normal((n, k // group)) + 0.5)
    return x * np.float32(2.0**-5)


def _int8_codes(x: np.ndarray, group: int = 32) -> np.ndarray:
    """x as the int8 rows read it: round(x / dx) * dx, dx = max|x| / 127 per `group` (ties to
    even)."""
    b = x.reshape(x.shape[0], -1, group).astype(np.float32)
    dx = np.abs(b).max(axis=2, keepdims=True) / np.float32(127.0)
    c = np.rint(b * np.where(dx > 0, np.float32(1.0) / dx, np.float32(0.0)))
    return (c.astype(np.float64) * dx).reshape(x.shape)


K_QUANT = [s for s in QUANTIZED if block_of(s) == 256 and "iq4" not in s]
IQ4 = ["gguf_iq4_nl", "gguf_iq4_xs"]


def _panels(scheme: str, isa: str) -> bool:
    """Whether `scheme`'s prompts take the int8 panels on build `isa`: the K-quants and IQ4 on
    every SIMD build (IQ4: codes + 128 on vpdpbusd, AVX2 the sign trick)."""
    return scheme in K_QUANT + IQ4 and isa != "base"


@pytest.mark.parametrize("scheme", K_QUANT + IQ4)
@pytest.mark.parametrize("n", (4, 7, 16, 21, 40, 131))  # tiles of 8 inputs, ragged tails
def test_k_quant_prefill_takes_int8_panels(scheme, n, each_isa):
    """The default ("auto") on SIMD builds, 4 input rows or more (csrc/formats/kquant_panels.h): x as one int8 code
    per element, one scale per 32. On the code grid the integer products are exact; on Gaussian x
    (an outlier channel too) the result is the stored weights times x's codes (to float rounding),
    and x's rounding stays within 1e-2 of the output scale. IQ4 too."""
    m, k = 39, 768  # panels of 16 + 16 + 7 rows
    qt = MAKERS[scheme](random_weights(m, k, seed=n))
    w = qt.dequantize().astype(np.float64)
    x = _on_code_grid(n, k, seed=n)
    ref = x.astype(np.float64) @ w.T
    np.testing.assert_allclose(qt.matmul(x), ref, rtol=1e-5, atol=2e-6 * np.abs(ref).max())
    x = np.random.default_rng(n).standard_normal((n, k)).astype(np.float32)
    x[:, 3] *= 30.0
    ref = x.astype(np.float64) @ w.T
    out = qt.matmul(x)
    err = np.abs(out - ref).max() / np.abs(ref).max()
    if not _panels(scheme, each_isa):  # the float path
        assert err <= 1e-5
    else:  # the codes' rounding really happened (30x outlier: its block's codes are coarse)
        assert 1e-4 < err <= 4e-2
        coded = _int8_codes(x) @ w.T
        assert np.abs(out - coded).max() <= 2e-5 * np.abs(coded).max()


def three_runs(scheme, monkeypatch):
    """A random model with every matrix in `scheme`: (model, (the fused step in the auto mode,
    the Python path in the auto mode, the fused step on the float path))."""
    tf = random_transformer(tiny_cfg(hidden=256, inter=512), seed=5)
    quantize_all(tf, scheme)
    tf.lm_head = MAKERS[scheme](np.ascontiguousarray(tf.lm_head))
    return tf, _runs(tf, monkeypatch)


def _runs(tf, monkeypatch):
    """(the fused step in the auto mode, the Python path in the auto mode, the fused step on
    the float path) of run_steps on tf."""
    auto = run_steps(tf, True, monkeypatch)
    python = run_steps(tf, False, monkeypatch)
    ckernels.set_act_q8(False)
    try:
        exact = run_steps(tf, True, monkeypatch)
    finally:
        ckernels.set_act_q8("auto")
    return auto, python, exact


@pytest.mark.parametrize("scheme", PQ8)
def test_q5_iq4_decode_rows_take_one_int8_code_by_default(scheme, monkeypatch, each_isa):
    """ "auto": a Q5_0/Q5_1/IQ4 model's one-row steps take x's first int8 code (rows/int8_rows.h, like
    llama.cpp's q8_0 activations), in the fused step as in the Python path; its prompt the float
    paths (bitwise the q8-off step's), but IQ4's on SIMD builds: the int8 panels (formats/kquant_panels.h).
    Within 6e-2 of the float path on this random model."""
    tf, (auto, python, exact) = three_runs(scheme, monkeypatch)
    a, p, e = auto[0], python[0], exact[0]  # the prompt
    assert np.array_equal(a, e) == (not _panels(scheme, each_isa))
    assert np.abs(a - e).max() <= 6e-2 * np.abs(e).max()
    assert np.abs(p - a).max() <= 1e-2 * np.abs(e).max()
    for a, p, e in zip(auto[1:], python[1:], exact[1:]):
        assert np.array_equal(a, e) == (each_isa == "base")
        assert np.abs(a - e).max() <= (0 if each_isa == "base" else 6e-2) * np.abs(e).max()
        assert np.abs(p - a).max() <= 1e-2 * np.abs(e).max()


@pytest.mark.parametrize("scheme", K_QUANTS)
def test_k_quant_rows_take_int8_activations_by_default(scheme, monkeypatch, each_isa):
    """ "auto": a K-quant model's one-row steps take x's first int8 code (formats/kquant_rows.h) and its
    6-token prompt one int8 code per element (formats/kquant_panels.h), in the fused step as in the Python path;
    the 8-bit codes put every step within 6e-2 of the float path on this random model (1e-2 to
    4e-2 on SmolLM2 / a 1B Q4_K_M, where llama.cpp's Q8_K is 3e-2 to 6e-2), the decode rows
    alone too."""
    tf, (auto, python, exact) = three_runs(scheme, monkeypatch)
    # integer rows and prompt panels on every SIMD build (base: none)
    for a, p, e in zip(auto, python, exact):
        assert np.array_equal(a, e) == (each_isa == "base")
        assert np.abs(a - e).max() <= (3e-3 if each_isa == "base" else 6e-2) * np.abs(e).max()
        # the two paths' inputs differ in their last bits, so now and then a code rounds the
        # other way (one code: a step of dx, not dx / 254)
        assert np.abs(p - a).max() <= 1e-2 * np.abs(e).max()
    # one-row steps alone: prompt in float, then decode steps auto vs float
    with monkeypatch.context() as m:
        tf.reset()
        ckernels.set_act_q8(False)
        tf.forward(PROMPT)
        ckernels.set_act_q8("auto")
        cache = [tf.forward([t]) for t in (7, 1, 60)]
        tf.reset()
        ckernels.set_act_q8(False)
        tf.forward(PROMPT)
        ref = [tf.forward([t]) for t in (7, 1, 60)]
        ckernels.set_act_q8("auto")
        del m
    for a, e in zip(cache, ref):
        assert np.abs(a - e).max() <= 6e-2 * np.abs(e).max()


@pytest.mark.parametrize("scheme", ["gguf_q4_k", "gguf_q6_k"])
def test_k_quant_batched_decode_rows_equal_each_alone(scheme, each_isa):
    """Sequences decoded together take the same int8 rows as one decoded alone (a row's numbers
    do not depend on its company); prompts, one sequence's rows, take the int8 panels."""
    from poly.runtime.batch import forward_batch

    tf = random_transformer(tiny_cfg(hidden=256, inter=512), seed=9)
    quantize_all(tf, scheme)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16]]
    steps = [[20, 21, 22], [30, 31, 32], [40, 41, 42]]
    states = [tf.new_state() for _ in prompts]
    for prompt, state in zip(prompts, states):
        forward_batch(tf, [prompt], [state])
    got = [forward_batch(tf, [[s[j]] for s in steps], states) for j in range(3)]  # [3, V] each
    for b, prompt in enumerate(prompts):
        state = tf.new_state()
        forward_batch(tf, [prompt], [state])
        for j in range(3):
            ref = forward_batch(tf, [[steps[b][j]]], [state])[0]
            np.testing.assert_allclose(got[j][b], ref, rtol=0, atol=2e-5 * np.abs(ref).max())


MIXED = {"w_q": "gguf_q4_k", "w_k": "gguf_q4_k", "w_v": "gguf_q8_0", "w_o": "gguf_q6_k"}


def test_an_input_read_by_k_quant_and_pair_rows_gets_both_codes(monkeypatch, each_isa):
    """The auto mode's prep writes x's pairs only where a reader takes them (wants_codes 3 vs 4;
    repacked rows without the pairs would take the float path, never stale codes): a model
    mixing K-quant rows with repacked Q8_0 rows on one input decodes as the Python path does and
    within 6e-2 of the float path."""
    tf = random_transformer(tiny_cfg(hidden=256, inter=512), seed=6)
    quantize_all(tf, "gguf_q4_k", MIXED)  # q/k, o and the FFN K-quants, v Q8_0
    for a, p, e in zip(*_runs(tf, monkeypatch)):
        assert np.abs(a - e).max() <= 6e-2 * np.abs(e).max()
        assert np.abs(p - a).max() <= 1e-2 * np.abs(e).max()

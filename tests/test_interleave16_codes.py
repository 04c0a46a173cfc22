"""x's int8 codes on the rows repacked by 16 (csrc/formats/interleave16.h, formats/interleave16_avx2.h): every build's tile
gives the same bits, exact on a code grid, within two codes' 1e-4 of the float rows (q8 on; Q4_1,
Q8_0 and int8 in the auto mode too) or, the auto mode's Q4_0 and Loom Q4 (il16_x1), exactly the
weights times x's first code, with the offsets on the codes' own sums.
"""

from __future__ import annotations

import numpy as np
import pytest

from poly.runtime import ckernels, fused, repack
from tests.test_ckernels import MAKERS
from tests.test_interleave16 import interleave16_model, needs_interleave16


def _interleave16_builds() -> list[str]:
    """The instruction-set builds here that read the repacked rows (avx2, avx512)."""
    got = []
    for isa in ckernels.isas():
        old = ckernels.use_isa(isa)
        if ckernels.info().get("interleave16"):
            got.append(isa)
        ckernels.use_isa(old)
    return got


def _interleave16_matmul(qt, x, rp, q8=None):
    """The rows' tile: two codes of x with q8 on (the default here), the auto mode's one code
    of x for the Q4 kinds."""
    kind, raw, aux = ckernels.operands(qt)
    out = np.empty((x.shape[0], qt.shape[0]), np.float32)
    q8 = ckernels.Q8_ON if q8 is None else q8
    ckernels.EXT.matmul(kind, x, out, raw, aux, x.shape[0], qt.shape[1], qt.shape[0], q8, rp)
    return out


def _one_code(x):
    """x as the auto mode's Q4 rows read it (csrc/core/activations.h quantize_x's first code): per
    32-block dx = max|x| / 127, codes round(x / dx) in float32, dequantized in float64."""
    b = x.reshape(x.shape[0], -1, 32)  # [n, block, 32]
    d = (np.abs(b).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    h = np.clip(np.rint(b * inv), -127, 127)
    return (h * d.astype(np.float64)).reshape(x.shape)


ONE_CODE = ("gguf_q4_0", "loom_q4")  # the kinds the auto mode reads on x's first code


def _held(qt, scheme: str) -> np.ndarray:
    """The weights as the repacked rows hold them, float64: the stored matrix's, but Loom Q4's
    block scales rounded to float16 (repack._repack_loom: Q4_0's record)."""
    wf = qt.dequantize().astype(np.float64)
    if scheme != "loom_q4":
        return wf
    m, k = qt.shape
    s = np.asarray(ckernels.operands(qt)[2], np.float32).reshape(m, k // 32, 1).astype(np.float64)
    codes = np.rint(wf.reshape(m, k // 32, 32) / np.where(s == 0, 1, s))  # [m, block, 32]
    return (codes * s.astype(np.float16).astype(np.float64)).reshape(m, k)


@needs_interleave16
@pytest.mark.parametrize("mode", ["on", "auto"])
@pytest.mark.parametrize("scheme", ["gguf_q4_0", "gguf_q4_1", "gguf_q8_0", "int8", "loom_q4"])
def test_the_repacked_rows_give_the_same_bits_on_every_build(scheme, mode):
    """The AVX2 tile (maddubs) and the AVX-512 VNNI tile (dpbusd) form the same int32 sums and
    the same float steps per lane: equal bits, for 1, 5 and 11 inputs (each row the same alone
    and in company), within the two codes' error of the float product (q8 on), and in the auto
    mode the Q4 kinds exactly the weights times x's one code (the offsets on the codes' sums)."""
    rng = np.random.default_rng(8)
    qt = MAKERS[scheme](rng.standard_normal((80, 256)).astype(np.float32))
    kind, raw, aux = ckernels.operands(qt)
    rp = repack.interleave16(kind, raw, 80, 256, aux)
    x = ckernels.aligned(rng.standard_normal((11, 256)).astype(np.float32))
    wf = _held(qt, scheme)
    ref = x.astype(np.float64) @ wf.T
    q8 = ckernels.Q8_AUTO if mode == "auto" else ckernels.Q8_ON
    builds = _interleave16_builds()
    got = {}
    for isa in builds:
        old = ckernels.use_isa(isa)
        try:
            got[isa] = [
                _interleave16_matmul(qt, np.ascontiguousarray(x[:n]), rp, q8) for n in (1, 5, 11)
            ]
        finally:
            ckernels.use_isa(old)
    first = got[builds[0]]
    for isa in builds[1:]:
        for a, b in zip(first, got[isa]):
            np.testing.assert_array_equal(b, a)
    np.testing.assert_array_equal(first[1], first[2][:5])
    np.testing.assert_array_equal(first[0], first[2][:1])
    scale = float(np.abs(ref).max())
    err = float(np.abs(first[2] - ref).max())
    if mode == "auto" and scheme in ONE_CODE:
        one = _one_code(x) @ wf.T
        assert float(np.abs(first[2] - one).max()) <= 2e-6 * scale  # float rounding only
        assert 2e-4 * scale < err <= 2e-2 * scale  # x's one code, not two
    else:
        assert 0 < err <= 2e-4 * scale


@needs_interleave16
def test_q8_0_codes_of_minus_128_multiply_exactly(each_isa):
    """-128 is a valid Q8_0 code (llama.cpp's quantizer never writes it; other tools may): the
    AVX2 tile takes |w| as the unsigned side, where -128 reads as 128, so the sums stay exact."""
    if not ckernels.info().get("interleave16"):
        pytest.skip("no repacked rows in this build")
    rng = np.random.default_rng(9)
    qt = MAKERS["gguf_q8_0"](rng.standard_normal((16, 64)).astype(np.float32))
    kind, raw, _ = ckernels.operands(qt)
    blocks = raw.reshape(16, 2, 34)  # [row, block, f16 scale + 32 codes]
    blocks[:, :, 2:] = np.where(rng.random((16, 2, 32)) < 0.5, 0x80, blocks[:, :, 2:])  # -128
    rp = repack.interleave16(kind, raw, 16, 64)
    x = ckernels.aligned(rng.standard_normal((3, 64)).astype(np.float32))
    ref = x @ qt.dequantize().T
    got = _interleave16_matmul(qt, x, rp)
    assert float(np.abs(got - ref).max()) <= 2e-4 * float(np.abs(ref).max())


def _on_grid(rng, n, k):
    """x whose int8 rounding is exact: integer codes (one 127 per block) times a power of two,
    so a product on x's codes is the float product's."""
    c = rng.integers(-127, 128, (n, k // 32, 32))
    c[:, :, 5] = 127
    return (c * 2.0**-5).astype(np.float32).reshape(n, k)


@pytest.mark.parametrize("scheme", ["gguf_q4_0", "gguf_q4_1", "gguf_q8_0", "int8", "loom_q4"])
def test_many_inputs_on_the_repacked_rows_are_exact_on_x_codes(scheme, each_isa):
    """The repacked rows for 5 and 20 inputs (8-lane builds: the prompt tile il16p_tile of
    csrc/formats/interleave16_avx2.h, for gemm and the Python rows alike): exact when x's codes are (a code
    grid), otherwise within the two codes' 1e-4 (Q8_0, int8) or, Q4 kinds, the weights times x's
    one code, and row 0 the same as alone."""
    if not ckernels.info().get("interleave16"):
        pytest.skip("no repacked rows in this build")
    rng = np.random.default_rng(12)
    m, k = 80, 256
    qt = MAKERS[scheme](rng.standard_normal((m, k)).astype(np.float32))
    kind, raw, aux = ckernels.operands(qt)
    rp = repack.interleave16(kind, raw, m, k, aux)
    wf = _held(qt, scheme)
    # past 16 rows SIMD builds keep the repacked rows (info()["interleave16_panels"]: 8 lanes'
    # prompt tile, AVX-512's by blocks)
    for n in (5, 20) if ckernels.info().get("interleave16_panels") else (5,):
        for grid in (True, False):
            x = _on_grid(rng, n, k) if grid else rng.standard_normal((n, k)).astype(np.float32)
            ref = x.astype(np.float64) @ wf.T
            out = np.empty((n, m), np.float32)
            args = (kind, ckernels.aligned(x), out, raw, aux, n, k, m)
            if n <= ckernels.MAX_N:
                ckernels.EXT.matmul(*args, ckernels.Q8_AUTO, rp)
            else:
                ckernels.EXT.gemm(*args, 0, ckernels.Q8_AUTO, rp)
            err = float(np.abs(out - ref).max()) / float(np.abs(ref).max())
            if grid:  # a code grid: one code or two, the float product
                assert err <= 1e-6
                continue
            if scheme in ONE_CODE:  # the weights times x's one code, farther from the float rows
                one = _one_code(x) @ wf.T
                assert float(np.abs(out - one).max()) <= 2e-6 * float(np.abs(one).max())
                assert 2e-4 < err <= 2e-2
            else:
                assert 1e-7 < err <= 2e-4  # x's two codes, not the float rows
            alone = np.empty((1, m), np.float32)
            ckernels.EXT.matmul(
                kind, ckernels.aligned(x[:1]), alone, raw, aux, 1, k, m, ckernels.Q8_AUTO, rp
            )
            np.testing.assert_array_equal(out[:1], alone)
    assert fused.rows_alike(
        interleave16_model(scheme)
    )  # a prompt's rows are the same alone and in company


@needs_interleave16
def test_the_python_rows_read_the_repacked_copy():
    """`ckernels.kernel` below GEMM_ROWS rows: the repacked rows on x's codes, as the fused step
    (the stored rows' pages may be released); the float rows when q8 is off."""
    rng = np.random.default_rng(10)
    qt = MAKERS["gguf_q4_1"](rng.standard_normal((48, 96)).astype(np.float32))
    x = rng.standard_normal((3, 96)).astype(np.float32)
    kind, raw, _ = ckernels.operands(qt)
    qt.repacked16 = repack.interleave16(kind, raw, 48, 96)
    got = np.empty((3, 48), np.float32)
    ckernels.kernel(qt, x, got)
    np.testing.assert_array_equal(
        got, _interleave16_matmul(qt, ckernels.aligned(x), qt.repacked16, ckernels.Q8_AUTO)
    )
    ckernels.set_act_q8(False)
    try:
        ckernels.kernel(qt, x, got)
    finally:
        ckernels.set_act_q8("auto")
    ref = np.empty_like(got)
    ckernels.EXT.matmul(kind, ckernels.aligned(x), ref, raw, None, 3, 96, 48, 0)
    np.testing.assert_array_equal(got, ref)

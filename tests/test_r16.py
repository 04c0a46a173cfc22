"""GGUF Q4_0/Q4_1/Q8_0 and int8 (.entity q8) rows repacked by 16 (csrc/pk_r16.h): the layout against the stored blocks,
the kernel against the float rows, and a sequence's logits the same decoded alone and batched.

The repacked rows are the fused step's path on the SIMD builds (AVX-512 VNNI, and the 8-lane
tile of csrc/pk_r16_avx2.h elsewhere; the default "auto" q8 mode); on the portable build
`repack16` returns None and only the layout tests run.
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from poly.runtime import ckernels, fused, repack
from poly.runtime.batch import forward_batch
from tests.test_ckernels import MAKERS
from tests.test_fused import quantize_all, tiny_cfg
from tests.tiny_model import random_transformer

R16 = ckernels.AVAILABLE and bool(ckernels.info().get("r16"))
needs_r16 = pytest.mark.skipif(not R16, reason="the repacked rows need a SIMD build")


@pytest.mark.parametrize("scheme", ["gguf_q4_0", "gguf_q4_1"])
def test_repacked_record_holds_each_rows_scales_and_codes(scheme, monkeypatch):
    """Decode the repacked bytes in numpy: row 16 g + r, block b = D * c + M, equal to the
    stored matrix's own dequantization (so the layout, not only the kernel, is checked)."""
    rng = np.random.default_rng(4)
    qt = MAKERS[scheme](rng.standard_normal((48, 96)).astype(np.float32))
    kind, raw, _ = ckernels.operands(qt)
    monkeypatch.setattr(ckernels, "EXT", _FakeExt(ckernels.EXT))  # the layout on every build
    rp = repack.repack16(kind, raw, 48, 96)
    assert rp.shape == (3, 3, repack.R16_REC)  # [groups, blocks, record]
    d = rp[..., 0:32].copy().view(np.float16).astype(np.float32)  # [g, b, 16]
    mn = rp[..., 32:64].copy().view(np.float16).astype(np.float32)
    v = rp[..., 64:].reshape(3, 3, 4, 16, 4)  # [g, b, q, row, i]
    lo, hi = v & 15, v >> 4  # elements 4 q + i and 16 + 4 q + i
    codes = np.concatenate([lo.transpose(0, 3, 1, 2, 4), hi.transpose(0, 3, 1, 2, 4)], axis=3)
    codes = codes.reshape(3, 16, 3, 32).astype(np.float32)  # [g, row, b, element]
    got = codes * d.transpose(0, 2, 1)[..., None] + mn.transpose(0, 2, 1)[..., None]
    np.testing.assert_array_equal(got.reshape(48, 96), qt.dequantize())


class _FakeExt:
    """The build's module with r16 reported on (the layout is plain numpy)."""

    def __init__(self, ext):
        self._ext = ext

    def info(self):
        return {**self._ext.info(), "r16": 1}

    def __getattr__(self, name):
        return getattr(self._ext, name)


def test_release_mapped_keeps_the_bytes(tmp_path):
    path = tmp_path / "w.bin"
    data = np.arange(3 * mmap.PAGESIZE, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    view = mm[100:-100]
    assert int(view.sum()) > 0  # touched
    repack.release_mapped(view)
    np.testing.assert_array_equal(view, data[100:-100])  # read back from the page cache
    repack.release_mapped(np.zeros(10))  # not a mapping: nothing to do


def _model(scheme: str, seed: int = 11):
    tf = random_transformer(tiny_cfg(hidden=64, inter=96), seed=seed)
    if scheme != "float32":
        quantize_all(tf, scheme)
    return tf


def decode_steps(tf, prompts, steps):
    """Each prompt prefilled alone, then the decode steps of all of them as one batch."""
    states = [tf.new_state() for _ in prompts]
    for p, st in zip(prompts, states):
        forward_batch(tf, [p], [st])
    return [forward_batch(tf, [[s[j]] for s in steps], states) for j in range(len(steps[0]))]


@needs_r16
@pytest.mark.parametrize("scheme", ["gguf_q4_0", "gguf_q4_1"])
def test_repacked_rows_stay_close_to_the_float_rows(scheme, float_path):
    tf = _model(scheme)
    p = fused.plan(tf)
    assert len(p.layers[0][10]) == 7, "the O projection was not repacked"
    prompts, steps = [[1, 2, 3], [4, 5]], [[20, 21], [30, 31]]
    ref = decode_steps(tf, prompts, steps)  # float rows (float_path)
    ckernels.set_act_q8("auto")
    got = decode_steps(tf, prompts, steps)
    for r, g in zip(ref, got):
        scale = float(np.abs(r).max())
        err = float(np.abs(g - r).max())
        assert 0 < err <= 2e-4 * scale  # int8 codes of x: close, and not the float rows


@needs_r16
@pytest.mark.parametrize("scheme", ["gguf_q4_1", "gguf_q8_0", "int8", "loom_q4"])
def test_a_sequence_decodes_the_same_alone_and_batched(scheme):
    """Bit for bit, in the default mode: one sequence's logits alone, and as row 0 of batches
    of 2, 5 and 9 rows (the server's promise: concurrent greedy output equals solo). The LM head
    quantized too (Q8_0, 120 rows: not repacked, the tiles' sums): a float32 head keeps
    `dense_dot`'s four chains for one input, which differ from a batch's in the last bits."""
    tf = _model(scheme)
    tf.lm_head = MAKERS["gguf_q8_0"](np.ascontiguousarray(tf.lm_head, dtype=np.float32))
    prompt, toks = [5, 6, 7], [40, 41, 42]
    alone = decode_steps(tf, [prompt], [toks])
    for n in (2, 5, 9):
        others = [[1 + i, 2 + i] for i in range(n - 1)]
        got = decode_steps(tf, [prompt, *others], [toks, *[[50 + i] * 3 for i in range(n - 1)]])
        for a, g in zip(alone, got):
            np.testing.assert_array_equal(g[0], a[0])


@needs_r16
def test_a_prompts_gemm_reads_the_repacked_copy_bit_for_bit(monkeypatch, float_path):
    """Prompts past 16 rows run the float GEMM (q8 off; in the auto mode SIMD builds take the
    repacked rows below), which dequantizes the repacked copy (the stored rows stay released):
    the same logits as from the stored rows."""
    prompt = list(range(1, 25))
    tf = _model("gguf_q4_1")
    assert len(fused.plan(tf).layers[0][10]) == 7
    got = tf.forward(prompt)
    monkeypatch.setattr(repack, "repack16", lambda *a: None)
    ref_model = _model("gguf_q4_1")  # the same weights, no copy: the stored rows
    assert len(fused.plan(ref_model).layers[0][10]) == 6
    np.testing.assert_array_equal(got, ref_model.forward(prompt))


@needs_r16
@pytest.mark.parametrize("scheme", ["gguf_q4_0", "int8", "loom_q4"])
def test_the_python_gemm_reads_the_repacked_copy_bit_for_bit(scheme, float_path):
    rng = np.random.default_rng(5)
    qt = MAKERS[scheme](rng.standard_normal((48, 96)).astype(np.float32))
    x = rng.standard_normal((20, 96)).astype(np.float32)  # 20 rows: the GEMM
    ref = np.empty((20, 48), np.float32)
    ckernels.kernel(qt, x, ref)  # the stored rows
    kind, raw, aux = ckernels.operands(qt)
    qt.r16 = repack.repack16(kind, raw, 48, 96, aux)
    got = np.empty_like(ref)
    ckernels.kernel(qt, x, got)
    np.testing.assert_array_equal(got, ref)
    qt.r16 = np.zeros_like(qt.r16)  # and the copy is what it reads
    ckernels.kernel(qt, x, got)
    assert not np.array_equal(got, ref)


def test_repacked_q8_0_record_holds_scales_code_sums_and_codes(monkeypatch):
    rng = np.random.default_rng(6)
    qt = MAKERS["gguf_q8_0"](rng.standard_normal((32, 64)).astype(np.float32))
    kind, raw, _ = ckernels.operands(qt)
    monkeypatch.setattr(ckernels, "EXT", _FakeExt(ckernels.EXT))
    rp = repack.repack16(kind, raw, 32, 64)
    assert rp.shape == (2, 2, 576)  # [groups, blocks, D + S + 8 x 64 codes]
    d = rp[..., 0:32].copy().view(np.float16).astype(np.float32)  # [g, b, 16]
    s = rp[..., 32:64].copy().view(np.int16)
    codes = rp[..., 64:].copy().view(np.int8).reshape(2, 2, 8, 16, 4)  # [g, b, q, row, i]
    codes = codes.transpose(0, 3, 1, 2, 4).reshape(2, 16, 2, 32)  # [g, row, b, element]
    np.testing.assert_array_equal(codes.sum(axis=-1, dtype=np.int16), s.transpose(0, 2, 1))
    got = codes.astype(np.float32) * d.transpose(0, 2, 1)[..., None]
    np.testing.assert_array_equal(got.reshape(32, 64), qt.dequantize())


def test_repacked_int8_record_holds_code_sums_and_codes(monkeypatch):
    """.entity q8 rows (int8 codes, a float32 scale per row): S[16] then the codes as Q8_0's
    record lays them out; the row scales stay where they are (the tile applies them last)."""
    rng = np.random.default_rng(7)
    qt = MAKERS["int8"](rng.standard_normal((32, 64)).astype(np.float32))
    kind, codes, scales = ckernels.operands(qt)
    monkeypatch.setattr(ckernels, "EXT", _FakeExt(ckernels.EXT))
    rp = repack.repack16(kind, codes, 32, 64)
    assert rp.shape == (2, 2, repack.R16_REC_I8)  # [groups, blocks, S + 8 x 64 codes]
    s = rp[..., 0:32].copy().view(np.int16)  # [g, b, 16]
    got = rp[..., 32:].copy().view(np.int8).reshape(2, 2, 8, 16, 4)  # [g, b, q, row, i]
    got = got.transpose(0, 3, 1, 2, 4).reshape(32, 64)  # [row, element]
    np.testing.assert_array_equal(got, codes)
    sums = codes.reshape(2, 16, 2, 32).sum(axis=-1).transpose(0, 2, 1)  # [g, b, row]
    np.testing.assert_array_equal(s, sums)
    np.testing.assert_array_equal(got * scales[:, None], qt.dequantize())


def _r16_builds() -> list[str]:
    """The instruction-set builds here that read the repacked rows (avx2, avx512)."""
    got = []
    for isa in ckernels.isas():
        old = ckernels.use_isa(isa)
        if ckernels.info().get("r16"):
            got.append(isa)
        ckernels.use_isa(old)
    return got


def _r16_matmul(qt, x, rp):
    """The rows' tile (two codes of x, q8 on: the auto mode's prompts may take another)."""
    kind, raw, aux = ckernels.operands(qt)
    out = np.empty((x.shape[0], qt.shape[0]), np.float32)
    ckernels.EXT.matmul(
        kind, x, out, raw, aux, x.shape[0], qt.shape[1], qt.shape[0], ckernels.Q8_ON, rp
    )
    return out


@needs_r16
@pytest.mark.parametrize("scheme", ["gguf_q4_0", "gguf_q4_1", "gguf_q8_0", "int8", "loom_q4"])
def test_the_repacked_rows_give_the_same_bits_on_every_build(scheme):
    """The AVX2 tile (maddubs) and the AVX-512 VNNI tile (dpbusd) form the same int32 sums and
    the same float steps per lane: equal bits, for 1, 5 and 11 inputs (each row the same alone
    and in company), and within the int8 codes' error of the float product."""
    rng = np.random.default_rng(8)
    qt = MAKERS[scheme](rng.standard_normal((80, 256)).astype(np.float32))
    kind, raw, aux = ckernels.operands(qt)
    rp = repack.repack16(kind, raw, 80, 256, aux)
    x = ckernels.aligned(rng.standard_normal((11, 256)).astype(np.float32))
    ref = x @ qt.dequantize().T
    builds = _r16_builds()
    got = {}
    for isa in builds:
        old = ckernels.use_isa(isa)
        try:
            got[isa] = [_r16_matmul(qt, np.ascontiguousarray(x[:n]), rp) for n in (1, 5, 11)]
        finally:
            ckernels.use_isa(old)
    first = got[builds[0]]
    for isa in builds[1:]:
        for a, b in zip(first, got[isa]):
            np.testing.assert_array_equal(b, a)
    np.testing.assert_array_equal(first[1], first[2][:5])
    np.testing.assert_array_equal(first[0], first[2][:1])
    err = float(np.abs(first[2] - ref).max())
    assert 0 < err <= 2e-4 * float(np.abs(ref).max())


@needs_r16
def test_q8_0_codes_of_minus_128_multiply_exactly(each_isa):
    """-128 is a valid Q8_0 code (llama.cpp's quantizer never writes it; other tools may): the
    AVX2 tile takes |w| as the unsigned side, where -128 reads as 128, so the sums stay exact."""
    if not ckernels.info().get("r16"):
        pytest.skip("no repacked rows in this build")
    rng = np.random.default_rng(9)
    qt = MAKERS["gguf_q8_0"](rng.standard_normal((16, 64)).astype(np.float32))
    kind, raw, _ = ckernels.operands(qt)
    blocks = raw.reshape(16, 2, 34)  # [row, block, f16 scale + 32 codes]
    blocks[:, :, 2:] = np.where(rng.random((16, 2, 32)) < 0.5, 0x80, blocks[:, :, 2:])  # -128
    rp = repack.repack16(kind, raw, 16, 64)
    x = ckernels.aligned(rng.standard_normal((3, 64)).astype(np.float32))
    ref = x @ qt.dequantize().T
    got = _r16_matmul(qt, x, rp)
    assert float(np.abs(got - ref).max()) <= 2e-4 * float(np.abs(ref).max())


@needs_r16
def test_the_python_rows_read_the_repacked_copy():
    """`ckernels.kernel` below GEMM_ROWS rows: the repacked rows on x's codes, as the fused step
    (the stored rows' pages may be released); the float rows when q8 is off."""
    rng = np.random.default_rng(10)
    qt = MAKERS["gguf_q4_1"](rng.standard_normal((48, 96)).astype(np.float32))
    x = rng.standard_normal((3, 96)).astype(np.float32)
    kind, raw, _ = ckernels.operands(qt)
    qt.r16 = repack.repack16(kind, raw, 48, 96)
    got = np.empty((3, 48), np.float32)
    ckernels.kernel(qt, x, got)
    np.testing.assert_array_equal(got, _r16_matmul(qt, ckernels.aligned(x), qt.r16))
    ckernels.set_act_q8(False)
    try:
        ckernels.kernel(qt, x, got)
    finally:
        ckernels.set_act_q8("auto")
    ref = np.empty_like(got)
    ckernels.EXT.matmul(kind, ckernels.aligned(x), ref, raw, None, 3, 96, 48, 0)
    np.testing.assert_array_equal(got, ref)


def _float_rows(fn, *args):
    """fn(*args) on the exact float paths (int8 codes of x off), the auto mode back after."""
    ckernels.set_act_q8(False)
    try:
        return fn(*args)
    finally:
        ckernels.set_act_q8("auto")


def _on_grid(rng, n, k):
    """x whose int8 rounding is exact: integer codes (one 127 per block) times a power of two,
    so a product on x's codes is the float product's."""
    c = rng.integers(-127, 128, (n, k // 32, 32))
    c[:, :, 5] = 127
    return (c * 2.0**-5).astype(np.float32).reshape(n, k)


@pytest.mark.parametrize("scheme", ["gguf_q4_0", "gguf_q4_1", "gguf_q8_0", "int8", "loom_q4"])
def test_many_inputs_on_the_repacked_rows_are_exact_on_x_codes(scheme, each_isa):
    """The repacked rows for 5 and 20 inputs (8-lane builds: the prompt tile r16p of
    csrc/pk_r16_avx2.h, for gemm and the Python rows alike): exact when x's codes are (a code
    grid), within the two codes' 1e-4 otherwise, and row 0 the same as alone."""
    if not ckernels.info().get("r16"):
        pytest.skip("no repacked rows in this build")
    rng = np.random.default_rng(12)
    m, k = 80, 256
    qt = MAKERS[scheme](rng.standard_normal((m, k)).astype(np.float32))
    kind, raw, aux = ckernels.operands(qt)
    rp = repack.repack16(kind, raw, m, k, aux)
    wf = qt.dequantize().astype(np.float64)
    # past 16 rows SIMD builds keep the repacked rows (r16p: 8 lanes' prompt tile, AVX-512's by blocks)
    for n in (5, 20) if ckernels.info().get("r16p") else (5,):
        for x, tol in (
            (_on_grid(rng, n, k), 1e-6),
            (rng.standard_normal((n, k)).astype(np.float32), 2e-4),
        ):
            ref = x.astype(np.float64) @ wf.T
            out = np.empty((n, m), np.float32)
            args = (kind, ckernels.aligned(x), out, raw, aux, n, k, m)
            if n <= ckernels.MAX_N:
                ckernels.EXT.matmul(*args, ckernels.Q8_AUTO, rp)
            else:
                ckernels.EXT.gemm(*args, 0, ckernels.Q8_AUTO, rp)
            err = float(np.abs(out - ref).max()) / float(np.abs(ref).max())
            assert err <= tol
            if tol > 1e-6:
                assert err > 1e-7  # x's codes, not the float rows
                alone = np.empty((1, m), np.float32)
                ckernels.EXT.matmul(
                    kind, ckernels.aligned(x[:1]), alone, raw, aux, 1, k, m, ckernels.Q8_AUTO, rp
                )
                np.testing.assert_array_equal(out[:1], alone)
    assert fused.rows_alike(_model(scheme))  # a prompt's rows are the same alone and in company


@needs_r16
def test_a_fused_prompt_stays_within_its_codes_error(each_isa):
    """A 12-token prompt through the fused step, auto mode: the repacked rows on x's two codes
    (1e-4 of the float path), the same numbers run twice."""
    if not ckernels.info().get("r16"):
        pytest.skip("no repacked rows in this build")
    tf = _model("gguf_q4_1")
    prompt = list(range(3, 15))  # 12 rows: the prompt tile on 8 lanes (the gemm from 9 there)

    def run():
        return forward_batch(tf, [prompt], [tf.new_state()])

    fused_logits = run()
    np.testing.assert_array_equal(run(), fused_logits)
    exact = _float_rows(run)
    err = float(np.abs(fused_logits - exact).max()) / float(np.abs(exact).max())
    assert 0 < err <= 2e-4


@needs_r16
def test_loom_q4_rows_are_repacked_and_take_x_codes(each_isa):
    """.entity q4 (Loom Q4) matrices are repacked like Q4_0 (float32 scales): decode and prompt
    rows on x's two int8 codes (within 2e-4 of the float rows, not equal), a sequence's logits
    the same alone and batched, and a prompt's rows alike alone and in company."""
    if not ckernels.info().get("r16"):
        pytest.skip("no repacked rows in this build")
    tf = _model("loom_q4")  # a quantized head too: a float32 one differs alone in the last bits
    tf.lm_head = MAKERS["gguf_q8_0"](np.ascontiguousarray(tf.lm_head, dtype=np.float32))
    assert len(fused.plan(tf).layers[0][10]) == 7, "the O projection was not repacked"
    prompts, steps = [[1, 2, 3], [4, 5]], [[20, 21], [30, 31]]
    got = decode_steps(tf, prompts, steps)
    ref = _float_rows(decode_steps, tf, prompts, steps)
    for r, g in zip(ref, got):
        err = float(np.abs(g - r).max())
        assert 0 < err <= 2e-4 * float(np.abs(r).max())
    alone = decode_steps(tf, [prompts[0]], [steps[0]])
    for a, g in zip(alone, got):
        np.testing.assert_array_equal(g[0], a[0])
    assert fused.rows_alike(tf)


def test_repacked_loom_record_holds_float32_scales_and_q4_0_codes(monkeypatch):
    rng = np.random.default_rng(3)
    qt = MAKERS["loom_q4"](rng.standard_normal((32, 64)).astype(np.float32))
    kind, packed, scales = ckernels.operands(qt)
    monkeypatch.setattr(ckernels, "EXT", _FakeExt(ckernels.EXT))
    rp = repack.repack16(kind, packed, 32, 64, scales)
    assert rp.shape == (2, 2, repack.R16_REC)
    d = rp[..., 0:64].copy().view(np.float32)  # [g, b, 16]
    v = rp[..., 64:].reshape(2, 2, 4, 16, 4)  # [g, b, q, row, i]
    lo, hi = v & 15, v >> 4  # elements 4 q + i and 16 + 4 q + i, as code + 8
    codes = np.concatenate([lo.transpose(0, 3, 1, 2, 4), hi.transpose(0, 3, 1, 2, 4)], axis=3)
    codes = codes.reshape(2, 16, 2, 32).astype(np.float32) - 8.0  # [g, row, b, element]
    got = codes * d.transpose(0, 2, 1)[..., None]
    np.testing.assert_array_equal(got.reshape(32, 64), qt.dequantize())

"""GGUF Q4_0/Q4_1/Q8_0 and int8 (.entity q8) rows repacked by 16 (csrc/formats/interleave16.h): the layout against the stored blocks,
the kernel against the float rows, and a sequence's logits the same decoded alone and batched.

The repacked rows are the fused step's path on the SIMD builds (AVX-512 VNNI, and the 8-lane
tile of csrc/formats/interleave16_avx2.h elsewhere; the default "auto" q8 mode); on the portable build
`interleave16` returns None and only the layout tests run.
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

INTERLEAVE16 = ckernels.AVAILABLE and bool(ckernels.info().get("interleave16"))
needs_interleave16 = pytest.mark.skipif(
    not INTERLEAVE16, reason="the repacked rows need a SIMD build"
)


@pytest.mark.parametrize("scheme", ["gguf_q4_0", "gguf_q4_1"])
def test_repacked_record_holds_each_rows_scales_and_codes(scheme, monkeypatch):
    """Decode the repacked bytes in numpy: row 16 g + r, block b = D * c + M (Q4_0: no M
    stored, M = -8 D), equal to the stored matrix's own dequantization (so the layout, not only
    the kernel, is checked)."""
    rng = np.random.default_rng(4)
    qt = MAKERS[scheme](rng.standard_normal((48, 96)).astype(np.float32))
    kind, raw, _ = ckernels.operands(qt)
    monkeypatch.setattr(ckernels, "EXT", _FakeExt(ckernels.EXT))  # the layout on every build
    rp = repack.interleave16(kind, raw, 48, 96)
    q4_1 = scheme == "gguf_q4_1"
    assert rp.shape == (
        3,
        3,
        repack.INTERLEAVE16_REC if q4_1 else repack.INTERLEAVE16_REC4,
    )  # [groups, blocks, record]
    assert (repack.INTERLEAVE16_REC, repack.INTERLEAVE16_REC4) == (
        320,
        288,
    )  # the stored sizes of 16 rows' blocks
    d = rp[..., 0:32].copy().view(np.float16).astype(np.float32)  # [g, b, 16]
    mn = rp[..., 32:64].copy().view(np.float16).astype(np.float32) if q4_1 else -8.0 * d
    co = 64 if q4_1 else 32  # where the code vectors start
    v = rp[..., co:].reshape(3, 3, 4, 16, 4)  # [g, b, q, row, i]
    lo, hi = v & 15, v >> 4  # elements 4 q + i and 16 + 4 q + i
    codes = np.concatenate([lo.transpose(0, 3, 1, 2, 4), hi.transpose(0, 3, 1, 2, 4)], axis=3)
    codes = codes.reshape(3, 16, 3, 32).astype(np.float32)  # [g, row, b, element]
    got = codes * d.transpose(0, 2, 1)[..., None] + mn.transpose(0, 2, 1)[..., None]
    np.testing.assert_array_equal(got.reshape(48, 96), qt.dequantize())


class _FakeExt:
    """The build's module with interleave16 reported on (the layout is plain numpy)."""

    def __init__(self, ext):
        self._ext = ext

    def info(self):
        return {**self._ext.info(), "interleave16": 1}

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


def interleave16_model(scheme: str, seed: int = 11):
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


@needs_interleave16
@pytest.mark.parametrize("scheme", ["gguf_q4_0", "gguf_q4_1"])
def test_repacked_rows_stay_close_to_the_float_rows(scheme, float_path):
    tf = interleave16_model(scheme)
    p = fused.plan(tf)
    assert len(p.layers[0][10]) == 7, "the O projection was not repacked"
    prompts, steps = [[1, 2, 3], [4, 5]], [[20, 21], [30, 31]]
    ref = decode_steps(tf, prompts, steps)  # float rows (float_path)
    ckernels.set_act_q8(True)
    two = decode_steps(tf, prompts, steps)
    ckernels.set_act_q8("auto")
    got = decode_steps(tf, prompts, steps)
    for r, t, g in zip(ref, two, got):
        scale = float(np.abs(r).max())
        assert 0 < float(np.abs(t - r).max()) <= 2e-4 * scale  # two int8 codes of x: close
        err = float(np.abs(g - r).max())
        if scheme == "gguf_q4_0":  # the auto mode's one code (~1/254 a block): 10x farther
            assert 2e-3 * scale < err <= 2e-2 * scale
        else:
            np.testing.assert_array_equal(g, t)  # Q4_1 keeps both codes in the auto mode


@needs_interleave16
@pytest.mark.parametrize("scheme", ["gguf_q4_1", "gguf_q8_0", "int8", "loom_q4"])
def test_a_sequence_decodes_the_same_alone_and_batched(scheme):
    """Bit for bit, in the default mode: one sequence's logits alone, and as row 0 of batches
    of 2, 5 and 9 rows (the server's promise: concurrent greedy output equals solo). The LM head
    quantized too (Q8_0, 120 rows: not repacked, the tiles' sums): a float32 head keeps
    `dense_dot`'s four chains for one input, which differ from a batch's in the last bits."""
    tf = interleave16_model(scheme)
    tf.lm_head = MAKERS["gguf_q8_0"](np.ascontiguousarray(tf.lm_head, dtype=np.float32))
    prompt, toks = [5, 6, 7], [40, 41, 42]
    alone = decode_steps(tf, [prompt], [toks])
    for n in (2, 5, 9):
        others = [[1 + i, 2 + i] for i in range(n - 1)]
        got = decode_steps(tf, [prompt, *others], [toks, *[[50 + i] * 3 for i in range(n - 1)]])
        for a, g in zip(alone, got):
            np.testing.assert_array_equal(g[0], a[0])


@needs_interleave16
def test_a_prompts_gemm_reads_the_repacked_copy_bit_for_bit(monkeypatch, float_path):
    """Prompts past 16 rows run the float GEMM (q8 off; in the auto mode SIMD builds take the
    repacked rows below), which dequantizes the repacked copy (the stored rows stay released):
    the same logits as from the stored rows."""
    prompt = list(range(1, 25))
    tf = interleave16_model("gguf_q4_1")
    assert len(fused.plan(tf).layers[0][10]) == 7
    got = tf.forward(prompt)
    monkeypatch.setattr(repack, "interleave16", lambda *a: None)
    ref_model = interleave16_model("gguf_q4_1")  # the same weights, no copy: the stored rows
    assert len(fused.plan(ref_model).layers[0][10]) == 6
    np.testing.assert_array_equal(got, ref_model.forward(prompt))


@needs_interleave16
@pytest.mark.parametrize("scheme", ["gguf_q4_0", "int8", "loom_q4"])
def test_the_python_gemm_reads_the_repacked_copy_bit_for_bit(scheme, float_path):
    rng = np.random.default_rng(5)
    qt = MAKERS[scheme](rng.standard_normal((48, 96)).astype(np.float32))
    x = rng.standard_normal((20, 96)).astype(np.float32)  # 20 rows: the GEMM
    ref = np.empty((20, 48), np.float32)
    ckernels.kernel(qt, x, ref)  # the stored rows
    kind, raw, aux = ckernels.operands(qt)
    qt.repacked16 = repack.interleave16(kind, raw, 48, 96, aux)
    got = np.empty_like(ref)
    ckernels.kernel(qt, x, got)
    np.testing.assert_array_equal(got, ref)
    qt.repacked16 = np.zeros_like(qt.repacked16)  # and the copy is what it reads
    ckernels.kernel(qt, x, got)
    assert not np.array_equal(got, ref)


def test_repacked_q8_0_record_holds_scales_and_codes(monkeypatch):
    rng = np.random.default_rng(6)
    qt = MAKERS["gguf_q8_0"](rng.standard_normal((32, 64)).astype(np.float32))
    kind, raw, _ = ckernels.operands(qt)
    monkeypatch.setattr(ckernels, "EXT", _FakeExt(ckernels.EXT))
    rp = repack.interleave16(kind, raw, 32, 64)
    assert rp.shape == (2, 2, 544)  # [groups, blocks, D + 8 x 64 codes]: the stored 16 x 34
    d = rp[..., 0:32].copy().view(np.float16).astype(np.float32)  # [g, b, 16]
    codes = rp[..., 32:].copy().view(np.int8).reshape(2, 2, 8, 16, 4)  # [g, b, q, row, i]
    codes = codes.transpose(0, 3, 1, 2, 4).reshape(2, 16, 2, 32)  # [g, row, b, element]
    got = codes.astype(np.float32) * d.transpose(0, 2, 1)[..., None]
    np.testing.assert_array_equal(got.reshape(32, 64), qt.dequantize())


def test_repacked_int8_record_holds_the_codes(monkeypatch):
    """.entity q8 rows (int8 codes, a float32 scale per row): the codes as Q8_0's record lays
    them out; the row scales stay where they are (the tile applies them last)."""
    rng = np.random.default_rng(7)
    qt = MAKERS["int8"](rng.standard_normal((32, 64)).astype(np.float32))
    kind, codes, scales = ckernels.operands(qt)
    monkeypatch.setattr(ckernels, "EXT", _FakeExt(ckernels.EXT))
    rp = repack.interleave16(kind, codes, 32, 64)
    assert rp.shape == (2, 2, 512)  # [groups, blocks, 8 x 64 codes]
    got = rp.copy().view(np.int8).reshape(2, 2, 8, 16, 4)  # [g, b, q, row, i]
    got = got.transpose(0, 3, 1, 2, 4).reshape(32, 64)  # [row, element]
    np.testing.assert_array_equal(got, codes)
    np.testing.assert_array_equal(got * scales[:, None], qt.dequantize())


def _float_rows(fn, *args):
    """fn(*args) on the exact float paths (int8 codes of x off), the auto mode back after."""
    ckernels.set_act_q8(False)
    try:
        return fn(*args)
    finally:
        ckernels.set_act_q8("auto")


@needs_interleave16
def test_a_fused_prompt_stays_within_its_codes_error(each_isa):
    """A 12-token prompt through the fused step, auto mode: the repacked rows on x's two codes
    (1e-4 of the float path), the same numbers run twice."""
    if not ckernels.info().get("interleave16"):
        pytest.skip("no repacked rows in this build")
    tf = interleave16_model("gguf_q4_1")
    prompt = list(range(3, 15))  # 12 rows: the prompt tile on 8 lanes (the gemm from 9 there)

    def run():
        return forward_batch(tf, [prompt], [tf.new_state()])

    fused_logits = run()
    np.testing.assert_array_equal(run(), fused_logits)
    exact = _float_rows(run)
    err = float(np.abs(fused_logits - exact).max()) / float(np.abs(exact).max())
    assert 0 < err <= 2e-4


@needs_interleave16
def test_loom_q4_rows_are_repacked_and_take_x_codes(each_isa):
    """.entity q4 (Loom Q4) matrices are repacked as Q4_0 (the block scales rounded to float16):
    decode and prompt rows on x's int8 codes (q8 on, two codes: within 6e-4 of the float rows,
    the scales' rounding, 2^-12 relative at most, above x's codes' 1e-5; the auto mode, one code
    as Q4_0: within 2e-2, not equal), a sequence's logits the same alone and batched, and a
    prompt's rows alike alone and in company."""
    if not ckernels.info().get("interleave16"):
        pytest.skip("no repacked rows in this build")
    tf = interleave16_model(
        "loom_q4"
    )  # a quantized head too: a float32 one differs alone in the last bits
    tf.lm_head = MAKERS["gguf_q8_0"](np.ascontiguousarray(tf.lm_head, dtype=np.float32))
    assert len(fused.plan(tf).layers[0][10]) == 7, "the O projection was not repacked"
    prompts, steps = [[1, 2, 3], [4, 5]], [[20, 21], [30, 31]]
    got = decode_steps(tf, prompts, steps)
    ref = _float_rows(decode_steps, tf, prompts, steps)
    ckernels.set_act_q8(True)
    try:
        two = decode_steps(tf, prompts, steps)
    finally:
        ckernels.set_act_q8("auto")
    for r, t, g in zip(ref, two, got):
        scale = float(np.abs(r).max())
        assert 0 < float(np.abs(t - r).max()) <= 6e-4 * scale
        assert 2e-3 * scale < float(np.abs(g - r).max()) <= 2e-2 * scale
    alone = decode_steps(tf, [prompts[0]], [steps[0]])
    for a, g in zip(alone, got):
        np.testing.assert_array_equal(g[0], a[0])
    assert fused.rows_alike(tf)


def test_repacked_loom_record_holds_float16_scales_and_q4_0_codes(monkeypatch):
    """Q4_0's record: the block scales rounded to float16, the codes exact (the stored matrix's
    dequantization with its scales so rounded)."""
    rng = np.random.default_rng(3)
    qt = MAKERS["loom_q4"](rng.standard_normal((32, 64)).astype(np.float32))
    kind, packed, scales = ckernels.operands(qt)
    monkeypatch.setattr(ckernels, "EXT", _FakeExt(ckernels.EXT))
    rp = repack.interleave16(kind, packed, 32, 64, scales)
    assert rp.shape == (2, 2, repack.INTERLEAVE16_REC4)
    d = rp[..., 0:32].copy().view(np.float16).astype(np.float32)  # [g, b, 16]
    s = np.asarray(scales, dtype=np.float32).reshape(32, 2)  # [row, b]
    np.testing.assert_array_equal(d.transpose(0, 2, 1).reshape(32, 2), s.astype(np.float16))
    assert not np.array_equal(d.transpose(0, 2, 1).reshape(32, 2), s)  # rounded, not stored
    v = rp[..., 32:].reshape(2, 2, 4, 16, 4)  # [g, b, q, row, i]
    lo, hi = v & 15, v >> 4  # elements 4 q + i and 16 + 4 q + i, as code + 8
    codes = np.concatenate([lo.transpose(0, 3, 1, 2, 4), hi.transpose(0, 3, 1, 2, 4)], axis=3)
    codes = codes.reshape(32, 2, 32).astype(np.float32) - 8.0  # [row, b, element]
    got = codes * s[..., None]  # the stored scales: the codes alone are checked exactly
    np.testing.assert_array_equal(got.reshape(32, 64), qt.dequantize())


def test_repacked_loom_takes_the_stored_rows_when_a_scale_overflows_float16(monkeypatch):
    rng = np.random.default_rng(5)
    qt = MAKERS["loom_q4"](rng.standard_normal((32, 64)).astype(np.float32))
    kind, packed, scales = ckernels.operands(qt)
    monkeypatch.setattr(ckernels, "EXT", _FakeExt(ckernels.EXT))
    big = np.array(scales, dtype=np.float32, copy=True)
    big.flat[7] = 7.0e4  # past float16's 65,504
    assert repack.interleave16(kind, packed, 32, 64, big) is None
    assert repack.interleave16(kind, packed, 32, 64, scales) is not None

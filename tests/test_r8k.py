"""Q4_K rows repacked by 8 (poly.runtime.repack.repack8k, csrc/pk_r8k.h): the auto mode's decode
rows read one vector lane per weight row. The record is checked field by field against gguf-py's
reading of the stored block, and the fused step's decode rows on it against the stored rows'
kernel (pk_k8.h: the same integer sums) and against the float path."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from poly.runtime import ckernels, fused, kernels, repack
from tests.test_fused import quantize_all, run_steps, tiny_cfg
from tests.tiny_model import random_transformer

pytestmark = pytest.mark.skipif(
    not (ckernels.AVAILABLE and ckernels.EXT.info().get("r8k")), reason="no SIMD C kernels"
)


def _q4k_rows(m: int, k: int, seed: int) -> np.ndarray:
    """[m, k / 256 * 144] random Q4_K bytes with finite scales d, dmin in [2^-8, 2^-4]."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (m, k // 256, 144), dtype=np.uint8)
    d = rng.uniform(2.0**-8, 2.0**-4, (m, k // 256, 2)).astype(np.float16)
    raw[..., 0:4] = d.view(np.uint8).reshape(m, k // 256, 4)
    return raw.reshape(m, -1)


def test_record_fields_match_gguf_py():
    """Each 8-row record: D and Dmin as stored, the 6-bit scales and mins unpacked (checked by
    rebuilding every weight as D * s * code - Dmin * m against gguf-py's dequantization), the
    codes interleaved 4 bytes a row."""
    m, k = 16, 512
    raw = _q4k_rows(m, k, seed=1)
    rk = repack.repack8k(raw, m, k)
    assert rk.shape == (m // 8, k // 256, repack.R8K_REC)
    ref = dequantize(raw.reshape(-1), T.Q4_K).reshape(m, k)
    got = np.empty((m, k), dtype=np.float32)
    for g in range(m // 8):
        for sb in range(k // 256):
            rec = rk[g, sb]
            d = rec[0:16].view(np.float16).astype(np.float32)
            dmin = rec[16:32].view(np.float16).astype(np.float32)
            sc = rec[32:96].reshape(8, 8)  # [j, r]
            mn = rec[96:160].reshape(4, 8, 2).transpose(1, 0, 2).reshape(8, 8)  # [r, j]
            v = rec[160:].reshape(4, 8, 8, 4)  # [i, t, r, b]
            for r in range(8):
                q = v[:, :, r, :].reshape(4, 32)  # row r's stored bytes 32 i + 4 t + b
                codes = np.stack([q & 15, q >> 4], axis=1).reshape(8, 32)  # [j, l]
                w = d[r] * sc[:, r, None] * codes - dmin[r] * mn[r, :, None]
                got[8 * g + r, 256 * sb : 256 * sb + 256] = w.reshape(-1)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)


def test_shapes_without_whole_groups_are_not_repacked():
    assert repack.repack8k(_q4k_rows(12, 256, seed=2), 12, 256) is None  # m % 8
    raw = _q4k_rows(8, 512, seed=2)
    assert repack.repack8k(raw[:, :144], 8, 256) is not None


@pytest.mark.parametrize("threads", [1, 3])
def test_decode_rows_read_the_copy(threads, monkeypatch):
    """A Q4_K model's fused decode steps read the rows by 8 (a zeroed copy changes them) and
    agree with the Python path (the stored rows' kernel, the same integer sums: 1e-5); with 3
    threads the row ranges cut through 8-row groups."""
    copies, make = [], repack.repack8k
    monkeypatch.setattr(repack, "repack8k", lambda *a: copies.append(make(*a)) or copies[-1])
    old = kernels.num_threads()
    kernels.set_num_threads(threads)
    try:
        tf = random_transformer(tiny_cfg(hidden=256, inter=512), seed=11)
        quantize_all(tf, "gguf_q4_k")
        auto = run_steps(tf, True, monkeypatch)
        assert copies and all(c is not None for c in copies), "Q4_K matrices repacked by 8"
        # a prompt still takes the int8 panels: its rows are not a decode row's (server mixing)
        assert ckernels.Q4_K in fused.plan(tf).kinds and not fused.rows_alike(tf)
        python = run_steps(tf, False, monkeypatch)
        for a, p in zip(auto[1:], python[1:]):  # the decode steps (the prompt: int8 panels)
            np.testing.assert_allclose(a, p, rtol=0, atol=1e-5 * np.abs(p).max())
        for c in copies:
            c[..., 160:] = 0  # every code 0: the rows' sums change
        zeroed = run_steps(tf, True, monkeypatch)
        assert not np.allclose(zeroed[1], auto[1], atol=1e-3 * np.abs(auto[1]).max())
    finally:
        kernels.set_num_threads(old)

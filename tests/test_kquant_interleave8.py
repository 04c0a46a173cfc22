"""Q4_K and Q6_K rows repacked by 8 (poly.runtime.repack.kquant_interleave8 and
kquant_interleave8_q6, csrc/formats/kquant_interleave8.h): the auto mode's decode rows read one
vector lane per weight row. The records are checked field by field against gguf-py's reading of
the stored blocks, and the fused step's decode rows on them against the stored rows' kernel
(formats/kquant_rows.h: the same integer sums) and against the float path."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from poly.runtime import ckernels, dispatch, fused, kernels, repack
from tests.test_fused import quantize_all, run_steps, tiny_cfg
from tests.tiny_model import random_transformer

pytestmark = pytest.mark.skipif(
    not (ckernels.AVAILABLE and ckernels.EXT.info().get("kquant_interleave8")),
    reason="no SIMD C kernels",
)


def _rows(m: int, k: int, seed: int, block: int, at: int, nd: int) -> np.ndarray:
    """[m, k / 256 * block] random super-block bytes whose nd float16 scales at byte `at` are
    finite, in [2^-8, 2^-4]."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (m, k // 256, block), dtype=np.uint8)
    d = rng.uniform(2.0**-8, 2.0**-4, (m, k // 256, nd)).astype(np.float16)
    raw[..., at : at + 2 * nd] = d.view(np.uint8).reshape(m, k // 256, 2 * nd)
    return raw.reshape(m, -1)


def _q4k_rows(m: int, k: int, seed: int) -> np.ndarray:
    """Q4_K: d and dmin at bytes 0-3."""
    return _rows(m, k, seed, 144, 0, 2)


def test_record_fields_match_gguf_py():
    """Each 8-row record: D and Dmin as stored, the 6-bit scales and mins unpacked (checked by
    rebuilding every weight as D * s * code - Dmin * m against gguf-py's dequantization), the
    codes interleaved 4 bytes a row."""
    m, k = 16, 512
    raw = _q4k_rows(m, k, seed=1)
    rk = repack.kquant_interleave8(raw, m, k)
    assert rk.shape == (m // 8, k // 256, repack.KQUANT_INTERLEAVE8_REC)
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


def _q6k_rows(m: int, k: int, seed: int) -> np.ndarray:
    """Q6_K: d at bytes 208-209."""
    return _rows(m, k, seed, 210, 208, 1)


def _record_codes(v: np.ndarray) -> np.ndarray:
    """Row r's 256 codes from a Q6_K record's vectors v [16 j, 3 k, 8 r, 4 b] -> [8 r, 256]:
    element 16 j + 4 k + b in bits 0-5 of v[j, k] (k < 3); element 16 j + 12 + b spread over
    their bits 6-7, high bits first."""
    v = v.astype(np.int32)
    q = np.empty((16, 4, 8, 4), dtype=np.int32)  # [j, k, r, b]
    q[:, :3] = v & 63
    q[:, 3] = (v[:, 0] >> 6) << 4 | (v[:, 1] >> 6) << 2 | v[:, 2] >> 6
    return q.transpose(2, 0, 1, 3).reshape(8, 256)


def test_q6k_record_fields_match_gguf_py():
    """Each 8-row Q6_K record: D as stored, the int8 scales by pairs of 16-groups, the 6-bit
    codes three vectors a 16-group (checked by rebuilding every weight as D * s * (code - 32)
    against gguf-py's dequantization); no bigger than the stored rows."""
    m, k = 16, 512
    raw = _q6k_rows(m, k, seed=3)
    rk = repack.kquant_interleave8_q6(raw, m, k)
    assert (
        rk.shape == (m // 8, k // 256, repack.KQUANT_INTERLEAVE8_Q6_REC) and rk.nbytes == raw.nbytes
    )
    ref = dequantize(raw.reshape(-1), T.Q6_K).reshape(m, k)
    got = np.empty((m, k), dtype=np.float32)
    for g in range(m // 8):
        for sb in range(k // 256):
            rec = rk[g, sb]
            d = rec[0:16].view(np.float16).astype(np.float32)
            sc = rec[16:144].view(np.int8).reshape(8, 8, 2).transpose(1, 0, 2).reshape(8, 16)
            codes = _record_codes(rec[144:].reshape(16, 3, 8, 4))
            for r in range(8):
                w = d[r] * np.repeat(sc[r].astype(np.float32), 16) * (codes[r] - 32)
                got[8 * g + r, 256 * sb : 256 * sb + 256] = w
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)


def _rss_kb(arr: np.ndarray) -> int:
    """This process's resident kB of the mapping that holds arr (/proc/self/smaps)."""
    addr, inside = arr.ctypes.data, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(h, 16) for h in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError("no mapping holds the array")


@pytest.mark.parametrize(
    "maker, rows", [("kquant_interleave8", _q4k_rows), ("kquant_interleave8_q6", _q6k_rows)]
)
def test_stored_rows_are_released_after_the_repack(tmp_path, maker, rows):
    """The prompt panels read the records too: the stored rows' pages leave the resident set
    once repacked (and still read back the same from the file)."""
    m, k = 64, 1024
    raw = rows(m, k, seed=5)
    (tmp_path / "w.bin").write_bytes(raw.tobytes())
    mm = np.memmap(tmp_path / "w.bin", dtype=np.uint8, mode="r").reshape(m, -1)
    assert int(mm.sum(dtype=np.int64)) == int(raw.sum(dtype=np.int64))  # touched: resident
    assert _rss_kb(mm) > 0
    rk = getattr(repack, maker)(mm, m, k)
    assert rk is not None
    assert _rss_kb(mm) <= 4  # whole pages only: Q6_K's file ends in a part of one
    np.testing.assert_array_equal(mm, raw)


def test_shapes_without_whole_groups_are_not_repacked():
    assert repack.kquant_interleave8(_q4k_rows(12, 256, seed=2), 12, 256) is None  # m % 8
    raw = _q4k_rows(8, 512, seed=2)
    assert repack.kquant_interleave8(raw[:, :144], 8, 256) is not None
    assert repack.kquant_interleave8_q6(_q6k_rows(12, 256, seed=2), 12, 256) is None
    assert repack.kquant_interleave8_q6(_q6k_rows(8, 256, seed=2), 8, 256) is not None


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(
    "scheme, maker, kind",
    [
        ("gguf_q4_k", "kquant_interleave8", ckernels.Q4_K),
        ("gguf_q6_k", "kquant_interleave8_q6", ckernels.Q6_K),
    ],
)
def test_decode_rows_read_the_copy(threads, scheme, maker, kind, monkeypatch):
    """A Q4_K (Q6_K) model's fused decode steps read the rows by 8 (a zeroed copy changes them)
    and agree with the Python path (the stored rows' kernel, the same integer sums: 1e-5); with
    3 threads the row ranges cut through 8-row groups."""
    copies, make = [], getattr(repack, maker)
    monkeypatch.setattr(repack, maker, lambda *a: copies.append(make(*a)) or copies[-1])
    old = kernels.num_threads()
    kernels.set_num_threads(threads)
    try:
        tf = random_transformer(tiny_cfg(hidden=256, inter=512), seed=11)
        quantize_all(tf, scheme)
        auto = run_steps(tf, True, monkeypatch)
        assert copies and all(c is not None for c in copies), "matrices repacked by 8"
        # a prompt still takes the int8 panels: its rows are not a decode row's (server mixing)
        assert kind in fused.plan(tf).kinds and not fused.rows_alike(tf)
        python = run_steps(tf, False, monkeypatch)
        for a, p in zip(auto[1:], python[1:]):  # the decode steps (the prompt: int8 panels)
            np.testing.assert_allclose(a, p, rtol=0, atol=1e-5 * np.abs(p).max())
        for c in copies:
            c[..., 160 if kind == ckernels.Q4_K else 144 :] = 0  # every code 0: the sums change
        zeroed = run_steps(tf, True, monkeypatch)
        assert not np.allclose(zeroed[1], auto[1], atol=1e-3 * np.abs(auto[1]).max())
    finally:
        kernels.set_num_threads(old)


@pytest.mark.parametrize("threads, tokens", [(1, 6), (3, 6), (2, 80)])
@pytest.mark.parametrize(
    "scheme, maker, kind",
    [
        ("gguf_q4_k", "kquant_interleave8", ckernels.Q4_K),
        ("gguf_q6_k", "kquant_interleave8_q6", ckernels.Q6_K),
    ],
)
def test_prompt_panels_read_the_copy(threads, tokens, scheme, maker, kind, monkeypatch):
    """A prompt's int8 panels decode the rows by 8 when they exist (csrc/formats/kquant_interleave8_panels.h rebuilds
    each stored super-block from its record), in the fused step's rows (6 tokens) and in the
    reference path's gemm (80: past the fused prompt): every block's cached keys and values are
    bitwise those of the stored rows' panels (no copy made), the logits within 1e-5 (the last
    block's FFN runs the last row alone: the decode rows, formats/kquant_interleave8.h against formats/kquant_rows.h), and a
    zeroed copy changes them."""
    _panels_case(threads, tokens, maker, kind, monkeypatch, scheme=scheme)


@pytest.mark.parametrize(
    "scheme, maker, kind",
    [
        ("gguf_q4_k", "kquant_interleave8", ckernels.Q4_K),
        ("gguf_q6_k", "kquant_interleave8_q6", ckernels.Q6_K),
    ],
)
def test_prompt_panels_of_a_lone_group(scheme, maker, kind, monkeypatch):
    """k and v of one 8-head-wide KV head: 8 rows, a panel that is not two whole groups, so each
    stored super-block is rebuilt byte for byte from its record (formats/kquant_interleave8_panels.h kil8_sb)."""
    _panels_case(1, 6, maker, kind, monkeypatch, scheme=scheme, num_heads=32, num_kv_heads=1)


def _caches(tf) -> list[np.ndarray]:
    """Every block's cached keys and values, copied."""
    out = []
    for i in range(tf.config.num_layers):
        st = tf.attn(i).state
        out += [np.array(st.k[: st.length]), np.array(st.v[: st.length])]
    return out


def _panels_case(threads, tokens, maker, kind, monkeypatch, scheme, **kw):
    monkeypatch.setattr(dispatch, "SMALL_WIDTH", 0)  # 80 tokens on the gemm, as a wide model's
    prompt = [(7 * i + 3) % 100 for i in range(tokens)]
    make, copies = getattr(repack, maker), []

    def model():
        tf = random_transformer(tiny_cfg(hidden=256, inter=512, max_seq_len=96, **kw), seed=12)
        quantize_all(tf, scheme)
        return tf

    old = kernels.num_threads()
    kernels.set_num_threads(threads)
    try:
        with monkeypatch.context() as m:
            m.setattr(repack, maker, lambda *a: None)  # no copy: the panels read the stored rows
            tf = model()
            stored = run_steps(tf, True, monkeypatch, n=0, prompt=prompt)[0]
            kv = _caches(tf)
            assert kind in fused.plan(tf).kinds
        monkeypatch.setattr(repack, maker, lambda *a: copies.append(make(*a)) or copies[-1])
        tf = model()
        got = run_steps(tf, True, monkeypatch, n=0, prompt=prompt)[0]
        assert copies and all(c is not None for c in copies), "matrices repacked by 8"
        for a, b in zip(_caches(tf), kv):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(got, stored, rtol=0, atol=1e-5 * np.abs(stored).max())
        for c in copies:
            c[..., 160 if kind == ckernels.Q4_K else 144 :] = 0  # every code 0
        zeroed = run_steps(tf, True, monkeypatch, n=0, prompt=prompt)[0]
        assert not np.allclose(zeroed, got, atol=1e-3 * np.abs(got).max())
    finally:
        kernels.set_num_threads(old)

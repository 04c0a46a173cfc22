"""The repacked records made in C (csrc/formats/repack_records.h) are the bytes of
poly.runtime.repack's numpy copies: Q4_0/Q4_1/Q8_0 rows by 16, Q4_K/Q6_K rows by 8, on random
stored rows (the copies move bits: any byte pattern is a fair input)."""

from __future__ import annotations

import numpy as np
import pytest

from poly.runtime import ckernels, repack
from poly.runtime.ckernels import Q4_0, Q4_1, Q4_K, Q6_K, Q8_0

pytestmark = pytest.mark.skipif(
    not (ckernels.AVAILABLE and hasattr(ckernels.EXT, "repack_records")),
    reason="the C extension is not built",
)

BLOCK = {Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34), Q4_K: (256, 144), Q6_K: (256, 210)}
BY8 = {Q4_K: repack.kquant_interleave8, Q6_K: repack.kquant_interleave8_q6}


def _both(kind: int, m: int, k: int, monkeypatch) -> tuple[np.ndarray, np.ndarray]:
    cols, bb = BLOCK[kind]
    raw = np.random.default_rng(kind).integers(0, 256, (m, k // cols * bb), dtype=np.uint8)
    make = (
        repack.kquant_interleave8
        if kind == Q4_K
        else (lambda r, m, k: repack.interleave16(kind, r, m, k))
    )
    fast = make(raw.copy(), m, k)
    monkeypatch.setattr(repack.repack_records, "make", lambda *a: None)
    slow = make(raw.copy(), m, k)
    return fast, slow


@pytest.mark.parametrize(
    "kind", [Q4_0, Q4_1, Q8_0, Q4_K, Q6_K], ids=["q4_0", "q4_1", "q8_0", "q4_k", "q6_k"]
)
@pytest.mark.parametrize("m,k", [(16, 256), (48, 512)])
def test_c_records_are_the_numpy_records(kind, m, k, monkeypatch):
    fast, slow = _both(kind, m, k, monkeypatch)
    if fast is None:  # this build takes no such rows (repack's own conditions)
        assert slow is None
        return
    assert fast.shape == slow.shape and fast.dtype == slow.dtype
    assert np.array_equal(fast, slow)


def test_bad_shapes_and_buffers_are_value_errors():
    raw = np.zeros((16, 34), np.uint8)
    out = np.zeros((1, 1, 544), np.uint8)
    ckernels.EXT.repack_records("q8_0", raw, 16, 32, out)
    for args in (("q9_0", raw, 16, 32, out), ("q8_0", raw, 15, 32, out),
                 ("q8_0", raw, 16, 64, out), ("q8_0", raw, 16, 32, out.reshape(-1)[:500])):  # fmt: skip
        with pytest.raises(ValueError):
            ckernels.EXT.repack_records(*args)

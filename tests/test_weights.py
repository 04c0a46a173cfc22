"""poly.weights.aligned_zeros: zeroed, aligned, writable; large arrays on 2 MB boundaries."""

import sys

import numpy as np
import pytest

from poly.weights import HUGE, aligned_zeros


@pytest.mark.parametrize("n", [1, 1000, HUGE // 4, HUGE // 4 + 3, 3 * HUGE // 4 + 1])
def test_aligned_zeros(n):
    a = aligned_zeros(n)
    assert a.dtype == np.float32 and a.shape == (n,) and a.flags.writeable
    assert a.ctypes.data % 64 == 0 and not a.any()
    a[...] = 1.5  # every byte is usable
    assert float(a.sum()) == 1.5 * n


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge-page mapping is Linux-only")
def test_large_arrays_start_on_a_huge_page_boundary():
    a = aligned_zeros(HUGE // 4 + 7)
    assert a.ctypes.data % HUGE == 0  # so the kernel can back it with 2 MB pages
    b = aligned_zeros(100)
    assert b.ctypes.data % 64 == 0

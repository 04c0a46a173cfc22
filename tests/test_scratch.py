"""poly.nn.scratch: the kept per-thread buffers a long prompt's attention takes its largest
arrays from (keys and values laid out by head, a block's scores)."""

from __future__ import annotations

import threading

import numpy as np

from poly.nn import scratch
from poly.nn.kvcache import attention_rows, q8_dequantize, q8_quantize


def test_a_name_reuses_its_buffer_until_it_must_grow():
    a = scratch.take("t-reuse", (1000,))
    b = scratch.take("t-reuse", (1100,))  # within the 1/8 headroom and the MiB grain
    assert np.shares_memory(a, b)
    assert not np.shares_memory(b, scratch.take("t-other", (1000,)))
    c = scratch.take("t-reuse", (2 << 20,))  # 8 MiB of float32: a new mapping
    assert c.shape == (2 << 20,) and c.flags.c_contiguous and not np.shares_memory(a, c)
    c[-1] = 1.0  # writable to its last element


def test_each_thread_has_its_own_buffers():
    mine = scratch.take("t-thread", (256,))
    theirs = []
    t = threading.Thread(target=lambda: theirs.append(scratch.take("t-thread", (256,))))
    t.start(), t.join()
    assert not np.shares_memory(mine, theirs[0])


def test_attention_rows_are_the_cache_values_laid_out_by_head():
    rng = np.random.default_rng(3)
    k, v = (rng.standard_normal((70, 3, 64)).astype(np.float32) for _ in range(2))
    (kc, ks), (vc, vs) = q8_quantize(k), q8_quantize(v)
    keys, values = attention_rows(kc, vc, ks, vs)
    np.testing.assert_array_equal(keys, q8_dequantize(kc, ks))  # bit for bit: same products
    np.testing.assert_array_equal(values, q8_dequantize(vc, vs))
    assert keys[:, 1, :].flags.c_contiguous and values[:, 1, :].T.flags.c_contiguous
    halves = attention_rows(k.astype(np.float16), v.astype(np.float16))
    np.testing.assert_array_equal(halves[0], k.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(halves[1], v.astype(np.float16).astype(np.float32))

"""Kept per-thread buffers for a long prompt's largest temporaries: the attention's float keys
and values (kvcache.attention_rows) and a block's scores (poly.runtime.attention).

Those arrays are megabytes each, made and dropped once per layer, and a prompt's later chunks
ask larger ones (they grow with the context). From glibc's heap (heap.py keeps blocks up to
32 MB there) a larger one could not reuse the holes the last chunk left, so the heap grew far
past what was in use, by a different amount each run (docs/performance.md, session 18). Here
each has one mapping, outside the heap, grown with headroom and kept.
"""

from __future__ import annotations

import mmap
import threading

import numpy as np

GRAIN = 1 << 20  # bytes: a buffer grows in whole MiB, plus 1/8, so the next chunk reuses it

_local = threading.local()


def take(name: str, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """An uninitialised C-contiguous array of `shape` in this thread's buffer `name`, valid until
    the next `take(name)` in this thread (a caller never keeps it past its own call)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    kept = _local.__dict__.setdefault("buffers", {})
    buf = kept.get(name)
    if buf is None or len(buf) < nbytes:
        kept.pop(name, None)  # the old mapping goes when its arrays do
        size = max(GRAIN, (nbytes + nbytes // 8 + GRAIN - 1) // GRAIN * GRAIN)
        buf = kept[name] = mmap.mmap(-1, size)
    return np.frombuffer(buf, dtype=dtype, count=nbytes // dtype.itemsize).reshape(shape)

"""The repacked records of poly.runtime.repack made by the C extension
(csrc/formats/repack_records.h): Q4_0/Q4_1/Q8_0 rows by 16, Q4_K/Q6_K rows by 8. The same bytes
as repack's numpy copies (tests/test_repack_c.py), without numpy's strided copies: an 8B-class
file is gigabytes of them at every open its layouts are not cached for."""

from __future__ import annotations

import numpy as np

from poly.runtime import ckernels, kernels
from poly.weights import aligned_zeros

# the C side's name of each kind's layout (csrc/formats/repack_records.h)
LAYOUTS = {ckernels.Q4_0: "q4_0", ckernels.Q4_1: "q4_1", ckernels.Q8_0: "q8_0",
           ckernels.Q4_K: "q4_k", ckernels.Q6_K: "q6_k"}  # fmt: skip


def make(kind: int, raw: np.ndarray, m: int, k: int, record: tuple) -> np.ndarray | None:
    """The records of `raw` [m, row bytes] on huge pages, over the threads; `record`: (rows,
    columns, bytes) of one (poly.runtime.repack's table). None when the extension has no such
    call (the caller's numpy copies then)."""
    call = getattr(ckernels.EXT, "repack_records", None) if ckernels.AVAILABLE else None
    if call is None or kind not in LAYOUTS:
        return None
    layout, (rows, cols, rec) = LAYOUTS[kind], record
    g = m // rows
    out = aligned_zeros(g * (k // cols) * rec, np.uint8).reshape(g, k // cols, rec)
    src = np.ascontiguousarray(raw).reshape(m, -1)
    parts = min(kernels.num_threads(), max(1, src.nbytes >> 24))  # threads for 16 MB and up
    cuts = [g * i // parts for i in range(parts + 1)]
    jobs = [(layout, src[a * rows : b * rows], (b - a) * rows, k, out[a:b])
            for a, b in zip(cuts, cuts[1:]) if b > a]  # fmt: skip
    if len(jobs) == 1:
        call(*jobs[0])
    else:  # the call lets the GIL go: the pages fault in (file and copy) on every core
        from concurrent.futures import ThreadPoolExecutor  # (loads logging: not at open)

        with ThreadPoolExecutor(len(jobs)) as pool:
            list(pool.map(lambda job: call(*job), jobs))
    return out

"""Experts under a memory budget: a least-recently-used set of resident MoE experts over a
read-only file mapping.

The experts' weights are views on the mapping (an `.entity` loaded zero-copy), so an expert
becomes resident when its pages are first read. The pager counts every use an MoE layer reports
(`poly.nn.moe` calls ``handle.use(e)`` before running expert e): a use of a resident expert is a
hit; otherwise a miss, which asks the kernel to read the expert's range ahead
(``MADV_WILLNEED``), counts its bytes as read and makes it the most recent. When more than
``max_resident`` experts (over all layers) are resident, the least recently used one is evicted:
``MADV_DONTNEED`` on its range drops its pages from the process (RSS), and the next use reads
them again from the page cache or disk. Results never depend on the budget. Every use first
checks that the file is still the one loaded (`poly.filesnapshot.FileSnapshot.check`): a rewritten
or truncated file fails the request with ModelFileChangedError, not the process with SIGBUS.

An expert whose stored form no kernel reads as it is (GGUF MXFP4, GPT-OSS's transposed HF
stacks, an HF bfloat16 expert of a float32 model) is a set of `PagedMatrix`: a miss reads its
stored bytes once into a dense copy (`PagedMatrix.load`) and drops the stored pages; an
eviction drops the copy. Such an expert counts its copy's bytes as resident.
"""

from __future__ import annotations

import mmap
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from poly.errors import UsageError
from poly.ops import dense_matmul
from poly.quant.qtensor import QTensor

PAGE = mmap.PAGESIZE

Range = tuple[int, int]  # (offset, length) in the mapping


@dataclass
class ExpertStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_read: int = 0


def check_budget(max_resident, moe) -> None:
    """UsageError unless the budget is an integer >= 1 and >= the top-k of `moe` (a
    `poly.config.MoEConfig` or None): one token runs top-k experts of a layer at once."""
    if type(max_resident) is not int or max_resident < 1:
        raise UsageError(f"max_resident_experts must be an integer >= 1, got {max_resident!r}")
    if moe is not None and max_resident < moe.top_k:
        raise UsageError(
            f"max_resident_experts {max_resident} is below the {moe.top_k} experts each token "
            f"runs in a layer (top_k): give at least {moe.top_k}"
        )


class ExpertPager:
    """LRU residency of experts keyed by (layer index, expert id) over one mapping ``mm``."""

    def __init__(self, mm, max_resident: int):
        check_budget(max_resident, None)
        self.mm, self.max_resident = mm, max_resident
        self.ranges: dict[tuple[int, int], list[tuple]] = {}  # (mapping, offset, length)
        self.sizes: dict[tuple[int, int], int] = {}  # stored bytes (read on a miss)
        self.loaded: dict[tuple[int, int], tuple[PagedMatrix, ...]] = {}
        self.resident: OrderedDict[tuple[int, int], None] = OrderedDict()
        self.stats = ExpertStats()

    def add(self, layer: int, expert: int, ranges: list, matrices=(), mapping=None) -> None:
        """Expert (layer, expert) stored at `ranges` ((offset, length) on `mapping`, default
        the pager's, or (mapping, offset, length)); `matrices`: its `PagedMatrix` parts, loaded
        on a miss and dropped on eviction."""
        mm = self.mm if mapping is None else mapping
        key = (layer, expert)
        self.ranges[key] = [r if len(r) == 3 else (mm, *r) for r in ranges]
        self.sizes[key] = sum(r[-1] for r in ranges)
        if matrices:
            self.loaded[key] = tuple(matrices)

    def resident_size(self, key: tuple[int, int]) -> int:
        """Bytes expert `key` holds while resident: its pages, or its loaded copies."""
        mats = self.loaded.get(key)
        return self.sizes.get(key, 0) if mats is None else sum(m.nbytes for m in mats)

    def handle(self, layer: int) -> ExpertHandle:
        return ExpertHandle(self, layer)

    def use(self, key: tuple[int, int]) -> None:
        for check in self._checks(key):  # the experts' pages are the file's: gone if rewritten
            check()
        if key in self.resident:
            self.stats.hits += 1
            self.resident.move_to_end(key)
            return
        self.stats.misses += 1
        self.stats.bytes_read += self.sizes.get(key, 0)
        self._advise(key, mmap.MADV_WILLNEED, inward=False)
        mats = self.loaded.get(key, ())
        for m in mats:
            m.load()
        if mats:  # the copies serve it now: its stored pages are read again on the next miss
            self._advise(key, mmap.MADV_DONTNEED, inward=True)
        self.resident[key] = None
        while len(self.resident) > self.max_resident:
            old, _ = self.resident.popitem(last=False)
            self.stats.evictions += 1
            for m in self.loaded.get(old, ()):
                m.drop()
            self._advise(old, mmap.MADV_DONTNEED, inward=True)

    def _checks(self, key: tuple[int, int]) -> list:
        maps = {id(r[0]): r[0] for r in self.ranges.get(key, ())} or {id(self.mm): self.mm}
        return [c for c in (getattr(m, "check", None) for m in maps.values()) if c is not None]

    def _advise(self, key: tuple[int, int], option: int, *, inward: bool) -> None:
        """madvise the expert's ranges; DONTNEED only on pages wholly inside them (a page shared
        with a neighbour stays), WILLNEED on every page they touch."""
        for mm, off, n in self.ranges.get(key, ()):
            if mm is None:
                continue
            start = -(-off // PAGE) * PAGE if inward else off // PAGE * PAGE
            stop = (off + n) // PAGE * PAGE if inward else -(-(off + n) // PAGE) * PAGE
            stop = min(stop, len(mm))
            if stop > start:
                try:
                    mm.madvise(option, start, stop - start)
                except (OSError, ValueError):  # advice only: a refusal changes no result
                    pass

    def report(self) -> dict:
        """hits, misses, evictions, bytes read, resident count and bytes, the budget."""
        s = self.stats
        uses = s.hits + s.misses
        return {
            "max_resident": self.max_resident,
            "resident": len(self.resident),
            "resident_bytes": sum(self.resident_size(k) for k in self.resident),
            "hits": s.hits,
            "misses": s.misses,
            "evictions": s.evictions,
            "hit_rate": s.hits / uses if uses else 0.0,
            "bytes_read": s.bytes_read,
            "experts": len(self.ranges),
        }

    def reset_stats(self) -> None:
        self.stats = ExpertStats()


class ExpertHandle:
    """What one MoE layer holds (``layer.expert_cache``): reports uses under its layer index."""

    def __init__(self, pager: ExpertPager, layer: int):
        self.pager, self.layer = pager, layer

    def use(self, expert: int) -> None:
        self.pager.use((self.layer, expert))


class PagedMatrix(QTensor):
    """An expert matrix [out, in] kept as its stored bytes on the file mapping and read into a
    dense copy (float32, or bfloat16 when that holds every value exactly) while its expert is
    resident. ``read()`` makes the float32 values from the stored bytes. ``blockwise``: products
    go by row blocks of those values as `QTensor.matmul_reference` does (what the stored form's
    own class runs, e.g. GGUF MXFP4: the same bits); else one float32 product (what a float32
    master runs). Used outside the pager (not resident), each product reads the bytes again."""

    scheme = "paged"

    def __init__(self, shape, read, *, blockwise: bool = False, compact: bool = False):
        self.shape = (int(shape[0]), int(shape[1]))
        self.read, self.blockwise, self.compact = read, blockwise, compact
        self.dense: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        item = 2 if self.compact else 4
        return self.shape[0] * self.shape[1] * item if self.dense is None else self.dense.nbytes

    def load(self) -> None:
        if self.dense is None:
            w = np.ascontiguousarray(self.read(), dtype=np.float32)  # [out, in]
            if self.compact and not (w.view(np.uint32) & 0xFFFF).any():
                import ml_dtypes  # bfloat16 keeps every such value: half the bytes, same bits

                w = w.astype(ml_dtypes.bfloat16)
            self.dense = w

    def drop(self) -> None:
        self.dense = None

    def values(self) -> np.ndarray:
        w = self.read() if self.dense is None else self.dense
        return np.asarray(w, dtype=np.float32)

    def _rows_numpy(self, start: int, stop: int) -> np.ndarray:
        w = self.read() if self.dense is None else self.dense
        return np.asarray(w[start:stop], dtype=np.float32)

    def matmul(self, x, out: np.ndarray | None = None) -> np.ndarray:
        if self.blockwise:
            return super().matmul(x, out)
        x = np.asarray(x, dtype=np.float32)
        x2 = np.ascontiguousarray(x.reshape(1, -1) if x.ndim == 1 else x)  # [n, in]
        res = dense_matmul(x2, self.values())  # [n, out]
        res = res.reshape(-1) if x.ndim == 1 else res
        if out is None:
            return res
        out[...] = res
        return out

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
checks that the file is still the one loaded (`poly.weights.FileSnapshot.check`): a rewritten
or truncated file fails the request with ModelFileChangedError, not the process with SIGBUS.
"""

from __future__ import annotations

import mmap
from collections import OrderedDict
from dataclasses import dataclass

from poly.errors import UsageError

PAGE = mmap.PAGESIZE

Range = tuple[int, int]  # (offset, length) in the mapping


@dataclass
class ExpertStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_read: int = 0


class ExpertPager:
    """LRU residency of experts keyed by (layer index, expert id) over one mapping ``mm``."""

    def __init__(self, mm, max_resident: int):
        if type(max_resident) is not int or max_resident < 1:
            raise UsageError(f"max_resident_experts must be an integer >= 1, got {max_resident!r}")
        self.mm, self.max_resident = mm, max_resident
        self.ranges: dict[tuple[int, int], list[Range]] = {}
        self.sizes: dict[tuple[int, int], int] = {}
        self.resident: OrderedDict[tuple[int, int], None] = OrderedDict()
        self.stats = ExpertStats()
        self.check = getattr(mm, "check", None)  # a poly.weights.FileSnapshot's change test

    def add(self, layer: int, expert: int, ranges: list[Range]) -> None:
        self.ranges[(layer, expert)] = ranges
        self.sizes[(layer, expert)] = sum(n for _, n in ranges)

    def handle(self, layer: int) -> ExpertHandle:
        return ExpertHandle(self, layer)

    def use(self, key: tuple[int, int]) -> None:
        if self.check is not None:  # the experts' pages are the file's: gone if it was rewritten
            self.check()
        if key in self.resident:
            self.stats.hits += 1
            self.resident.move_to_end(key)
            return
        self.stats.misses += 1
        self.stats.bytes_read += self.sizes.get(key, 0)
        self._advise(key, mmap.MADV_WILLNEED, inward=False)
        self.resident[key] = None
        while len(self.resident) > self.max_resident:
            old, _ = self.resident.popitem(last=False)
            self.stats.evictions += 1
            self._advise(old, mmap.MADV_DONTNEED, inward=True)

    def _advise(self, key: tuple[int, int], option: int, *, inward: bool) -> None:
        """madvise the expert's ranges; DONTNEED only on pages wholly inside them (a page shared
        with a neighbour stays), WILLNEED on every page they touch."""
        if self.mm is None:
            return
        for off, n in self.ranges.get(key, ()):
            start = -(-off // PAGE) * PAGE if inward else off // PAGE * PAGE
            stop = (off + n) // PAGE * PAGE if inward else -(-(off + n) // PAGE) * PAGE
            stop = min(stop, len(self.mm))
            if stop > start:
                try:
                    self.mm.madvise(option, start, stop - start)
                except (OSError, ValueError):  # advice only: a refusal changes no result
                    pass

    def report(self) -> dict:
        """hits, misses, evictions, bytes read, resident count and bytes, the budget."""
        s = self.stats
        uses = s.hits + s.misses
        return {
            "max_resident": self.max_resident,
            "resident": len(self.resident),
            "resident_bytes": sum(self.sizes.get(k, 0) for k in self.resident),
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

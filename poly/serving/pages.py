"""The page pool: fixed-size KV pages, reference counts, and the prefix cache over them.

A page holds ``page_size`` positions of one sequence in every layer. Full pages are named by a
hash chain over their tokens (blake2b of the parent hash and the page's token ids, as vLLM
does), so two requests sharing a prompt prefix share its pages. A page whose reference count
drops to 0 keeps its hash and goes to an LRU list: it is reused by a later match, or evicted
(oldest first) when a fresh page is needed and none is free.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

ROOT = b"poly-kv"


def chain_hashes(tokens, page_size: int, parent: bytes = ROOT) -> list[bytes]:
    """The hash of every full page of ``tokens``."""
    out = []
    arr = np.asarray(tokens, dtype=np.int32)
    for i in range(len(arr) // page_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(arr[i * page_size : (i + 1) * page_size].tobytes())
        parent = h.digest()
        out.append(parent)
    return out


class PagePool:
    """Page ids 0..n_pages-1 with reference counts, free pages and an LRU of cached pages.

    Freed pages are reused last-in first-out and never-used pages are taken in id order, so the
    memory the pool touches (its resident size) follows the peak of live tokens, plus at most
    ``cache_pages`` unreferenced pages kept for prefix reuse.
    """

    def __init__(self, n_pages: int, page_size: int, cache_pages: int | None = None):
        self.n_pages, self.page_size = int(n_pages), int(page_size)
        self.cache_pages = self.n_pages if cache_pages is None else max(0, int(cache_pages))
        self.ref = np.zeros(self.n_pages, dtype=np.int32)
        self.recycled: list[int] = []  # freed pages, reused first (their memory is resident)
        self.fresh = 0  # pages fresh..n_pages-1 were never used
        self.lru: OrderedDict[int, bytes] = OrderedDict()  # unreferenced pages that keep a hash
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.reserved = 0  # pages promised to admitted sequences, not yet taken

    @property
    def free(self) -> int:
        return len(self.recycled) + self.n_pages - self.fresh

    @property
    def available(self) -> int:
        """Pages that can still be promised (free + evictable - reserved)."""
        return self.free + len(self.lru) - self.reserved

    @property
    def used(self) -> int:
        return self.n_pages - self.free - len(self.lru)

    def _evict(self) -> int:
        page, h = self.lru.popitem(last=False)  # least recently used first
        del self.by_hash[h], self.hash_of[page]
        return page

    def alloc(self) -> int:
        if self.recycled:
            page = self.recycled.pop()
        elif self.fresh < self.n_pages:
            page, self.fresh = self.fresh, self.fresh + 1
        elif self.lru:
            page = self._evict()
        else:
            raise MemoryError("KV page pool exhausted")
        self.ref[page] = 1
        return page

    def retain(self, page: int) -> None:
        if self.ref[page] == 0:
            self.lru.pop(page, None)
        self.ref[page] += 1

    def release(self, page: int) -> None:
        self.ref[page] -= 1
        if self.ref[page] > 0:
            return
        h = self.hash_of.get(page)
        if h is None:
            self.recycled.append(page)
            return
        self.lru[page] = h  # newest at the end
        while len(self.lru) > self.cache_pages:
            self.recycled.append(self._evict())

    def lookup(self, h: bytes) -> int | None:
        return self.by_hash.get(h)

    def register(self, page: int, h: bytes) -> None:
        if h not in self.by_hash and page not in self.hash_of:
            self.by_hash[h] = page
            self.hash_of[page] = h

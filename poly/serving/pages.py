"""The page pool: fixed-size KV pages, reference counts, and the prefix cache over them.

A page holds ``page_size`` positions of one sequence in every layer. Full pages are named by a
hash chain over their tokens (blake2b of the parent hash and the page's token ids, as vLLM
does), so two requests sharing a prompt prefix share its pages. A page whose reference count
drops to 0 keeps its hash and goes to an LRU list: it is reused by a later match, or evicted
(oldest first) when a fresh page is needed and none is free.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

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
    """Page ids 0..n_pages-1 with reference counts, a free list and an LRU of cached pages."""

    def __init__(self, n_pages: int, page_size: int):
        self.n_pages, self.page_size = int(n_pages), int(page_size)
        self.ref = np.zeros(self.n_pages, dtype=np.int32)
        self.free: deque[int] = deque(range(self.n_pages))
        self.lru: OrderedDict[int, bytes] = OrderedDict()  # unreferenced pages that keep a hash
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.reserved = 0  # pages promised to admitted sequences, not yet taken

    @property
    def available(self) -> int:
        """Pages that can still be promised (free + evictable - reserved)."""
        return len(self.free) + len(self.lru) - self.reserved

    @property
    def used(self) -> int:
        return self.n_pages - len(self.free) - len(self.lru)

    def alloc(self) -> int:
        if self.free:
            page = self.free.popleft()
        elif self.lru:
            page, h = self.lru.popitem(last=False)  # least recently used first
            del self.by_hash[h], self.hash_of[page]
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
            self.free.append(page)
        else:
            self.lru[page] = h  # newest at the end

    def lookup(self, h: bytes) -> int | None:
        return self.by_hash.get(h)

    def register(self, page: int, h: bytes) -> None:
        if h not in self.by_hash and page not in self.hash_of:
            self.by_hash[h] = page
            self.hash_of[page] = h

"""The page pool: fixed-size KV pages, reference counts, and the prefix cache over them.

A page holds ``page_size`` positions of one sequence in every layer. Full pages are named by a
hash chain over their tokens (blake2b of the parent hash and the page's token ids, as vLLM
does), so two requests sharing a prompt prefix share its pages. A page whose reference count
drops to 0 keeps its hash and goes to an LRU list: it is reused by a later match, or evicted
(oldest first) when a fresh page is needed and none is free.

A finished sequence's last, partial page is kept too, and every kept page is indexed under its
parent hash with its tokens: a prompt that matches the cached pages up to some page and then
shares only part of the next one (a repeated prompt shorter than a page, or one that diverges
mid-page) copies that common part from the best kept page (``best_prefix``), as llama.cpp's
server slots reuse their last prompt.
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
        # kept pages by (parent hash, first token) -> {page: its tokens}, for best_prefix
        self.children: dict[tuple[bytes, int], dict[int, np.ndarray]] = {}
        self.child_key: dict[int, tuple[bytes, int]] = {}
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
        key = self.child_key.pop(page, None)
        if key is not None:
            kids = self.children[key]
            del kids[page]
            if not kids:
                del self.children[key]
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

    def register(self, page: int, h: bytes, parent: bytes | None = None, tokens=None) -> None:
        """Name ``page`` by ``h``; with its ``parent`` hash and ``tokens``, `best_prefix` finds it."""
        if h in self.by_hash or page in self.hash_of:
            return
        self.by_hash[h] = page
        self.hash_of[page] = h
        if parent is not None and len(tokens):
            toks = np.asarray(tokens, dtype=np.int32)
            key = (parent, int(toks[0]))
            self.children.setdefault(key, {})[page] = toks
            self.child_key[page] = key

    def register_partial(self, page: int, parent: bytes, tokens) -> None:
        """Keep a sequence's last, partial page (its first len(tokens) positions)."""
        toks = np.asarray(tokens, dtype=np.int32)
        h = hashlib.blake2b(b"partial" + parent, digest_size=16)
        h.update(toks.tobytes())
        self.register(page, h.digest(), parent, toks)

    def best_prefix(self, parent: bytes, tokens) -> tuple[int, int] | None:
        """The kept page under ``parent`` whose tokens share the longest prefix with
        ``tokens`` -> (page, shared length), or None when none shares its first token."""
        toks = np.asarray(tokens, dtype=np.int32)
        if not len(toks):
            return None
        best = None
        for page, kept in self.children.get((parent, int(toks[0])), {}).items():
            m = min(len(kept), len(toks))
            diff = np.flatnonzero(kept[:m] != toks[:m])
            n = int(diff[0]) if len(diff) else m
            if best is None or n > best[1]:
                best = (page, n)
        return best

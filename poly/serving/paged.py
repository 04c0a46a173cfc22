"""Paged KV storage for the scheduler: a fixed pool allocated at start, pages taken as sequences
grow and given back when they end, prefix pages shared between requests.

Decode runs the fused C step with a page table per row (``fused.step_paged``): it computes
exactly what the contiguous step computes, only the cache addresses differ. Prefill runs poly's
own multi-token path on one reusable contiguous scratch state: the sequence's cached positions
are gathered into it, the chunk is run, and the new positions are scattered into pages.
"""

from __future__ import annotations

import mmap

import numpy as np

from poly.errors import ContextOverflowError, GenerationError
from poly.nn.mha import KVCache, kv_dtype
from poly.serving.pages import ROOT, PagePool, chain_hashes
from poly.serving.ranks import reduce_of, run_batch


def _pool_array(shape, dtype=np.float32) -> np.ndarray:
    """Zeros the OS maps on first touch, in 4 KiB pages (no transparent huge pages: a 2 MiB page
    per layer array would make the resident size jump by 2 MiB x layers x 2 at a time)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    buf = mmap.mmap(-1, max(count * dtype.itemsize, 1))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


class PagedSeq:
    """One sequence's KV: its pages, in order, and how many positions they hold."""

    def __init__(self):
        self.pages: list[int] = []
        self.length = 0
        self.reserved = 0  # pages it may still take from the pool's reservation
        self.extra = 0  # pages promised for the choices forked from it (n > 1)
        self.hashed = 0  # leading pages whose hashes are registered


def q8_cache(model) -> bool:
    """Whether `model`'s KV caches are q8_0 blocks (no paged pool or paged C step holds them)."""
    return any(kv_dtype(model.attn(i)) == np.int8 for i in range(model.config.num_layers))


def windowed(model) -> bool:
    """Whether some attention layer of `model` slides over fewer positions than its context."""
    layers = (model.attn(i) for i in range(model.config.num_layers))
    return any(0 < getattr(a, "sliding_window", 0) < a.max_seq_len for a in layers)


class PagedKV:
    """The pool and the operations the scheduler needs (see ``ContiguousKV``)."""

    paged = True

    def __init__(self, model, n_pages: int, page_size: int = 16, prefix_cache: bool = True,
                 cache_bytes: int = 256 << 20):  # fmt: skip
        from poly.errors import LayerConfigError

        if n_pages < 1 or page_size < 1:
            raise LayerConfigError("the KV pool needs >= 1 page of >= 1 position")
        if windowed(model):  # its pages and the fused paged step attend over every position
            raise LayerConfigError(
                "kv_pages: the paged KV pool does not implement sliding-window attention; "
                "use contiguous caches (kv_pages 0, the default for this model)"
            )
        if q8_cache(model):
            raise LayerConfigError(
                "kv_pages: the paged KV pool does not hold a q8_0 KV cache; use contiguous "
                "caches (kv_pages 0, the default for this cache)"
            )
        self.model = model
        self.ps = int(page_size)
        self.prefix_cache = prefix_cache
        self.layers = [model.attn(i) for i in range(model.config.num_layers)]
        rows = n_pages * page_size
        self.k = [_pool_array((rows, a.num_kv_heads, a.head_dim), kv_dtype(a)) for a in self.layers]
        self.v = [_pool_array(k.shape, k.dtype) for k in self.k]
        self.page_bytes = sum(2 * page_size * k[0].nbytes for k in self.k)
        self.pool = PagePool(n_pages, page_size, cache_bytes // self.page_bytes)
        self.live: dict[int, PagedSeq] = {}
        self._scratch: list | None = None
        self._scratches: list[list] = []  # prefill_many: one scratch cache per prompt
        self._owner: tuple[int, int] | None = None  # (id(seq), length) the scratch holds

    # --- admission --------------------------------------------------------------------------------

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.ps)

    def check(self, prompt_len: int, budget: int, n: int) -> None:
        """ContextOverflowError when the whole pool could not hold the request."""
        need = self.pages_for(prompt_len + budget) + (n - 1) * (self.pages_for(budget) + 1)
        if need > self.pool.n_pages:
            raise ContextOverflowError(
                f"the request needs {need} KV pages of {self.ps} positions; the pool has "
                f"{self.pool.n_pages} (lower max_tokens or n, or start with more --kv-pages)"
            )

    def reserve(self, prompt: list[int], budget: int, n: int) -> tuple[PagedSeq, int] | None:
        """A sequence for ``prompt`` with pages promised for the prompt and ``n`` choices of
        ``budget`` tokens, its prefix taken from the cache -> (seq, cached tokens); None when the
        pool cannot promise that many pages now."""
        seq = PagedSeq()
        matched, part = self._match(prompt) if self.prefix_cache else ([], None)
        need = self.pages_for(len(prompt) + budget) - len(matched)
        need += (n - 1) * (self.pages_for(budget) + 1)
        if need > self.pool.available:
            return None
        for page in matched:
            self.pool.retain(page)
        seq.pages, seq.length, seq.hashed = matched, len(matched) * self.ps, len(matched)
        self._promise(seq, self.pages_for(len(prompt) + budget) - len(matched))
        seq.extra = (n - 1) * (self.pages_for(budget) + 1)
        self.pool.reserved += seq.extra
        if part is not None:
            self._copy_prefix(seq, *part)
        self.live[id(seq)] = seq
        return seq, seq.length

    def _copy_prefix(self, seq: PagedSeq, src: int, n: int) -> None:
        """The first n positions of kept page ``src`` into a new page of ``seq``."""
        self.pool.retain(src)  # not evicted by the allocation below
        a, b = src * self.ps, self._take(seq) * self.ps
        for k, v in zip(self.k, self.v):
            k[b : b + n] = k[a : a + n]
            v[b : b + n] = v[a : a + n]
        self.pool.release(src)
        seq.length += n

    def _promise(self, seq: PagedSeq, pages: int) -> None:
        seq.reserved += pages
        self.pool.reserved += pages

    def _match(self, prompt: list[int]) -> tuple[list[int], tuple[int, int] | None]:
        """The cached full pages of the prompt's prefix, then the kept page sharing most of
        the next positions -> (pages, (page, positions) or None); >= 1 token is left to run."""
        usable, out, parent = prompt[: len(prompt) - 1], [], ROOT
        for h in chain_hashes(usable, self.ps):
            page = self.pool.lookup(h)
            if page is None:
                break
            out.append(page)
            parent = h
        rest = usable[len(out) * self.ps : (len(out) + 1) * self.ps]
        return out, self.pool.best_prefix(parent, rest)

    # --- pages --------------------------------------------------------------------------------------

    def _take(self, seq: PagedSeq) -> int:
        page = self.pool.alloc()
        if seq.reserved > 0:
            seq.reserved -= 1
            self.pool.reserved -= 1
        seq.pages.append(page)
        return page

    def _room(self, seq: PagedSeq, upto: int) -> None:
        while len(seq.pages) * self.ps < upto:
            self._take(seq)

    def fork(self, seq: PagedSeq, length: int, budget: int) -> PagedSeq:
        """Choice 2..n of a prompt: full pages shared, the partial last page copied."""
        out = PagedSeq()
        full = length // self.ps
        for page in seq.pages[:full]:
            self.pool.retain(page)
        out.pages, out.length, out.hashed = list(seq.pages[:full]), length, min(seq.hashed, full)
        need = self.pages_for(length + budget) - full
        give = min(need, seq.extra)  # promised when the request was admitted
        seq.extra -= give
        out.reserved = give
        self._promise(out, need - give)
        if length % self.ps:
            src, dst = seq.pages[full] * self.ps, self._take(out) * self.ps
            for k, v in zip(self.k, self.v):
                k[dst : dst + self.ps] = k[src : src + self.ps]
                v[dst : dst + self.ps] = v[src : src + self.ps]
        self.live[id(out)] = out
        return out

    def free(self, seq: PagedSeq, tokens: list[int] | None = None) -> None:
        """Give the pages back; full pages of ``tokens`` stay in the prefix cache."""
        if self.live.pop(id(seq), None) is None:
            return
        if self.prefix_cache and tokens is not None:
            toks, ps = tokens[: seq.length], self.ps
            hashes = chain_hashes(toks, ps)
            parents = [ROOT, *hashes]
            for i in range(seq.hashed, len(hashes)):
                self.pool.register(seq.pages[i], hashes[i], parents[i], toks[i * ps : (i + 1) * ps])
            if len(toks) % ps:
                full = len(hashes)
                self.pool.register_partial(seq.pages[full], parents[full], toks[full * ps :])
        for page in seq.pages:
            self.pool.release(page)
        self.pool.reserved -= seq.reserved + seq.extra
        seq.pages, seq.reserved, seq.extra, seq.length = [], 0, 0, 0
        if self._owner is not None and self._owner[0] == id(seq):
            self._owner = None

    def _slots(self, seq: PagedSeq, start: int, stop: int) -> np.ndarray:
        t = np.arange(start, stop)
        return np.asarray(seq.pages, dtype=np.int64)[t // self.ps] * self.ps + t % self.ps

    # --- running --------------------------------------------------------------------------------

    def _new_caches(self) -> list:
        """One empty contiguous cache per block, in the pool's dtype (a scratch state)."""
        return [
            KVCache(a.max_seq_len, a.num_kv_heads, a.head_dim, kv_dtype(a)) for a in self.layers
        ]

    def _scratch_state(self) -> list:
        if self._scratch is None:
            self._scratch = self._new_caches()
        return self._scratch

    def prefill(self, seq: PagedSeq, ids: list[int]) -> np.ndarray:
        """Run ``ids`` after the cached positions -> logits [V] of the last one."""
        m, st = self.model, self._scratch_state()
        n0 = seq.length
        if self._owner != (id(seq), n0):  # gather the cached positions into the scratch
            slots = self._slots(seq, 0, n0)
            for c, k, v in zip(st, self.k, self.v):
                c.k[:n0], c.v[:n0] = k[slots], v[slots]
        for c in st:
            c.length = n0
        saved = m.swap_state(st)
        try:
            logits = m.forward(ids)
        finally:
            st[:] = m.swap_state(saved)
        n1 = n0 + len(ids)
        self._room(seq, n1)
        slots = self._slots(seq, n0, n1)
        for c, k, v in zip(st, self.k, self.v):
            k[slots], v[slots] = c.k[n0:n1], c.v[n0:n1]
        seq.length, self._owner = n1, (id(seq), n1)
        return logits

    def _prefill_rows(self, seqs: list[PagedSeq], chunks: list[list[int]]) -> np.ndarray | None:
        """Prompts' chunks (at most STEP_ROWS tokens in all) as the rows of one fused paged
        step -> logits [B, V] of each chunk's last token; None when the step does not apply.
        Row (b, i) writes position seqs[b].length + i into its pages before any row attends, and
        reads its earlier positions through its page table: no gather, scatter or Python per
        block (8 cached-prefix prompts of 1-9 new tokens: 67 ms through the reference path)."""
        from poly.runtime import ckernels, fused

        total = sum(len(c) for c in chunks)
        p = fused.plan(self.model)
        if p is None or not 0 < total <= ckernels.STEP_ROWS:
            return None
        for s, ids in zip(seqs, chunks):
            if s.length + len(ids) > self.layers[0].max_seq_len:
                raise GenerationError("context overflow in the paged KV cache")
            self._room(s, s.length + len(ids))
        tables = [np.asarray(s.pages, dtype=np.int32) for s in seqs]
        rows = [
            (b, s.length + i)
            for b, (s, ids) in enumerate(zip(seqs, chunks))
            for i in range(len(ids))
        ]
        ids = np.asarray([t for c in chunks for t in c])
        x = np.ascontiguousarray(self.model.embed(ids), np.float32)  # [total, H] (embedding_scale)
        pools = [(self.k[i], self.v[i]) for i in p.index]
        pos, tabs = tuple(r[1] for r in rows), tuple(tables[r[0]] for r in rows)
        last = np.cumsum([len(c) for c in chunks]) - 1  # each chunk's last row
        reduce = reduce_of(self.model)[0]  # a TP shard's logits are gathered by the caller
        logits = fused.step_paged(p, x, pools, pos, tabs, self.ps, last, reduce)  # [B, V]
        for s, c in zip(seqs, chunks):
            s.length += len(c)
        self._owner = None  # the scratch no longer mirrors any sequence
        return logits

    def prefill_many(self, seqs: list[PagedSeq], chunks: list[list[int]]) -> np.ndarray:
        """Several prompts' next chunks in one pass -> logits [B, V]: up to STEP_ROWS tokens as
        the rows of one fused step; more: each sequence's cached positions gathered into a
        scratch cache of its own, the new ones scattered back."""
        from poly.nn.mha import release_pages

        got = self._prefill_rows(seqs, chunks)
        if got is not None:
            return reduce_of(self.model)[1](got)  # None on a following TP rank

        while len(self._scratches) < len(seqs):
            self._scratches.append(self._new_caches())
        states = self._scratches[: len(seqs)]
        for seq, st in zip(seqs, states):
            n0 = seq.length
            slots = self._slots(seq, 0, n0)
            for c, k, v in zip(st, self.k, self.v):
                c.k[:n0], c.v[:n0], c.length = k[slots], v[slots], n0
        logits = run_batch(self.model, chunks, [list(st) for st in states])
        for seq, st, ids in zip(seqs, states, chunks):
            n0, n1 = seq.length, seq.length + len(ids)
            self._room(seq, n1)
            slots = self._slots(seq, n0, n1)
            for c, k, v in zip(st, self.k, self.v):
                k[slots], v[slots] = c.k[n0:n1], c.v[n0:n1]
                release_pages(c.k), release_pages(c.v)  # the pages hold the KV: no second copy
            seq.length = n1
        return logits

    def decode(self, tokens: list[int], seqs: list[PagedSeq]) -> np.ndarray:
        """One new token per sequence -> logits [B, V]: the fused step over page tables."""
        from poly.runtime import fused

        for s in seqs:
            if s.length >= self.layers[0].max_seq_len:
                raise GenerationError("context overflow in the paged KV cache")
            self._room(s, s.length + 1)
        p = fused.plan(self.model)
        if p is None:  # no C step for this model: one row at a time through the scratch
            rows = [self.prefill(s, [t]) for s, t in zip(seqs, tokens)]
            return None if rows[0] is None else np.stack(rows)  # None: a following TP rank
        x = np.ascontiguousarray(self.model.embed(np.asarray(tokens)), np.float32)
        pools = [(self.k[i], self.v[i]) for i in p.index]
        tables = tuple(np.asarray(s.pages, dtype=np.int32) for s in seqs)
        pos = tuple(s.length for s in seqs)
        reduce, gather = reduce_of(self.model)
        logits = gather(fused.step_paged(p, x, pools, pos, tables, self.ps, reduce=reduce))
        for s in seqs:
            s.length += 1
        return logits

    def verify(self, seq: PagedSeq, ids: list[int]) -> np.ndarray:
        """Logits [n, V] of every one of ``ids`` after the cached positions (speculative
        decoding's check): the rows of one fused paged step, as batched decode rows; one row
        at a time through the scratch without the C step."""
        from poly.runtime import fused

        p = fused.plan(self.model)
        if p is None:
            return np.stack([self.prefill(seq, [t]) for t in ids])
        if seq.length + len(ids) > self.layers[0].max_seq_len:
            raise GenerationError("context overflow in the paged KV cache")
        self._room(seq, seq.length + len(ids))
        x = np.ascontiguousarray(self.model.embed(np.asarray(ids)), np.float32)
        pools = [(self.k[i], self.v[i]) for i in p.index]
        table = np.asarray(seq.pages, dtype=np.int32)
        pos = tuple(range(seq.length, seq.length + len(ids)))
        logits = fused.step_paged(p, x, pools, pos, (table,) * len(ids), self.ps)
        seq.length += len(ids)
        self._owner = None
        return logits

    def set_length(self, seq: PagedSeq, n: int) -> None:
        """Hold the first n positions, n at most the last `verify`'s end (a rejected
        proposal's rows are overwritten later)."""
        seq.length = n
        self._owner = None

    def stats(self) -> dict:
        pool = self.pool
        tokens = sum(s.length for s in self.live.values())
        return {
            "kv_sequences": len(self.live),
            "kv_tokens": tokens,
            "kv_pages_total": pool.n_pages,
            "kv_pages_used": pool.used,
            "kv_pages_cached": len(pool.lru),
            "kv_pages_free": pool.free,
            "kv_page_size": self.ps,
            "kv_bytes_used": pool.used * self.page_bytes,
        }

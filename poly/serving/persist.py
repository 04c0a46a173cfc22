"""A served sequence's KV on disk: out of the paged pool into a state file, and back as prefix
pages (poly/model/state.py's format: the model's identity, checksums, atomic writes).

``export`` gathers the positions of some token ids from the pool's prefix cache (running the
model over the ones it no longer holds) into one contiguous cache per layer; ``install`` writes
such caches into free pages and names them in the prefix cache, so the next prompt that starts
with those ids takes them instead of a prefill. ``DiskPromptCache`` wraps the pool: a prompt of
``min_tokens`` or more is written to ``folder`` once it is prefilled, keyed by the model and a
hash of its ids, and a later request with the same prompt (a restarted server) installs it.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import numpy as np

from poly.errors import ContextOverflowError, PolyError, StateFileError
from poly.model import state as kv_state
from poly.model import state_load

SUFFIX = ".kvstate"


def _pool(kv):
    if not getattr(kv, "paged", False) or not hasattr(kv, "_match"):
        raise StateFileError(
            "saved KV state needs the paged KV pool (this server runs contiguous caches: a "
            "sliding-window model, a q8_0 cache or --kv-pages 0)"
        )
    return kv


def _held(kv, tokens: list[int]) -> tuple[list[int], int]:
    """The pool's kept pages of ``tokens`` -> (page ids, positions they hold, in order)."""
    pages, part = kv._match([*tokens, 0])  # _match keeps the last id out: the sentinel
    n = len(pages) * kv.ps
    if part is not None and part[1] > 0:
        pages = [*pages, part[0]]
        n += part[1]
    return pages, min(n, len(tokens))


def gather(kv, pages: list[int], n: int) -> list:
    """The first n positions of the page list ``pages`` as contiguous caches (copies)."""
    caches = kv._new_caches()
    if n:
        t = np.arange(n)
        slots = np.asarray(pages, dtype=np.int64)[t // kv.ps] * kv.ps + t % kv.ps
        for c, k, v in zip(caches, kv.k, kv.v):
            c.k[:n], c.v[:n] = k[slots], v[slots]
    for c in caches:
        c.length = c.rope_len = n
    return caches


def export(kv, tokens: list[int]) -> list:
    """Contiguous caches [one per layer] holding the KV of ``tokens``: the positions the prefix
    cache still keeps, the rest computed by the model (call with the model's lock held)."""
    kv = _pool(kv)
    pages, n = _held(kv, tokens)
    caches = gather(kv, pages, n)
    if n < len(tokens):  # evicted since: run them again
        m = kv.model
        saved = m.swap_state(caches)
        try:
            m.forward(tokens[n:])
        finally:
            caches[:] = m.swap_state(saved)
    return caches


def install(kv, tokens: list[int], caches: list) -> int:
    """Write ``caches`` (holding ``tokens``) into free pages named in the prefix cache; the
    positions installed (0 when the pool cannot spare the pages now)."""
    from poly.serving.paged import PagedSeq

    kv = _pool(kv)
    n = len(tokens)
    if n == 0 or kv.pages_for(n) > kv.pool.available:
        return 0
    seq = PagedSeq()
    kv.live[id(seq)] = seq
    kv._room(seq, n)
    slots = kv._slots(seq, 0, n)
    for c, k, v in zip(caches, kv.k, kv.v):
        k[slots], v[slots] = c.k[:n], c.v[:n]
    seq.length = n
    kv.free(seq, tokens)  # registered, then unreferenced: kept until evicted
    return n


def drop(kv, tokens: list[int]) -> int:
    """Forget the kept, unreferenced pages of ``tokens`` (a slot's erase); positions dropped."""
    kv = _pool(kv)
    pages, n = _held(kv, tokens)
    pool, gone = kv.pool, 0
    for page in reversed(pages):  # the deepest first: a shared prefix page may be in use
        if pool.ref[page] != 0 or page not in pool.lru:
            break
        pool.lru.move_to_end(page, last=False)  # evicted next
        pool.recycled.append(pool._evict())
        gone += 1
    return min(n, gone * kv.ps)


def save(kv, path, tokens: list[int], meta: dict | None = None) -> int:
    """``tokens``' KV into the state file ``path`` (atomic) -> bytes written."""
    caches = export(kv, tokens)
    return kv_state.save(kv.model, path, tokens, meta, caches=caches)


def restore(kv, path) -> tuple[list[int], int]:
    """The state file ``path`` into the pool's prefix cache -> (its tokens, bytes read)."""
    kv = _pool(kv)
    caches, saved = state_load.read(kv.model, path)
    if saved.tokens is None:
        raise StateFileError("the state file holds no token ids (saved without them)")
    if len(saved.tokens) >= kv.layers[0].max_seq_len:
        raise ContextOverflowError("the saved state fills this server's whole context")
    if saved.tokens and install(kv, saved.tokens, caches) == 0:
        raise ContextOverflowError("the KV pool has no room for the saved state now")
    return saved.tokens, os.path.getsize(path)


def clean(folder) -> None:
    """Remove the temporary files of writes a killed process left (poly.model.state's names)."""
    for p in Path(folder).glob(".*" + SUFFIX + ".tmp-*"):
        p.unlink(missing_ok=True)


def prompt_key(model_id: str, tokens) -> str:
    h = hashlib.blake2b(model_id.encode(), digest_size=20)
    h.update(np.asarray(tokens, dtype=np.int32).tobytes())
    return h.hexdigest()


class DiskPromptCache:
    """The scheduler's KV store (a ``PagedKV``) plus prompts kept on disk: every operation is the
    pool's, except that ``reserve`` first installs a stored prompt and a prompt's end of prefill
    stores it (in a background thread, oldest files evicted past ``max_bytes``)."""

    def __init__(self, kv, folder, model_id: str, min_tokens: int = 256, max_bytes: int = 1 << 30):
        self.kv = _pool(kv)
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.model_id, self.min_tokens, self.max_bytes = model_id, int(min_tokens), int(max_bytes)
        self.pending: dict[int, list[int]] = {}  # id(seq) -> its prompt, until prefilled
        self.loaded = self.stored = 0  # prompts read from disk / written
        self._writes: list[threading.Thread] = []
        kv_state.identity(kv.model)  # the weights' digest, once, before any writer thread

    def __getattr__(self, name):  # everything else is the pool's
        return getattr(self.kv, name)

    def path(self, tokens) -> Path:
        return self.folder / (prompt_key(self.model_id, tokens) + SUFFIX)

    def reserve(self, prompt: list[int], budget: int, n: int):
        if len(prompt) >= self.min_tokens:
            self._load(prompt)
        got = self.kv.reserve(prompt, budget, n)
        if got is not None and len(prompt) >= self.min_tokens and got[1] < len(prompt) - 1:
            self.pending[id(got[0])] = list(prompt)
        return got

    def _load(self, prompt: list[int]) -> None:
        path = self.path(prompt)
        if not path.is_file() or _held(self.kv, prompt)[1] >= len(prompt) - 1:
            return
        try:
            caches, saved = state_load.read(self.kv.model, path)
        except PolyError:
            path.unlink(missing_ok=True)  # damaged or another model's: prefill instead
            return
        if saved.tokens == list(prompt) and install(self.kv, saved.tokens, caches):
            self.loaded += 1
            os.utime(path)  # recently used: evicted last

    def prefill(self, seq, ids):
        out = self.kv.prefill(seq, ids)
        self._check([seq])
        return out

    def prefill_many(self, seqs, chunks):
        out = self.kv.prefill_many(seqs, chunks)
        self._check(seqs)
        return out

    def free(self, seq, tokens=None):
        self.pending.pop(id(seq), None)
        self.kv.free(seq, tokens)

    def _check(self, seqs) -> None:
        for seq in seqs:
            prompt = self.pending.get(id(seq))
            if prompt is None or seq.length < len(prompt):
                continue
            del self.pending[id(seq)]
            path = self.path(prompt)
            if path.is_file():
                os.utime(path)
                continue
            caches = gather(self.kv, seq.pages, len(prompt))  # copied: the sequence goes on
            # not a daemon: the interpreter waits for a write under way at exit
            t = threading.Thread(target=self._store, args=(path, prompt, caches))
            self._writes = [w for w in self._writes if w.is_alive()] + [t]
            t.start()

    def _store(self, path: Path, prompt: list[int], caches: list) -> None:
        try:
            kv_state.save(self.kv.model, path, prompt, caches=caches)
        except PolyError:
            return  # a full disk costs the cache, never a request
        self.stored += 1
        self._evict()

    def _evict(self) -> None:
        files = []
        for p in self.folder.glob("*" + SUFFIX):
            try:
                st = p.stat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, p))
        total = sum(f[1] for f in files)
        for _, size, p in sorted(files):
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for the writes under way (shutdown)."""
        for t in self._writes:
            t.join(timeout)

    def stats(self) -> dict:
        out = self.kv.stats()
        out["prompt_cache_loaded"], out["prompt_cache_stored"] = self.loaded, self.stored
        return out

"""A scheduler's KV store over tensor-parallel ranks: rank 0 leads, the others mirror it.

Rank 0 runs the scheduler on its shard with a `LeadKV` around its own KV store; every call that
runs the model or changes the store (reserve, fork, free, prefill, prefill_many, decode) is first
broadcast (a small JSON message: the op, sequence ids, token ids), then run. Each other rank
runs `follow` on a store of the same shape over its own KV heads: the same calls in the same
order, so its page pool makes the same choices (prefix hits, evictions) and its sequences stay at
rank 0's positions; the logits are gathered to rank 0 only.

Nothing may wait forever on a dead rank: every collective is bounded (`MPIComm.timeout`), an idle
leader sends a heartbeat (a broadcast and a barrier) every `BEAT` seconds so that a follower
notices a dead leader and the leader a dead follower, and a watchdog thread on rank 0 checks the
processes of the ranks on its own machine every `POLL` seconds. A loss is a PeerLostError from
then on, and `on_lost(reason)` is called once.
"""

from __future__ import annotations

import os
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from poly.errors import PeerLostError, PolyError, TensorParallelError

# seconds one collective of a step may wait for the slowest rank (POLY_TP_TIMEOUT overrides)
STEP_TIMEOUT = float(os.environ.get("POLY_TP_TIMEOUT", "") or 10.0)
IDLE_TIMEOUT = 15.0  # seconds a follower waits for rank 0's next message (heartbeats included)
BEAT = 1.0  # seconds between an idle leader's heartbeats
POLL = 0.25  # seconds between the watchdog's looks at the local ranks' processes


def peers(comm) -> list[tuple[int, bool]]:
    """(pid, on this machine) of every rank, from one all-reduce every rank makes."""
    mine = np.zeros((comm.size, 2), dtype=np.float64)  # [rank, (pid, crc32 of the host name)]
    mine[comm.rank] = os.getpid(), zlib.crc32(os.uname().nodename.encode())
    comm.allreduce(mine)
    host = mine[comm.rank, 1]
    return [(int(pid), h == host) for pid, h in mine.tolist()]


def _gone(pid: int) -> bool:
    """Whether process `pid` (of this machine) has died: absent, or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


class LeadKV:
    """Rank 0's KV store: `inner`'s calls mirrored on the other ranks (see the module)."""

    def __init__(self, inner: Any, comm: Any, on_lost: Callable[[str], None] | None = None):
        self.inner, self.comm, self.on_lost = inner, comm, on_lost
        self.lost: str | None = None
        self._ids: dict[int, int] = {}  # id(sequence object) -> the id the followers know
        self._next = 0
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._stopped = threading.Event()
        self._peers = peers(comm)
        comm.timeout = STEP_TIMEOUT
        self._watch = threading.Thread(target=self._watchdog, name="poly-tp-watchdog", daemon=True)
        self._watch.start()

    # what the scheduler, the metrics and the memory check read; any other call (a new store
    # method) would run on rank 0 alone and is refused until it is mirrored
    READ = frozenset({"paged", "ps", "pool", "page_bytes", "stats", "check", "pages_for",
                      "live", "model", "layers"})  # fmt: skip

    def __getattr__(self, name: str) -> Any:
        if name not in LeadKV.READ:
            raise AttributeError(f"{name!r} of the KV store is not mirrored over the TP ranks")
        return getattr(self.inner, name)

    # --- mirrored calls -------------------------------------------------------------------------

    def _call(self, msg: list, run: Callable[[], Any]) -> Any:
        with self._lock:
            if self.lost is not None:
                raise PeerLostError(self.lost)
            try:
                self.comm.bcast(msg)
                return run()
            except PeerLostError as err:
                self._lose(str(err))
                raise
            finally:
                self._last = time.monotonic()

    def _sid(self, seq: Any) -> int:
        return self._ids[id(seq)]

    def _new_sid(self, seq: Any) -> int:
        self._next += 1
        self._ids[id(seq)] = self._next
        return self._next

    def reserve(self, prompt: list[int], budget: int, n: int):
        with self._lock:  # no message when nothing is reserved (the others would agree)
            got = self.inner.reserve(prompt, budget, n)
            if got is None:
                return None
            sid = self._new_sid(got[0])
        self._call(["reserve", sid, list(prompt), budget, n, got[1]], lambda: None)
        return got

    def fork(self, seq: Any, length: int, budget: int = 0):
        with self._lock:
            out = self.inner.fork(seq, length, budget)
            sid = self._new_sid(out)
        self._call(["fork", self._sid(seq), sid, length, budget], lambda: None)
        return out

    def free(self, seq: Any, tokens=None) -> None:
        """Never raises: the scheduler frees while it fails requests after a loss."""
        sid = self._ids.pop(id(seq), None)
        if sid is None or self.lost is not None:
            self.inner.free(seq, tokens)
            return
        toks = None if tokens is None else list(tokens)
        try:
            self._call(["free", sid, toks], lambda: self.inner.free(seq, tokens))
        except PeerLostError:
            self.inner.free(seq, tokens)

    def prefill(self, seq: Any, ids: list[int]):
        msg = ["prefill", self._sid(seq), list(ids)]
        return self._call(msg, lambda: self.inner.prefill(seq, ids))

    def prefill_many(self, seqs: list, chunks: list[list[int]]):
        msg = ["prefill_many", [self._sid(s) for s in seqs], [list(c) for c in chunks]]
        return self._call(msg, lambda: self.inner.prefill_many(seqs, chunks))

    def decode(self, tokens: list[int], seqs: list):
        msg = ["decode", [int(t) for t in tokens], [self._sid(s) for s in seqs]]
        return self._call(msg, lambda: self.inner.decode(tokens, seqs))

    def warm(self) -> None:
        """A throwaway sequence through every kind of collective before any client comes:
        MPICH sets some of them up on first use, and a rank dying during that set-up took rank 0
        down with it (hydra's SIGKILL) before it could answer the 503."""
        got = self.reserve([0, 0], 2, 1)
        if got is None:
            return
        try:
            self.prefill(got[0], [0, 0])
            self.decode([0], [got[0]])
        finally:
            self.free(got[0])  # without its tokens: nothing enters the prefix cache
        self._call(["ping"], self.comm.barrier)

    # --- liveness --------------------------------------------------------------------------------

    def _lose(self, reason: str) -> None:
        first = self.lost is None
        self.lost = self.comm.lost = self.lost or reason
        if first and self.on_lost is not None:
            self.on_lost(self.lost)

    def rank_lost(self) -> str | None:
        """Look now for a dead rank on this machine -> why a rank is lost (None: none is)."""
        if self.lost is None:
            dead = [r for r, (pid, local) in enumerate(self._peers) if r and local and _gone(pid)]
            if dead:
                size = self.comm.size
                self._lose(f"rank {dead[0]} of {size} (pid {self._peers[dead[0]][0]}) is gone")
        return self.lost

    def _watchdog(self) -> None:
        while not self._stopped.wait(POLL):
            if self.rank_lost() is not None:
                return
            if time.monotonic() - self._last >= BEAT and self._lock.acquire(blocking=False):
                try:
                    self.comm.bcast(["ping"])
                    self.comm.barrier()
                except PeerLostError as err:
                    self._lose(str(err))
                finally:
                    self._last = time.monotonic()
                    self._lock.release()

    def finish(self) -> None:
        """Release the followers (their `follow` returns) and stop the watchdog."""
        self._stopped.set()
        self._watch.join()
        with self._lock:
            if self.lost is None:
                try:
                    self.comm.bcast(["stop"])
                except PeerLostError as err:
                    self._lose(str(err))


def follow(kv: Any, comm: Any) -> int:
    """A follower's loop: rank 0's calls on this rank's store `kv` until rank 0 stops; returns
    the number of calls. PeerLostError when rank 0 goes silent or a collective times out."""
    seqs: dict[int, Any] = {}
    count = 0
    while True:
        comm.timeout = IDLE_TIMEOUT
        msg = comm.bcast(None)
        comm.timeout = STEP_TIMEOUT
        op, args = msg[0], msg[1:]
        if op == "stop":
            return count
        if op == "ping":
            comm.barrier()
            continue
        try:
            _replay(kv, seqs, op, args)
        except PeerLostError:
            raise
        except PolyError:
            pass  # rank 0 met the same error on the same call and fails those requests
        count += 1


def _replay(kv: Any, seqs: dict[int, Any], op: str, args: list) -> None:
    if op == "reserve":
        sid, prompt, budget, n, cached = args
        got = kv.reserve(prompt, budget, n)
        if got is None or got[1] != cached:
            raise TensorParallelError(f"the KV store of rank {kv_rank(kv)} diverged from rank 0's")
        seqs[sid] = got[0]
    elif op == "fork":
        src, sid, length, budget = args
        seqs[sid] = kv.fork(seqs[src], length, budget)
    elif op == "free":
        kv.free(seqs.pop(args[0]), args[1])
    elif op == "prefill":
        kv.prefill(seqs[args[0]], args[1])
    elif op == "prefill_many":
        kv.prefill_many([seqs[s] for s in args[0]], args[1])
    elif op == "decode":
        kv.decode(args[0], [seqs[s] for s in args[1]])
    else:
        raise TensorParallelError(f"rank 0 announced an unknown KV call {op!r}")


def kv_rank(kv: Any) -> int:
    return int(getattr(getattr(kv.model, "comm", None), "rank", 0))


def shape_of(kv: Any) -> dict:
    """What a follower needs to build a store of the same shape as rank 0's `kv`."""
    if not getattr(kv, "paged", False):
        return {"paged": False}
    pool = kv.pool
    return {"paged": True, "pages": pool.n_pages, "ps": kv.ps, "cached": pool.cache_pages}


def build_like(model: Any, shape: dict) -> Any:
    """A follower's store: rank 0's `shape_of` over this rank's KV heads."""
    from poly.serving.kv import ContiguousKV
    from poly.serving.paged import PagedKV

    if not shape["paged"]:
        return ContiguousKV(model)
    kv = PagedKV(model, shape["pages"], shape["ps"])
    kv.pool.cache_pages = shape["cached"]  # rank 0's count (its pages hold more KV heads)
    return kv

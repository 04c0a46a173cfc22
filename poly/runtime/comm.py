"""Communicators: what tensor parallelism needs from the processes that share one model.

`Communicator` is the interface (rank, size, in-place all-reduce sum, all-gather of row blocks,
broadcast of small objects, barrier). `SingleProcess` is the default: one rank, every call a
no-op, and importing it imports nothing beyond numpy. `MPIComm` runs the same calls on MPI
through mpi4py: uppercase buffer calls on the numpy arrays themselves (no copies, no pickling of
activations) with `Allreduce(IN_PLACE, ...)`; `bcast` sends small JSON values (token ids,
prompts), never pickles.

Launch MPI jobs with `mpiexec -n N python -m mpi4py ...`: an exception on one rank then ends
the whole job through MPI_Abort instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, Protocol

import numpy as np

from poly.errors import LayerConfigError, PeerLostError


class Communicator(Protocol):
    rank: int
    size: int

    def allreduce(self, buf: np.ndarray) -> None:
        """Sum a C-contiguous float32 array over the ranks, in place."""

    def allgather_cols(self, local: np.ndarray, counts: tuple[int, ...]) -> np.ndarray:
        """[n, counts[rank]] float32 on every rank -> [n, sum(counts)], rank r's columns r-th."""

    def gather_cols(self, local: np.ndarray, counts: tuple[int, ...]) -> np.ndarray | None:
        """Like `allgather_cols`, the result on rank 0 only (None elsewhere)."""

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """`obj` of `root` on every rank (small JSON values: ids, text, None)."""

    def barrier(self) -> None: ...

    def local_size(self) -> int:
        """Ranks on this machine."""

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now (exit code `code`)."""


class Stats:
    """Time spent in the collectives of the decode path (seconds, calls)."""

    def __init__(self) -> None:
        self.reduce_s = self.gather_s = 0.0
        self.reduces = self.gathers = 0

    def reset(self) -> None:
        self.__init__()


class SingleProcess:
    """One process holds the whole model: every collective is the identity."""

    rank = 0
    size = 1

    def __init__(self) -> None:
        self.stats = Stats()

    def allreduce(self, buf: np.ndarray) -> None:
        return None

    def allgather_cols(self, local: np.ndarray, counts: tuple[int, ...]) -> np.ndarray:
        return local

    def gather_cols(self, local: np.ndarray, counts: tuple[int, ...]) -> np.ndarray:
        return local

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        return None

    def local_size(self) -> int:
        return 1

    def abort(self, code: int = 1) -> None:
        raise SystemExit(code)


_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _check_buffer(buf: np.ndarray) -> None:
    if not (isinstance(buf, np.ndarray) and buf.dtype in _FLOATS and buf.flags.c_contiguous):
        raise LayerConfigError("collectives take C-contiguous float32/float64 arrays")


class MPIComm:
    """A communicator over an mpi4py communicator (COMM_WORLD by default).

    `timeout` (seconds, None: wait forever) bounds every collective: each then runs as its
    non-blocking form, polled until done, and raises PeerLostError past the deadline (a dead
    peer never completes a collective: a server must not hang on one). A watchdog may set
    `lost` (a reason): every wait then raises at once."""

    timeout: float | None = None
    lost: str | None = None

    def __init__(self, comm: Any = None) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self._c = MPI.COMM_WORLD if comm is None else comm
        self.rank = int(self._c.Get_rank())
        self.size = int(self._c.Get_size())
        self.stats = Stats()
        self._local: int | None = None

    def allreduce(self, buf: np.ndarray) -> None:
        _check_buffer(buf)
        t0 = time.perf_counter()
        if self._bounded():
            self._wait(self._c.Iallreduce(self._MPI.IN_PLACE, buf, op=self._MPI.SUM), "all-reduce")
        else:
            self._c.Allreduce(self._MPI.IN_PLACE, buf, op=self._MPI.SUM)
        self.stats.reduce_s += time.perf_counter() - t0
        self.stats.reduces += 1

    def allgather_cols(self, local: np.ndarray, counts: tuple[int, ...]) -> np.ndarray:
        return self._gather(local, counts, True)

    def gather_cols(self, local: np.ndarray, counts: tuple[int, ...]) -> np.ndarray | None:
        return self._gather(local, counts, False)

    def _gather(self, local: np.ndarray, counts: tuple[int, ...], to_all: bool):
        _check_buffer(local)
        n = local.shape[0]
        if len(counts) != self.size or local.shape != (n, counts[self.rank]):
            raise LayerConfigError(f"gather of columns: {local.shape} does not match {counts}")
        t0 = time.perf_counter()
        sizes = [n * c for c in counts]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
        flat = np.empty(sum(sizes), dtype=local.dtype)
        kind = self._MPI.FLOAT if local.dtype == np.float32 else self._MPI.DOUBLE
        spec = [flat, sizes, starts, kind]
        if to_all and self._bounded():
            self._wait(self._c.Iallgatherv(local, spec), "all-gather")
        elif to_all:
            self._c.Allgatherv(local, spec)
        else:  # rank 0 alone samples: 1/size of the traffic, no copy on the others
            got = spec if self.rank == 0 else None
            if self._bounded():
                self._wait(self._c.Igatherv(local, got, root=0), "gather")
            else:
                self._c.Gatherv(local, got, root=0)
            if self.rank:
                self.stats.gather_s += time.perf_counter() - t0
                self.stats.gathers += 1
                return None
        if n == 1:
            out = flat.reshape(1, -1)
        else:  # rank blocks [n, c_r] side by side
            out = np.empty((n, sum(counts)), dtype=local.dtype)
            col = 0
            for c, s in zip(counts, starts):
                out[:, col : col + c] = flat[s : s + n * c].reshape(n, c)
                col += c
        self.stats.gather_s += time.perf_counter() - t0
        self.stats.gathers += 1
        return out

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """JSON, not pickle: a length then the bytes, as two buffer broadcasts."""
        data = json.dumps(obj).encode() if self.rank == root else b""
        n = np.array([len(data)], dtype=np.int64)
        self._bcast(n, root)
        buf = (
            np.frombuffer(data, np.uint8).copy() if self.rank == root else np.empty(n[0], np.uint8)
        )
        self._bcast(buf, root)
        return obj if self.rank == root else json.loads(buf.tobytes())

    def _bcast(self, buf: np.ndarray, root: int) -> None:
        if self._bounded():
            self._wait(self._c.Ibcast(buf, root=root), "broadcast")
        else:
            self._c.Bcast(buf, root=root)

    def barrier(self) -> None:
        if self._bounded():
            self._wait(self._c.Ibarrier(), "barrier")
        else:
            self._c.Barrier()

    def _bounded(self) -> bool:
        return self.timeout is not None or self.lost is not None

    def _wait(self, req: Any, what: str) -> None:
        """Poll `req` until done: spin briefly (an all-reduce of a decode step takes
        microseconds), then sleep between polls so the other threads get the GIL."""
        if self.lost is not None:
            raise PeerLostError(self.lost)
        deadline = time.monotonic() + (self.timeout if self.timeout is not None else math.inf)
        spins = 0
        while not req.Test():
            spins += 1
            if spins < 200:
                continue
            if self.lost is not None:
                raise PeerLostError(self.lost)
            if time.monotonic() > deadline:
                self.lost = (f"rank {self.rank} of {self.size}: a {what} waited more than "
                             f"{self.timeout:g} s for the other ranks")  # fmt: skip
                raise PeerLostError(self.lost)
            time.sleep(0.0002 if spins < 5000 else 0.002)

    def local_size(self) -> int:
        """Ranks on this machine (they share its cores)."""
        if self._local is None:
            node = self._c.Split_type(self._MPI.COMM_TYPE_SHARED)
            self._local = int(node.Get_size())
            node.Free()
        return self._local

    def abort(self, code: int = 1) -> None:
        self._c.Abort(code)


def world() -> Communicator:
    """MPIComm over COMM_WORLD when mpi4py is importable and the job has more than one rank
    (or MPI is already initialized), else SingleProcess. Never initializes MPI by itself when
    mpi4py is absent."""
    try:
        from mpi4py import MPI
    except ImportError:
        return SingleProcess()
    comm = MPIComm(MPI.COMM_WORLD)
    return comm if comm.size > 1 else SingleProcess()

"""`--tp N` of `lucy generate|chat|bench`: the command runs on rank 0 of an MPI job, on its
tensor-parallel shard, while the other ranks follow (poly.runtime.lockstep).

    mpiexec -n 2 python -m mpi4py -m lucy generate MODEL --tp 2 --prompt "..."

Every rank loads its own shard; rank 0 reads the input, tokenizes, samples and prints. An error
on any rank is one line naming the rank, and its non-zero exit ends the whole job (mpi4py turns
it into MPI_Abort).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from poly.errors import PolyError, TensorParallelError, UsageError

LAUNCH = "mpiexec -n {n} python -m mpi4py -m lucy ... --tp {n}"


def world_of(n: int, spec: str | None = None):
    """The MPI world as a communicator, checked against --tp and across the ranks (--tp, model
    `spec`): a one-line UsageError, the same on every rank."""
    if n < 1:
        raise UsageError(f"--tp must be >= 1, got {n}")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        if n == 1:
            from poly.runtime.comm import SingleProcess

            return SingleProcess()
        raise UsageError("--tp needs mpi4py and an MPI: pip install 'polyloom[mpi]'") from None
    from poly.runtime.comm import world

    comm = world()
    problem = _disagreement(comm, n, spec)
    if problem is None and comm.size != n:
        problem = (f"--tp {n} does not match the MPI world of {comm.size} process(es); "
                   f"launch: {LAUNCH.format(n=n)}")  # fmt: skip
    if problem is not None:
        if comm.rank:  # every rank fails alike: rank 0's line is the one shown, and its
            comm.barrier()  # exit (MPI_Abort) ends the others waiting here
        raise UsageError(problem)
    return comm


def _disagreement(comm, n: int, spec: str | None) -> str | None:
    """One collective every rank makes before any work: each one's --tp and model, so ranks
    started with different ones all fail with one line (before, rank 0 went on loading while
    the others waited in a barrier: the job spun forever)."""
    import zlib

    import numpy as np

    if comm.size == 1:
        return None
    mine = np.zeros((comm.size, 2), dtype=np.float64)  # [rank, (--tp, crc32 of the model)]
    mine[comm.rank] = n, zlib.crc32((spec or "").encode())
    comm.allreduce(mine)  # each row is one rank's: the sum is everyone's
    tps, models = mine[:, 0].astype(int).tolist(), set(mine[:, 1].tolist())
    if len(set(tps)) > 1:
        each = ", ".join(f"rank {r} --tp {t}" for r, t in enumerate(tps))
        return f"the ranks disagree on --tp ({each}); launch: {LAUNCH.format(n=comm.size)}"
    if len(models) > 1:
        return "the ranks were given different models; launch every rank with the same one"
    return None


def set_rank_threads(comm) -> int:
    """Each rank's share of this machine's cores (POLY_NUM_THREADS wins)."""
    from poly.runtime import kernels

    if os.environ.get("POLY_NUM_THREADS"):
        return kernels.set_num_threads()
    return kernels.set_num_threads(max(1, kernels.physical_cores() // comm.local_size()))


def rank_error(comm, err: BaseException) -> PolyError:
    where = f"rank {comm.rank} of {comm.size}"
    if isinstance(err, PolyError):
        err.message = f"{where}: {err.message}"
        err.args = (err.message,)
        return err
    out = TensorParallelError(f"{where}: {type(err).__name__}: {err}")
    out.exit_code = 1
    return out


def run(tp: int, spec: str, body: Callable[[Any, dict], int], kv_cache: str | None = None) -> int:
    """Load `spec` sharded over the world; rank 0 runs `body(model, info)`, the others follow.
    info: load_s, tp, threads. kv_cache: every rank's KV caches ("f16": half the memory)."""
    import entity
    from poly.runtime import lockstep

    comm = world_of(tp, spec)
    try:
        threads = set_rank_threads(comm)
        t0 = time.perf_counter()
        model = entity.load(spec, tp=comm, lockstep=True)
        if kv_cache is not None:  # before lockstep: each rank sets its own shard's caches
            model.kv_cache_dtype = kv_cache
        info = {"load_s": time.perf_counter() - t0, "tp": comm.size, "threads": threads}
        if comm.rank != 0:
            lockstep.follow(model)
            return 0
        code = body(lockstep.lead(model), info)
        lockstep.finish(model)
        return code
    except (PolyError, Exception) as err:
        if comm.size == 1:
            raise
        raise rank_error(comm, err) from err


def bench_extras(model, new_tokens: int) -> dict:
    """Per-rank peak RSS, and the collectives' time per decoded token (a short greedy run),
    plus the bare latency of one all-reduce of the model width."""
    import numpy as np

    comm = getattr(model, "comm", None)
    if comm is None:
        return {"tp": 1}
    out: dict = {"tp": comm.size, "peak_rss_mb_per_rank": model.rank_values()}
    model.reset()
    logits = model.forward([1, 2, 3, 4])
    comm.stats.reset()
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        logits = model.forward([int(np.argmax(logits))])
    dt = time.perf_counter() - t0
    st = comm.stats
    out["decode_ms_per_token"] = 1e3 * dt / new_tokens
    out["allreduce_ms_per_token"] = 1e3 * st.reduce_s / new_tokens
    out["allreduces_per_token"] = st.reduces / new_tokens
    out["gather_ms_per_token"] = 1e3 * st.gather_s / new_tokens
    model.reset()
    return out

"""Driving a tensor-parallel model from rank 0 only.

Rank 0 runs ordinary code (a chat loop, `stream`, a benchmark) on its `TPTransformer` after
`lead(model)`; every other rank calls `follow(model)`, which replays each collective call rank
0 makes (announced by a small JSON broadcast: the op and its token ids) until rank 0 calls
`finish(model)`. Rank 0 alone tokenizes, samples and prints; the chosen token reaches the other
ranks as the ids of the next `forward`, so the ranks never diverge.

An exception on any rank must end the job: run under `python -m mpi4py` (MPI_Abort on an
unhandled exception or a non-zero exit), since the other ranks would wait in a collective.
"""

from __future__ import annotations

from typing import Any

from poly.errors import TensorParallelError

OPS = frozenset({"forward", "forward_all", "forward_batch", "reset", "truncate", "rank_values"})


def lead(model: Any) -> Any:
    """Make rank 0's model announce its collective calls; returns the model."""
    if getattr(model, "comm", None) is None:
        return model  # one process: nothing to lead
    if model.comm.rank != 0:
        raise TensorParallelError(f"rank {model.comm.rank} cannot lead: rank 0 leads")
    model.leading = True
    return model


def finish(model: Any) -> None:
    """Release the following ranks (their `follow` returns)."""
    if getattr(model, "leading", False):
        model.comm.bcast(["stop"])
        model.leading = False


def follow(model: Any) -> int:
    """Replay rank 0's calls until it finishes; returns the number of calls replayed."""
    count = 0
    model.following = True  # logits are gathered on rank 0 only
    try:
        while True:
            msg = model.comm.bcast(None)
            op, args = msg[0], msg[1:]
            if op == "stop":
                return count
            if op not in OPS:
                raise TensorParallelError(f"rank 0 announced an unknown call {op!r}")
            getattr(model, op)(*args)
            count += 1
    finally:
        model.following = False

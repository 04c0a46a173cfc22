"""The model calls of the KV stores, for a whole model or a tensor-parallel shard."""

from __future__ import annotations

import numpy as np

from poly.runtime.batch import forward_batch


def run_batch(model, chunks: list[list[int]], states: list[list]) -> np.ndarray | None:
    """forward_batch on `model`; a tensor-parallel shard runs its own (all-reduces between the
    blocks; the logits on rank 0 only, None elsewhere)."""
    if getattr(model, "comm", None) is not None:
        return model.forward_batch(chunks, states)
    return forward_batch(model, chunks, states)


def reduce_of(model):
    """(all-reduce for the fused step, gather of its local logits) of a tensor-parallel shard,
    or (None, identity) for a whole model."""
    comm = getattr(model, "comm", None)
    if comm is None:
        return None, lambda logits: logits
    return comm.allreduce, model._gather

"""The execution engine above the model: backends (numpy / C / numba) and their kernels, the
C binding, the fused decode step, batched decode, the thread tuner, and the dispatch that
picks the fused or the reference path. Importing it installs the model's "forward" and
"forward_batch" hooks (poly.model.hooks) and the backend's numeric hooks (poly.ops)."""

from poly.model.hooks import provide
from poly.runtime import batch, dispatch, kernels

provide("forward", dispatch.forward)
provide("forward_batch", batch.forward_batch)

__all__ = ["batch", "dispatch", "kernels"]

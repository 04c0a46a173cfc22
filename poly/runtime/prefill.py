"""Prefill threads that follow the machine's load: one `PrefillTuner` per model.

`pacing(model, tokens)` wraps a multi-token forward: before each block it sets the C and BLAS thread
count the tuner picked (`poly.runtime.kernels.use_threads`), after it records the block's time; at the
end the configured count is back in force. `fused_threads`: the count of a prompt's fused calls.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from poly.runtime import kernels
from poly.runtime.threadtune import SHARED, PrefillPace, PrefillTuner, adaptive, room_for


class _Pacer:
    def __init__(self, pace: PrefillPace) -> None:
        self.pace, self.active, self.t0, self.n = pace, kernels.num_threads(), 0.0, 0

    def before(self, i: int) -> None:
        n = self.pace.threads(i)
        if n != self.active:
            kernels.use_threads(n)
            self.active = n
        self.t0, self.n = time.perf_counter(), n

    def after(self, i: int) -> None:
        self.pace.record(i, self.n, time.perf_counter() - self.t0)


@contextmanager
def pacing(model, tokens: int = 1) -> Iterator[_Pacer]:
    full = kernels.num_threads()
    tuner = getattr(model, "prefill_tuner", None)
    if tuner is None:
        tuner = model.prefill_tuner = PrefillTuner(SHARED)
    pacer = _Pacer(tuner.begin(full, tokens))
    try:
        yield pacer
    finally:
        pacer.pace.end()
        if pacer.active != full:
            kernels.use_threads(full)


def fused_threads(full: int) -> int:
    """Threads for a prompt's fused calls (poly/runtime/fused.py): what the tuners found (no
    trial of its own), checked against the machine's load now."""
    nt = SHARED.advice(full)
    if full <= 1 or not adaptive():
        return nt
    room = room_for(full)
    if nt < full and room:
        # the finding is stale: nothing else runs now (a benchmark worker whose first decode
        # window met another process's spinning threads kept every later prompt on one thread)
        return full
    if nt == full and not room:
        # other processes hold the cores: all threads would wait at every barrier (many times
        # slower than one thread fewer; results-first-turn-*.json); the decode tuner follows
        nt = full - 1
        SHARED.found(full, nt)
    return nt

"""Seconds per phase of opening a model (issue 62): parse, tokenizer, repack, first forward.

Off unless ``POLY_PROFILE_OPEN`` is set (or `enable()` is called): then `phase` adds each
timed block's wall seconds to `PHASES` under its name. The library never prints them; a
caller (benchmarks/open_time.py) reads `PHASES`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

ENABLED = bool(os.environ.get("POLY_PROFILE_OPEN"))
PHASES: dict[str, float] = {}


def enable(on: bool = True) -> None:
    global ENABLED
    ENABLED = on


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block under `name` (nested phases count in both)."""
    if not ENABLED:
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        PHASES[name] = PHASES.get(name, 0.0) + time.perf_counter() - t0

"""Speculative checks' thread tuning: checks of varying row counts share their thread trials."""

from __future__ import annotations

import numpy as np

from poly.runtime import fused, kernels
from poly.runtime.dispatch import forward_rows
from tests.tiny_model import random_transformer, tiny_cfg


def test_checks_of_nearby_row_counts_share_one_thread_tuner(monkeypatch):
    """Adaptive proposals vary a check's rows pass to pass; a thread tuner per row count ran a
    trial window on fewer threads for each new count (most checks of a short stream). Checks of
    5..8 rows share one tuner, 3-4 another; the logits stay those of one-token steps."""
    monkeypatch.setenv("POLY_ADAPTIVE_THREADS", "1")
    old = kernels.num_threads()
    kernels.set_num_threads(2)
    try:
        model = random_transformer(tiny_cfg(max_seq_len=128), seed=3)
        p = fused.plan(model)
        assert p is not None  # the fused step applies (C backend, float32)
        model.forward([5, 9, 14, 2])
        base = model.position
        ids = np.asarray([7, 11, 3, 8, 21, 4, 9, 13], dtype=np.int64)
        for n in (5, 6, 7, 8, 3, 4, 8, 5):
            rows = forward_rows(model, ids[:n])
            model.truncate(base)
            steps = [model.forward([int(t)]) for t in ids[:n]]
            model.truncate(base)
            np.testing.assert_allclose(rows, np.stack(steps), rtol=1e-4, atol=1e-4)
        checks = [key for key in p.tuners if key != 1]  # 1: the one-token steps' tuner
        assert len(checks) == 2, sorted(p.tuners, key=str)  # was one per row count: 6
    finally:
        kernels.set_num_threads(old)

"""Fuzz-suite setup: one kernel thread (tiny matrices; a parallel pool only spins on 2 shared cores)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package", autouse=True)
def _one_kernel_thread():
    from poly.runtime import kernels

    kernels.set_num_threads(1)
    yield
    kernels.set_num_threads(None)

"""poly/runtime/heap.py: large temporaries are not page-faulted in again on every pass."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import resource, numpy as np
import poly.runtime.ckernels  # sets the thresholds at import (unless POLY_MALLOC_TUNE=0)
from poly.runtime import heap
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def prefill_pass():  # like a block of a prefill: four 10 MB temporaries, then all freed
    arrays = [np.ones(2_500_000, np.float32) for _ in range(4)]
    del arrays
big = np.ones(3_000_000, np.float32); del big  # 12 MB freed: glibc's dynamic thresholds rise
prefill_pass()
f0 = faults()
for _ in range(5):
    prefill_pass()
print(heap.keep_temporaries(), faults() - f0)
"""


def _run(tune: str) -> tuple[bool, int]:
    env = {**os.environ, "POLY_MALLOC_TUNE": tune}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         check=True).stdout.split()  # fmt: skip
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_temporaries_stay_mapped_between_passes():
    tuned, faults = _run("1")
    untouched, default_faults = _run("0")
    assert tuned and not untouched
    # the freed 40 MB stay mapped: no page comes back (0 measured); with glibc's defaults the
    # heap top is trimmed after passes (above twice the 12 MB threshold) and faulted in again
    # (8,355 4 KB pages over the 5 passes measured)
    assert faults < 1_000 < 5_000 < default_faults

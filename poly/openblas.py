"""numpy's OpenBLAS, set up as it loads (imported by `poly` before anything imports numpy).

OpenBLAS reads its settings from the environment once, when numpy loads it; an explicit setting
of the user's wins, and none applies if numpy was loaded before poly.
- Worker threads busy-wait 2**28 cycles (~0.1 s) after each call: the decode steps right after a
  BLAS prefill (on the C kernels' OpenMP threads) ran 2x slower while they spun. 2**24 cycles
  outlasts the gaps between a prefill's GEMMs (docs/performance.md). Left in the environment.
- One thread, as `poly.runtime.kernels.blas_threads` wants under the C backend: set for numpy's
  import only (child processes do not inherit it), so that no open pays for threadpoolctl.
"""

import os
import sys

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "24")

# True when numpy's OpenBLAS started here with one thread (`kernels.set_num_threads` reads it)
ONE_THREAD = "numpy" not in sys.modules and "OPENBLAS_NUM_THREADS" not in os.environ
if ONE_THREAD:
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import numpy  # noqa: F401
    finally:
        del os.environ["OPENBLAS_NUM_THREADS"]

"""lucy.rss.peak_rss_mb: the peak of this process image, not of the process that spawned it."""

import subprocess
import sys

import numpy as np

from lucy.rss import peak_rss_mb


def test_a_spawned_process_does_not_inherit_the_parents_peak():
    block = np.ones(300 << 20, dtype=np.uint8)  # the parent peaks above 300 MiB
    assert peak_rss_mb() > 300 and block[0] == 1
    code = "from lucy.rss import peak_rss_mb; print(peak_rss_mb())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout) < 100  # ru_maxrss would report the parent's 300+ here

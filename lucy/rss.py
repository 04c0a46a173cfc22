"""Peak memory of this process, with nothing imported but the standard library (the benchmark
workers of every engine use it, so it must not load poly into llama.cpp's or torch's process)."""

from __future__ import annotations

import resource
import sys


def peak_rss_mb() -> float:
    """Peak resident set size of this process image, MB. Linux: VmHWM, because ru_maxrss
    survives exec and so starts at the parent's size when a big process spawns us (a benchmark
    worker read 354 MB for a 192 MB model). Elsewhere ru_maxrss (macOS reports bytes)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024

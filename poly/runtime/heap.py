"""glibc malloc settings for inference's large temporaries.

A prefill allocates and frees arrays of megabytes per block (projections, attention scores,
the FFN's gate/up rows). With glibc's defaults those either come from fresh mmaps or from heap
top that `free` trims back to the OS, so every pass page-faults them in again: a 512-token
SmolLM2 prefill took 780-890 K page faults and ran at 0.70x (Q8_0 GGUF 777 vs 1110 tok/s,
F32 GGUF 799 vs 1109). Fixed thresholds keep chunks up to 32 MB on the heap and up to 64 MB of
freed heap top mapped, which is what glibc's own dynamic thresholds reach after one large free
(a run whose allocations happened to trigger that was fast, one whose did not was slow).
POLY_MALLOC_TUNE=0 leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter ids (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD = 64 << 20

_state = {"done": False, "set": False}


def keep_temporaries() -> bool:
    """Set the thresholds once per process; True when glibc took them."""
    if _state["done"]:
        return _state["set"]
    _state["done"] = True
    if os.environ.get("POLY_MALLOC_TUNE", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        ok = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        ok = False
    _state["set"] = ok
    return ok


def trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc's malloc_trim; elsewhere nothing): an open's
    temporaries (a tokenizer's parse, header records) leave free heap that every later peak RSS
    would otherwise carry (the thresholds above keep it mapped)."""
    if _LIBC.get("libc") is None:
        try:
            _LIBC["libc"] = ctypes.CDLL("libc.so.6")
            _LIBC["libc"].malloc_trim  # noqa: B018 - a libc without it (musl) raises here
        except (OSError, AttributeError):
            _LIBC["libc"] = False
    if _LIBC["libc"]:
        _LIBC["libc"].malloc_trim(0)


_LIBC: dict = {}  # "libc": glibc's, or False where there is none

"""The POLY_* environment variables lucy honours, each with the parser that validates it.

They are read deep inside the library (POLY_ISA by the C extension as it is imported, the
backend and thread count when poly is imported), where a bad value became a traceback or was
ignored. `check()` runs first, before anything of poly is imported, so a bad value is one
`lucy: error:` line and exit code 2 (bad usage, docs/lucy.md). Stdlib only for that reason.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

USAGE_EXIT = 2  # poly.errors.UsageError.exit_code (importing poly here would defeat the point)


def _choice(*names: str, fold: bool = False) -> Callable[[str], None]:
    def parse(value: str) -> None:
        key = value.strip().lower() if fold else value
        if key not in names:
            raise ValueError(f"choose from {', '.join(names)}")

    return parse


def _positive_int(value: str) -> None:
    try:
        n = int(value)
    except ValueError:
        raise ValueError("expected a whole number >= 1") from None
    if n < 1:
        raise ValueError("expected a whole number >= 1")


def _seconds(value: str) -> None:
    try:
        ok = float(value) >= 0
    except ValueError:
        ok = False
    if not ok:
        raise ValueError("expected a number of seconds >= 0")


def _size_bytes(value: str) -> None:
    raw = value.strip().upper().removesuffix("B")
    digits = raw[:-1] if raw[-1:] in ("K", "M", "G") else raw
    if not digits.isdigit():
        raise ValueError("expected a size in bytes, e.g. 4G or 500M")


def _path(value: str) -> None:
    if "\0" in value:
        raise ValueError("not a path")


# name -> (parser: raises ValueError naming what is expected, what it sets). An empty value is
# "unset" everywhere in the library, so it is never checked.
VARIABLES: dict[str, tuple[Callable[[str], None], str]] = {
    "POLY_HOME": (_path, "where .entity files and the demo GGUF live (default ~/.cache/poly)"),
    "POLY_BACKEND": (
        _choice("auto", "numpy", "c", "numba", fold=True),
        "kernel backend: auto, numpy, c or numba",
    ),
    "POLY_NUM_THREADS": (_positive_int, "kernel and BLAS threads (default: physical cores)"),
    "POLY_ISA": (
        _choice("auto", "base", "avx2", "avx512"),
        "cap on the instruction set of the C kernels: auto, base, avx2 or avx512",
    ),
    "POLY_ACT_Q8": (_choice("0", "1", "auto"), "int8 activations: 0 off, 1 on, auto (default)"),
    "POLY_ADAPTIVE_THREADS": (_choice("0", "1"), "0: always the configured thread count"),
    "POLY_TUNE": (
        _choice("0", "1", "force", fold=True),
        "0: shipped dispatch defaults, no measuring; force: measure again ($POLY_HOME/tune)",
    ),
    "POLY_LAYOUT_CACHE": (
        _choice("0", "1"),
        "0: repack weights at every open, keep nothing on disk",
    ),
    "POLY_LAYOUT_CACHE_MAX": (
        _size_bytes,
        "bytes of repacked layouts kept in $POLY_HOME/layouts (default 16G; oldest removed)",
    ),
    "POLY_MALLOC_TUNE": (_choice("0", "1"), "0: leave glibc's malloc thresholds alone"),
    "POLY_CONVERT_BLOCK_DELAY": (_seconds, "test hook: seconds to sleep after each block"),
}


def problems(environ: Mapping[str, str] | None = None) -> list[str]:
    """One message per POLY_* variable set to a value its parser refuses."""
    env = os.environ if environ is None else environ
    out = []
    for name, (parse, _) in VARIABLES.items():
        value = env.get(name)
        if not value:
            continue
        try:
            parse(value)
        except ValueError as err:
            out.append(f"bad environment variable {name}={value!r}: {err}")
    return out

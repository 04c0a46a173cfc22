"""The `lucy` entry point, stdlib imports only: a Ctrl-C while poly/entity/lucy are still being
imported (numpy, tokenizers ... take most of a second) ends with the one-line message and exit
code 130 like any other interrupt, not with a traceback. (A KeyboardInterrupt raised inside
numpy's C import surfaces as an ImportError, so the start-up handler exits at once instead.)
The POLY_* environment variables are checked here too, before poly's import reads them."""

from __future__ import annotations

import os
import signal
import sys

from lucy import environment


def _interrupted_at_startup(signum, frame) -> None:
    sys.stderr.write("lucy: error: interrupted\n")
    sys.stderr.flush()
    os._exit(130)


def _fail(message: str, code: int) -> None:
    sys.stderr.write(f"lucy: error: {' '.join(message.split())}\n")
    sys.stderr.flush()
    sys.exit(code)


def _unshadow() -> None:
    """`python -m lucy` puts the working directory first on sys.path: a `poly/` folder there
    (a POLY_HOME of ./poly) would be imported as an empty namespace package instead of poly.
    The `lucy` script never has it; drop it unless lucy itself was found there (a checkout)."""
    home = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if sys.path and os.path.abspath(sys.path[0] or os.curdir) == os.getcwd() != home:
        del sys.path[0]


def main() -> None:
    previous = signal.signal(signal.SIGINT, _interrupted_at_startup)
    _unshadow()
    bad = environment.problems()  # before poly's import reads them (POLY_ISA, POLY_BACKEND ...)
    if bad:
        _fail(bad[0], environment.USAGE_EXIT)
    try:
        from lucy.cli import run
    except Exception as err:  # noqa: BLE001 - a typed error while importing poly: one line too
        if "--debug" in sys.argv or not hasattr(err, "exit_code"):
            raise
        _fail(str(err), int(err.exit_code))
    signal.signal(signal.SIGINT, previous)  # from here on, run() reports Ctrl-C itself
    code = run()
    from lucy.terminal import finish_cache_writes

    finish_cache_writes()  # a first open's layouts, written after it (poly.runtime.cache_files)
    sys.exit(code)

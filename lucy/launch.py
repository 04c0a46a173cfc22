"""The `lucy` entry point, stdlib imports only: a Ctrl-C while poly/entity/lucy are still being
imported (numpy, tokenizers ... take most of a second) ends with the one-line message and exit
code 130 like any other interrupt, not with a traceback. (A KeyboardInterrupt raised inside
numpy's C import surfaces as an ImportError, so the start-up handler exits at once instead.)"""

from __future__ import annotations

import os
import signal
import sys


def _interrupted_at_startup(signum, frame) -> None:
    sys.stderr.write("lucy: error: interrupted\n")
    sys.stderr.flush()
    os._exit(130)


def main() -> None:
    previous = signal.signal(signal.SIGINT, _interrupted_at_startup)
    from lucy.cli import run

    signal.signal(signal.SIGINT, previous)  # from here on, run() reports Ctrl-C itself
    sys.exit(run())

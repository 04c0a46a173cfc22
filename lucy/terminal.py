"""Terminal helpers: the rich console, control-character cleaning, line input, human sizes."""

from __future__ import annotations

import contextlib
import os
import re
import sys

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 but tab/newline, DEL, C1


def make_console(stderr: bool = False):
    """Rich console; into a pipe it is wide (no truncated tables) and writes no colour codes."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich exits 1 here; `lucy ... | head` is a normal end: lucy.cli.run exits 0
            self.quiet = True
            raise BrokenPipeError

    con = _Console(stderr=stderr, highlight=False, soft_wrap=True)
    if not con.is_terminal and "COLUMNS" not in os.environ:
        con = _Console(stderr=stderr, highlight=False, soft_wrap=True, width=160)
    return con


def clean(text: str) -> str:
    """Drop terminal control characters (ESC sequences from model or metadata text)."""
    return _CONTROL.sub("", text)


def one_line(text: str) -> str:
    """`text` with every run of whitespace (newlines included) as one space."""
    return " ".join(str(text).split())


def read_line(con, prompt: str) -> str | None:
    """Show `prompt` and read one line from stdin; None at EOF."""
    con.print(prompt, end="", markup=False, highlight=False)
    con.file.flush()
    line = sys.stdin.readline()
    if line == "":
        con.print()
        return None
    return line.rstrip("\r\n")


def human_bytes(n: int | None) -> str:
    """Powers of 1024 named KiB/MiB/GiB, as --memory reads them (KB/MB/GB there are 1000s)."""
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def human_count(n: int | None) -> str:
    if n is None:
        return "?"
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{suffix}"
    return str(n)


def progress_bar(con):
    """The rich bar of lucy's long jobs (description, bar, done/total, time), drawn only on a
    terminal (no redraws into pipes and logs) and removed when done."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    return Progress(*columns, console=con, transient=True, disable=not con.is_terminal)


@contextlib.contextmanager
def _spinner(text: str):
    """`text` beside a spinner on stderr while the block runs, drawn only on a terminal (no
    redraws into pipes and logs) and erased when it ends."""
    con = make_console(stderr=True)
    if not con.is_terminal:
        yield
        return
    with con.status(text, spinner="dots"):
        yield


def opening(spec: str):
    """The spinner while a model opens (the first open of an 8B file repacks its weights)."""
    return _spinner(f"opening {clean(str(spec))} …")


def finish_cache_writes() -> None:
    """Wait for the layout files a first open handed to the cache writer (`cache_files.flush`),
    saying why on a terminal; Ctrl-C skips them (the next open makes them again)."""
    from poly.runtime import cache_files

    if cache_files.pending():
        with _spinner("writing the repacked layouts for the next open … (Ctrl-C skips)"):
            cache_files.flush()

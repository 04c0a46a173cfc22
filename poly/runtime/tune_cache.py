"""What the runtime measured on this CPU, kept between processes (like FFTW's wisdom).

One JSON file per CPU, `$POLY_HOME/tune/<cpu>.json` (default ~/.cache/poly/tune): the CPU's key
(`cpu_key`: model, family/model/stepping, the SIMD flags, the C build in use, the cores this
process may run on) names the file, so a copied home directory or a changed VM never reuses
another machine's findings. A decision is a named entry; `poly.runtime.crossover` writes them.

POLY_TUNE=0: nothing is read, measured or written (the shipped defaults decide); POLY_TUNE=force:
every decision is measured again once per process and overwrites what the file held. A file that
cannot be read or parsed, or of another version, counts as empty (re-measured, then replaced);
one that cannot be written leaves the findings in memory for this process.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from pathlib import Path

from poly.digest import hexdigest
from poly.runtime.cache_files import poly_home, write_renamed

VERSION = 1
# /proc/cpuinfo flags that change which kernels run or how fast: the key ignores the others
FLAG_PREFIXES = ("avx", "fma", "f16c", "amx", "sse4", "bmi2")


def mode() -> str:
    """ "off" (POLY_TUNE=0), "force" (POLY_TUNE=force) or "on" (unset or anything else)."""
    value = os.environ.get("POLY_TUNE", "").strip().lower()
    return {"0": "off", "force": "force"}.get(value, "on")


def tune_dir() -> Path:
    return poly_home() / "tune"


def cpu_facts(cpuinfo: str | None = None) -> dict:
    """Model name, family/model/stepping and the kernel-relevant flags of the first CPU."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:  # not Linux: the platform's name is what we know
            import platform

            cpuinfo = f"model name : {platform.processor() or platform.machine()}"
    facts: dict = {"model": "unknown", "family": "", "cpu_model": "", "stepping": "", "flags": []}
    names = {"model name": "model", "cpu family": "family", "model": "cpu_model"}
    names |= {"stepping": "stepping", "flags": "flags", "Features": "flags"}  # arm: Features
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        field = names.get(key.strip())
        if field is None or facts[field] not in ("unknown", "", []):
            continue  # the first CPU's line of each
        value = value.strip()
        facts[field] = (
            sorted(f for f in value.split() if f.startswith(FLAG_PREFIXES))
            if field == "flags"
            else value
        )
    return facts


def cpu_key(facts: dict, isa: str, cores: int) -> str:
    """The file name's stem: readable model and build, plus a hash of everything that counts."""
    ident = json.dumps([facts, isa, cores], sort_keys=True)
    digest = hexdigest(ident.encode())[:10]
    slug = re.sub(r"[^a-z0-9]+", "-", facts.get("model", "cpu").lower()).strip("-")[:40] or "cpu"
    fms = f"f{facts.get('family') or 0}m{facts.get('cpu_model') or 0}"
    return f"{slug}-{fms}-{isa}-{cores}c-{digest}"


class TuneStore:
    """The entries of one CPU's file: `get(name)`, `put(name, value)` (written at once, whole
    file, atomically: a temporary file in the same folder renamed over the old one)."""

    def __init__(self, path: Path, cpu: dict | None = None) -> None:
        self.path, self.cpu = path, cpu or {}
        self._entries: dict | None = None
        self._lock = threading.Lock()

    def entries(self) -> dict:
        if self._entries is None:
            self._entries = self._read()
        return self._entries

    def get(self, name: str):
        return self.entries().get(name)

    def put(self, name: str, value) -> bool:
        """Record `value` (JSON-able) under `name`; False when the file could not be written."""
        with self._lock:
            self._entries = {**self._read(), **self.entries(), name: value}  # others' too
            doc = {"version": VERSION, "cpu": self.cpu, "entries": self._entries}
            return self._write(doc)

    def _read(self) -> dict:
        try:
            doc = json.loads(self.path.read_text())
        except (OSError, ValueError):  # missing, unreadable, truncated, not JSON: measure again
            return {}
        ok = isinstance(doc, dict) and doc.get("version") == VERSION
        entries = doc.get("entries") if ok else None
        return dict(entries) if isinstance(entries, dict) else {}

    def _write(self, doc: dict) -> bool:
        """Atomic and durable: a reader sees the old file or the new one, never a torn one."""
        text = json.dumps(doc, indent=1, sort_keys=True).encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError:  # read-only home: keep the findings for this process only
            return False
        return write_renamed(self.path, lambda f: f.write(text), durable=True)


@functools.cache
def _machine_facts() -> dict:
    return cpu_facts()


_STORES: dict[tuple[str, str], TuneStore] = {}


def store(isa: str | None = None, cores: int | None = None) -> TuneStore:
    """This machine's store (one object per folder and CPU key in the process)."""
    from poly.runtime import ckernels, threadtune

    facts = _machine_facts()
    isa = isa or str(ckernels.info().get("isa", "none") if ckernels.AVAILABLE else "none")
    key = cpu_key(facts, isa, cores or threadtune.cores())
    folder = str(tune_dir())
    got = _STORES.get((folder, key))
    if got is None:
        got = _STORES[(folder, key)] = TuneStore(
            Path(folder) / f"{key}.json", {**facts, "isa": isa}
        )
    return got

"""Declares the optional C kernel extension poly.runtime.native.ckernels; everything else is in pyproject.toml.

The kernels are compiled once per instruction set into the one extension, and csrc/module.c
picks the build the running CPU supports at import (cpuid), so a wheel built on one machine runs
on another without SIGILL (POLY_ISA=base|avx2|avx512 caps the choice):
  base    csrc/isa/unit_base.c    -O3 (plain C loops; any CPU)
  avx2    csrc/isa/unit_avx2.c    -mavx2 -mfma -mf16c
  avx512  csrc/isa/unit_avx512.c  AVX-512 F/BW/DQ/VL/VNNI + AVX2/FMA/F16C
(docs/internals.md: csrc/'s folders and layers.)
A build whose flags the compiler refuses (older compilers, other architectures) is left out.
OpenMP (-fopenmp) when the compiler has it. optional=True: without a compiler the install still
succeeds and poly falls back to the numba or numpy backend.

The three builds compile in parallel (with -g: avx512 95 s, avx2 60 s, base 9 s on one core), each
reporting its time on the terminal: pip shows a build's output only with -v, so the lines also
go to /dev/tty when there is one. The linked extension is cached under ~/.cache/poly/build/<key>
(key: the sources, setup.py, the compiler's version and flags), so the second install of the
same checkout (`pip install -e ".[test]"` after `pip install -e .`) copies it instead.
Environment: POLY_BUILD_CACHE=<dir> (0: off), POLY_BUILD_DEBUG=1 (keep -g), POLY_BUILD_ISAS=avx2
(only these builds besides base: a quicker build while working on one), POLY_BUILD_RELEASE=1
(.ci/release: every build required, symbols stripped).
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SIMD_SRC = "#include <immintrin.h>\nint main(void){return _mm256_cvtss_f32(_mm256_setzero_ps());}\n"
OMP_SRC = "#include <omp.h>\nint main(void){return omp_get_max_threads() < 1;}\n"
AVX2 = ["-mavx2", "-mfma", "-mf16c"]
AVX512 = [*AVX2, "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni"]
ISAS = {"base": [], "avx2": AVX2, "avx512": AVX512}  # name -> flags (csrc/isa/unit_<name>.c)
RELEASE = os.environ.get("POLY_BUILD_RELEASE") == "1"
# Python's CFLAGS carry -g: the debug info is most of the extension and a good part of the
# compiler's time (CHANGELOG 0.3.0); POLY_BUILD_DEBUG=1 keeps it
DEBUG = [] if os.environ.get("POLY_BUILD_DEBUG") == "1" else ["-g0"]
HERE = Path(__file__).resolve().parent
KERNEL_SOURCES = sorted(p.relative_to(HERE).as_posix() for p in (HERE / "csrc").rglob("*.[ch]"))


def _say(msg: str) -> None:
    """One progress line on stderr, and on the terminal when pip captures stderr (no -v)."""
    line = f"polyloom: {msg}"
    print(line, file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        return
    try:
        with open("/dev/tty", "w") as tty:  # \r and erase: pip's spinner may own the line
            tty.write(f"\r\033[K{line}\n")
    except OSError:
        pass  # no controlling terminal (CI): stderr only


def _accepts(compiler: list[str], flags: list[str], src: str = SIMD_SRC) -> bool:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.c")
        with open(path, "w") as f:
            f.write(src)
        cmd = [*compiler, *flags, path, "-o", os.path.join(d, "t")]
        try:
            return subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False


def _cache_root() -> Path | None:
    setting = os.environ.get("POLY_BUILD_CACHE")
    if setting == "0":
        return None
    if setting:
        return Path(setting)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "poly" / "build"


def _cache_key(compiler, parts: list) -> str:
    """sha256 of everything that goes into the extension: sources, setup.py, compiler, flags."""
    h = hashlib.sha256()
    for name in [*KERNEL_SOURCES, "setup.py"]:
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes())
    try:
        version = subprocess.run(
            [compiler.compiler_so[0], "--version"], capture_output=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        version = b"?"
    h.update(version)
    h.update(repr([compiler.compiler_so, compiler.linker_so, *parts]).encode())
    return h.hexdigest()[:16]


def _place(src: Path, dst: Path) -> None:
    """Copy via a temporary name and rename: a process that has the old file loaded keeps it."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    shutil.copyfile(src, tmp)
    os.chmod(tmp, 0o755)
    os.replace(tmp, dst)


def _prune(root: Path, keep: int = 3) -> None:
    # an entry is one whole extension: keep the newest few
    entries = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    for old in entries[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


class BuildExt(build_ext):
    def build_extension(self, ext):
        cc = list(getattr(self.compiler, "compiler_so", None) or ["cc"])[:1]
        omp = ["-fopenmp"] if _accepts(cc, ["-fopenmp"], OMP_SRC) else []
        wanted = os.environ.get("POLY_BUILD_ISAS", ",".join(ISAS)).split(",")
        isas = {n: f for n, f in ISAS.items() if n == "base" or (n in wanted and _accepts(cc, f))}
        if RELEASE and len(isas) < len(ISAS):
            raise RuntimeError(f"release build: the compiler refuses {set(ISAS) - set(isas)}")
        strip = ["-s"] if RELEASE else []
        ext.extra_compile_args = ["-O3", *omp, *DEBUG]
        ext.extra_link_args = [*omp, *strip]
        ext.define_macros = [(f"PK_HAVE_{n.upper()}", "1") for n in isas if n != "base"]
        target = Path(self.get_ext_fullpath(ext.name))
        root = _cache_root()
        key = _cache_key(self.compiler, [sorted(isas), omp, DEBUG, strip, target.name])
        cached = root / key / target.name if root else None
        if cached is not None and cached.is_file():
            _place(cached, target)
            _say(f"C kernels ({', '.join(isas)}) reused from {cached.parent} (same sources)")
            return
        start = time.monotonic()
        # info()["build"]: what the layout cache names its files by (the same build anywhere)
        build_key = f'-DPK_BUILD_KEY="{key}"'
        ext.extra_objects = self._compile_isas(isas, [*ext.extra_compile_args, build_key])
        super().build_extension(ext)
        _say(f"C kernels built in {time.monotonic() - start:.0f} s")
        if cached is not None:
            try:
                _place(target, cached)
                _prune(root)
            except OSError:
                pass  # a read-only cache only costs the next install its rebuild

    def _compile_isas(self, isas: dict, common: list[str]) -> list[str]:
        """One object per instruction set, compiled side by side (the longest first)."""
        jobs = self.parallel if isinstance(self.parallel, int) else (os.cpu_count() or 1)
        _say(
            f"compiling the C kernels for {', '.join(isas)} ({min(jobs, len(isas))} at a time; "
            "~1.5 min on 2 idle cores, ~3 min on one)"
        )

        def one(name: str) -> list[str]:
            start = time.monotonic()
            objs = self.compiler.compile(
                [f"csrc/isa/unit_{name}.c"],
                output_dir=self.build_temp,
                include_dirs=["csrc"],
                extra_postargs=[*common, *isas[name]],
                depends=KERNEL_SOURCES,
            )
            _say(f"  {name:<7}{time.monotonic() - start:6.1f} s")
            return objs

        order = sorted(isas, key=lambda n: -len(isas[n]))  # avx512 takes longest
        os.makedirs(os.path.join(self.build_temp, "csrc", "isa"), exist_ok=True)
        with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(isas)))) as pool:
            results = dict(zip(order, pool.map(one, order)))
        return [obj for name in isas for obj in results[name]]


setup(
    ext_modules=[
        Extension(
            "poly.runtime.native.ckernels",
            ["csrc/module.c"],
            depends=KERNEL_SOURCES,
            optional=not RELEASE,
        )
    ],
    cmdclass={"build_ext": BuildExt},
)

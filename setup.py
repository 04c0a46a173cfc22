"""Declares the optional C kernel extension poly.runtime._ckernels; everything else is in pyproject.toml.

Flags: -O3 -fopenmp -march=native, or with POLY_PORTABLE_BUILD=1 -mavx2 -mfma -mf16c when the
compiler accepts them (else plain -O3). optional=True: without a compiler the install still
succeeds and poly falls back to the numba or numpy backend.
"""

import os
import subprocess
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SIMD_SRC = "#include <immintrin.h>\nint main(void){return _mm256_cvtss_f32(_mm256_setzero_ps());}\n"
OMP_SRC = "#include <omp.h>\nint main(void){return omp_get_max_threads() < 1;}\n"


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


class BuildExt(build_ext):
    def build_extensions(self):
        cc = list(getattr(self.compiler, "compiler_so", None) or ["cc"])[:1]
        if os.environ.get("POLY_PORTABLE_BUILD") == "1":
            simd = ["-mavx2", "-mfma", "-mf16c"]
            arch = simd if _accepts(cc, simd) else []
        else:
            arch = ["-march=native"] if _accepts(cc, ["-march=native"]) else []
        omp = ["-fopenmp"] if _accepts(cc, ["-fopenmp"], OMP_SRC) else []
        for ext in self.extensions:
            ext.extra_compile_args = ["-O3", *arch, *omp]
            ext.extra_link_args = [*omp]
        super().build_extensions()


setup(
    ext_modules=[
        Extension(
            "poly.runtime._ckernels",
            ["csrc/poly_kernels.c", "csrc/pk_decode.c", "csrc/pk_decode_args.c"],
            depends=["csrc/pk_kernels.h", "csrc/pk_vec.h", "csrc/pk_decode.h"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildExt},
)

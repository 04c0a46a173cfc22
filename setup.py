"""Declares the optional C kernel extension poly.runtime.native.ckernels; everything else is in pyproject.toml.

The kernels are compiled once per instruction set into the one extension, and csrc/pk_module.c
picks the build the running CPU supports at import (cpuid), so a wheel built on one machine runs
on another without SIGILL (POLY_ISA=base|avx2|avx512 caps the choice):
  base    csrc/pk_isa_base.c    -O3 (plain C loops; any CPU)
  avx2    csrc/pk_isa_avx2.c    -mavx2 -mfma -mf16c
  avx512  csrc/pk_isa_avx512.c  AVX-512 F/BW/DQ/VL/VNNI + AVX2/FMA/F16C
A build whose flags the compiler refuses (older compilers, other architectures) is left out.
OpenMP (-fopenmp) when the compiler has it. optional=True: without a compiler the install still
succeeds and poly falls back to the numba or numpy backend.
"""

import os
import subprocess
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SIMD_SRC = "#include <immintrin.h>\nint main(void){return _mm256_cvtss_f32(_mm256_setzero_ps());}\n"
OMP_SRC = "#include <omp.h>\nint main(void){return omp_get_max_threads() < 1;}\n"
AVX2 = ["-mavx2", "-mfma", "-mf16c"]
AVX512 = [*AVX2, "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni"]
ISAS = {"base": [], "avx2": AVX2, "avx512": AVX512}  # name -> flags (csrc/pk_isa_<name>.c)
KERNEL_SOURCES = [
    "csrc/poly_kernels.c",
    "csrc/pk_decode.c",
    "csrc/pk_decode_args.c",
    "csrc/pk_kernels.h",
    "csrc/pk_dense.h",
    "csrc/pk_tiles.h",
    "csrc/pk_ranges.h",
    "csrc/pk_r16.h",
    "csrc/pk_r16_avx2.h",
    "csrc/pk_r8k.h",
    "csrc/pk_r8k_sb.h",
    "csrc/pk_quants.h",
    "csrc/pk_k8.h",
    "csrc/pk_k8i.h",
    "csrc/pk_k8i_avx2.h",
    "csrc/pk_prep.h",
    "csrc/pk_dequant.h",
    "csrc/pk_q8.h",
    "csrc/pk_attn.h",
    "csrc/pk_moe.h",
    "csrc/pk_gemm.h",
    "csrc/pk_gv.h",
    "csrc/pk_k16.h",
    "csrc/pk_gemm_py.h",
    "csrc/pk_rope.h",
    "csrc/pk_mat.h",
    "csrc/pk_gemm_r16.h",
    "csrc/pk_bf16.h",
    "csrc/pk_bf16g.h",
    "csrc/pk_softmax.h",
    "csrc/pk_moe_args.h",
    "csrc/pk_avx512.h",
    "csrc/pk_vec.h",
    "csrc/pk_half.h",
    "csrc/pk_decode.h",
    "csrc/pk_unity.h",
]


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
        omp = ["-fopenmp"] if _accepts(cc, ["-fopenmp"], OMP_SRC) else []
        isas = {n: f for n, f in ISAS.items() if n == "base" or _accepts(cc, f)}
        for ext in self.extensions:
            ext.extra_compile_args = ["-O3", *omp]
            ext.extra_link_args = [*omp]
            ext.define_macros = [(f"PK_HAVE_{n.upper()}", "1") for n in isas if n != "base"]
            ext.extra_objects = [
                obj
                for name, flags in isas.items()
                for obj in self.compiler.compile(
                    [f"csrc/pk_isa_{name}.c"],
                    output_dir=self.build_temp,
                    include_dirs=["csrc"],
                    extra_postargs=["-O3", *flags, *omp],
                    depends=KERNEL_SOURCES,
                )
            ]
        super().build_extensions()


setup(
    ext_modules=[
        Extension(
            "poly.runtime.native.ckernels",
            ["csrc/pk_module.c"],
            depends=[*KERNEL_SOURCES, *(f"csrc/pk_isa_{n}.c" for n in ISAS)],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildExt},
)

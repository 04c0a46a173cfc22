"""The model-level tests again on the 8-lane build when this machine's best is AVX-512 (issue 17,
acceptance 4: every dispatch path present is tested). The kernel tests take each build through
the `each_isa` fixture; these run whole models (the fused step, prompts, batched decode, the
real SmolLM2 Q4_1 greedy parity), which take the build chosen at import, so they run in a
subprocess with POLY_ISA=avx2: on an AVX2-only machine they are the main run already.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from poly.runtime import ckernels

ROOT = Path(__file__).resolve().parents[1]
MODEL_TESTS = [
    "tests/test_interleave16.py",
    "tests/test_float_kmajor16.py",
    "tests/test_fused.py",
    "tests/test_serving_scheduler.py",
    "tests/test_native_smollm2.py",
    "tests/test_smollm2.py",
]


@pytest.mark.slow
@pytest.mark.skipif(
    not (ckernels.AVAILABLE and ckernels.EXT.ISA == "avx512" and "avx2" in ckernels.isas()),
    reason="needs an AVX-512 build with an AVX2 one beside it",
)
def test_model_tests_pass_on_the_avx2_build():
    env = {**os.environ, "POLY_ISA": "avx2"}
    got = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *MODEL_TESTS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    tail = "\n".join(got.stdout.splitlines()[-15:])
    assert got.returncode == 0, tail
    assert " passed" in tail

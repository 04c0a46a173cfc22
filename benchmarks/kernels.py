"""Matrix-vector throughput of the C kernels per GGUF type and instruction-set build.

    python -m benchmarks.kernels                      # every type, every build this CPU runs
    python -m benchmarks.kernels --types Q4_0 Q5_0 --isas avx2 --threads 1

One [8192, 4096] matrix per type (random blocks with sane scales; far larger than L2), x of one
row, best of --reps calls, for the exact float path and the int8-activation path (q8). Prints
G weights/s and GB/s of weight bytes read. Timings are wall clock: on a shared machine compare
builds and types from the same run.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from poly.quant.qtensor import GGUFMatrix
from poly.runtime import ckernels

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0",
         "IQ4_XS", "IQ4_NL", "Q3_K", "Q2_K")  # fmt: skip
SCALES = {
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "Q4_1": (0, 2),
    "Q5_1": (0, 2),
}  # fmt: skip  byte offsets of f16 scales (default: 0)


def matrix(name: str, m: int, k: int, rng) -> GGUFMatrix:
    qtype = GGMLQuantizationType[name]
    block, size = GGML_QUANT_SIZES[qtype]
    if block == 1:
        raw = quants.quantize(rng.standard_normal((m, k)).astype(np.float32), qtype)
        return GGUFMatrix(raw.view(np.uint8), qtype, (m, k))
    raw = rng.integers(0, 256, (m, k // block, size), np.uint8)
    d = rng.uniform(1e-3, 1e-2, (m, k // block)).astype(np.float16).view(np.uint8)
    for off in SCALES.get(name, (0,)):
        raw[:, :, off : off + 2] = d.reshape(m, k // block, 2)
    return GGUFMatrix(raw.reshape(m, -1), qtype, (m, k))


def best(qt, x, out, q8: bool, reps: int) -> float:
    t = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        ckernels.matmul(qt, x, out, q8=q8)
        t = min(t, time.perf_counter() - t0)
    return t


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="+", default=list(TYPES))
    ap.add_argument("--isas", nargs="+", default=None, help="default: every build this CPU runs")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)
    ckernels.set_num_threads(args.threads)
    m, k = 8192, 4096
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, k)).astype(np.float32)
    out = np.empty((1, m), np.float32)
    mats = {name: matrix(name, m, k, rng) for name in args.types}
    print(f"isa     type    MB     float Gw/s  GB/s | q8 Gw/s   ({args.threads} threads)")
    for isa in args.isas or ckernels.isas():
        old = ckernels.use_isa(isa)
        for name, qt in mats.items():
            tf, t8 = best(qt, x, out, False, args.reps), best(qt, x, out, True, args.reps)
            mb = qt.nbytes / 1e6
            print(
                f"{isa:7s} {name:6s} {mb:6.1f}  {m * k / tf / 1e9:8.1f} {qt.nbytes / tf / 1e9:6.1f}"
                f" | {m * k / t8 / 1e9:6.1f}"
            )
        ckernels.use_isa(old)


if __name__ == "__main__":
    main()

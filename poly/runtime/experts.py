"""One MoE expert over its gathered rows with the C kernels and no per-call Python layers
(the `poly.ops.HOOKS["expert"]` entry of the C backend).

A 64-token MoE prefill runs ~16 experts per layer, each a SwiGLU over ~8 rows: through
`swiglu.forward` every product passed plan lookups, `linear`, `dense_matmul` and its checks
(~5 ms of a ~33 ms prefill on the compare_moe model). Here the operands of an expert are found
once per weight change and each call is three C calls: gate|up, silu*up, down.
"""

from __future__ import annotations

import numpy as np

from poly.nn import swiglu
from poly.runtime import ckernels


def _operands(w) -> tuple | None:
    """(kind, w, aux) of a matrix the C kernels read, or None."""
    if isinstance(w, np.ndarray):
        if w.dtype != np.float32 or w.ndim != 2 or not w.flags.c_contiguous:
            return None
        return (ckernels.F32, w, None)
    return ckernels.operands(w)


def _plan(sub) -> tuple | None:
    """(gate_up operands or (gate, up) operands, down operands, I) of a bias-free SwiGLU."""
    if sub.is_disabled or sub.use_tiling:
        return None
    p = swiglu.plan(sub)
    comps = p.comps
    if not p.silu or any(
        comps[b] is not None and comps[b].any() for b in ("b_gate", "b_up", "b_down")
    ):
        return None
    gu = (
        (_operands(p.w_gu),)
        if p.w_gu is not None
        else (_operands(comps["w_gate"]), _operands(comps["w_up"]))
    )
    down = _operands(comps["w_down"])
    if down is None or any(o is None for o in gu):
        return None
    return gu, down, sub.output_height


def _product(ops: tuple, x: np.ndarray, out: np.ndarray) -> None:
    kind, w, aux = ops
    n, k = x.shape
    if n >= ckernels.GEMM_ROWS:
        ckernels.EXT.gemm(kind, x, out, w, aux, n, k, out.shape[1], 0, ckernels.act_q8())
    else:
        x = ckernels.aligned(x)
        ckernels.EXT.matmul(kind, x, out, w, aux, n, k, out.shape[1], ckernels.act_q8())


def run(sub, x: np.ndarray) -> np.ndarray | None:
    """y [n, d] = SwiGLU expert `sub` on x [n, d] (float32, C-contiguous), or None when the
    expert is not a form this path takes (the caller then runs `sub.forward`)."""
    plan = sub.weights.plan("c_expert", lambda: _plan(sub))  # rebuilt when the weights change
    if plan is None or x.dtype != np.float32 or not x.flags.c_contiguous:
        return None
    gu, down, inter = plan
    n = x.shape[0]
    gate_up = np.empty((n, 2 * inter), dtype=np.float32)  # [n, 2I]
    if len(gu) == 1:
        _product(gu[0], x, gate_up)
    else:
        for j, ops in enumerate(gu):
            part = np.empty((n, inter), dtype=np.float32)  # [n, I]
            _product(ops, x, part)
            gate_up[:, j * inter : (j + 1) * inter] = part
    hidden = np.empty((n, inter), dtype=np.float32)  # [n, I]
    ckernels.EXT.silu_mul(gate_up, hidden)
    y = np.empty((n, x.shape[1]), dtype=np.float32)  # [n, d]
    _product(down, hidden, y)
    return y

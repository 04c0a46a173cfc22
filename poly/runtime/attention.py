"""Prefill attention on the C GEMM: the `poly.ops.HOOKS["attend"]` entry of the C backends
(kernels.py installs it). Its largest arrays (a block's scores, a head's keys and values when the
cache did not lay them out by head) live in poly.nn.scratch's kept buffers, not the heap."""

from __future__ import annotations

import numpy as np

from poly.nn import scratch
from poly.runtime import ckernels

ATTEND_MIN = 8192  # queries x keys below which numpy's attention is as fast
ATTEND_BLOCK = 128  # queries per block: a block's keys end at its last query (causal)
ATTEND_SCORES = 1 << 22  # floats of a block's scores at most: fewer queries a block past ~10k keys


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, groups: int):
    """Prefill attention (the `poly.ops.HOOKS["attend"]` entry): q [n, H, hd] at positions
    start.. over k/v [T, kvh, hd] -> [n, H, hd], or None for small or non-float32 cases. Per kv
    head and block of ATTEND_BLOCK queries: scores = gemm(q_g, K_h) over the keys up to the
    block's last query only (a 512-token prompt from an empty cache: 5/8 of the scores),
    `softmax_causal` in place, out = gemm(P, V_h.T), all on the OpenMP threads (numpy's version
    is single-threaded BLAS plus five passes of numpy)."""
    n, heads, hd = q.shape
    t, kvh = k.shape[0], k.shape[1]
    if n * t < ATTEND_MIN or not all(a.dtype == np.float32 for a in (q, k, v)):
        return None
    qg = np.empty((kvh, groups, n, hd), dtype=np.float32)  # [kvh, g, n, hd]
    np.multiply(q.reshape(n, kvh, groups, hd).transpose(1, 2, 0, 3), np.float32(hd**-0.5), out=qg)
    out = np.empty((kvh, groups, n, hd), dtype=np.float32)  # [kvh, g, n, hd]
    # one buffer for every block's scores: a block's own array was allocated while the last one
    # was still held, two of the largest temporaries at once
    block = max(16, min(ATTEND_BLOCK, ATTEND_SCORES // (groups * t)))
    space = scratch.take("scores", (groups * min(n, block) * t,))
    for h in range(kvh):
        # views when the cache laid them out by head (kvcache.attention_rows), else copies
        kh = _contiguous(k[:, h, :], "head_keys")  # [T, hd]
        vt = _contiguous(v[:, h, :].T, "head_values")  # [hd, T]
        for q0 in range(0, n, block):
            q1 = min(n, q0 + block)
            b, keys = q1 - q0, start + q1  # queries q0..q1-1 see keys 0..start+q1-1
            qb = np.ascontiguousarray(qg[h, :, q0:q1]).reshape(groups * b, hd)  # [g*b, hd]
            scores = space[: groups * b * keys].reshape(groups * b, keys)  # [g*b, keys]
            ckernels.EXT.gemm(ckernels.F32, qb, scores, kh[:keys], None, groups * b, hd, keys, 0)
            ckernels.EXT.softmax_causal(scores, b, start + q0, 0)
            vb = _contiguous(vt[:, :keys], "block_values")  # [hd, keys]
            ob = np.empty((groups * b, hd), dtype=np.float32)  # [g*b, hd]
            ckernels.EXT.gemm(ckernels.F32, scores, ob, vb, None, groups * b, keys, hd, 0)
            out[h, :, q0:q1] = ob.reshape(groups, b, hd)
    return out.transpose(2, 0, 1, 3).reshape(n, heads, hd)


def _contiguous(a: np.ndarray, name: str) -> np.ndarray:
    """`a` itself when C-contiguous, else a copy in this thread's scratch buffer `name`."""
    if a.flags.c_contiguous:
        return a
    out = scratch.take(name, a.shape)
    np.copyto(out, a)
    return out

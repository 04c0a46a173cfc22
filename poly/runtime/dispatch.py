"""The one place that chooses between the fused C step and the reference path.

A one-token `Transformer.forward` under the C backend, on float32 activations, runs the fused
step (poly/runtime/fused.py) when its plan applies, and so does a prompt of up to 64 tokens (its
tokens as the step's rows, sharing each block's cache), and a longer one as calls of up to 64
where those win (calls_win); everything else (prompts, tiling, other
activations, forms without a C kernel, the numpy/numba backends, float64) runs the reference
path of the model (poly/model/transformer.py), whose blocks run on the thread count the prefill
tuner picks (poly/runtime/prefill.py).
"""

from __future__ import annotations

import numpy as np

from poly.nn.embedding import lookup
from poly.runtime import ckernels, fused, prefill

# prompts of up to this many tokens run as the rows of one fused step (csrc/pk_decode.c):
# SmolLM2 16 tokens Q8_0 34 -> 20 ms, F32 55 -> 37 ms; 24-64 tokens 15-20 % faster than the
# reference path, whose products run in the C gemm (it takes longer prompts)
FUSED_PREFILL_MAX = 64  # = ckernels.STEP_ROWS

# models this wide or narrower run every longer prompt as fused calls: the reference path's
# per-layer work outweighs its gemm's edge there (Zen 3 AVX2, 65-512 tokens, in-process A/B:
# SmolLM2, 576 wide, 1.00-1.36x on 9 of the matrix's 12 forms, Q4_0 and Q4_K_M 0.98-1.10x,
# .entity q4 see NARROW_EXCEPT; a synthetic 1024-wide model 0.93-1.13x, F32 and Q4_0 ties,
# Q8_0 and Q4_K_M ahead; a synthetic 1536-wide one 0.87-1.07x; the 2048-wide 1B mostly ties)
SMALL_WIDTH = 1024
# block kinds whose longer prompts win as fused calls at any width: F16 on the layout's panels
# (AVX-512 dense row tiles: Zen 4 1B 128 tokens 67-73 -> 85-92 tok/s; AVX2 Zen 3 1B 128 tokens
# 53.8 -> 59.1, 512 52.7 -> 57.2) and Q4_1 (Zen 3 1B 96-512 tokens 1.06-1.26x, three runs). The
# reference path's gemm ties or wins for the others on the 1B model (Q4_0 and .entity q4 by 5-19 %)
CALLS_WIN = frozenset({ckernels.F16, ckernels.Q4_1})
# the SMALL_WIDTH rule takes Loom q4 rows (.entity q4) only up to NARROW_EXCEPT_MAX tokens:
# SmolLM2 .entity q4, A/B of 5-7 rounds, x1.07-1.19 at 96-224 tokens, x0.93-1.20 at 256-384
# (three runs), x0.90-1.04 at 448-512 (the matrix at 512: 1.25x llama.cpp on the reference path,
# 0.96x as fused calls)
NARROW_EXCEPT = frozenset({ckernels.LOOM_Q4})
NARROW_EXCEPT_MAX = 320


def calls_win(model, p: fused.Plan, n: int) -> bool:
    """Whether an n-token prompt (n > STEP_ROWS) runs faster as fused calls of at most
    STEP_ROWS rows than on the reference path (the AVX2 and AVX-512 builds only)."""
    if not ckernels.SIMD:
        return False
    if p.block_kinds <= CALLS_WIN:
        return True
    excepted = n > NARROW_EXCEPT_MAX and p.block_kinds & NARROW_EXCEPT
    return model.config.hidden_size <= SMALL_WIDTH and not excepted


def forward(model, ids: np.ndarray) -> np.ndarray:
    """Logits [V] of the last of `ids` (int64 [n], checked) for `model`."""
    if ids.size == 1 and model.activation_dtype == np.float32:
        p = fused.plan(model)
        if p is not None:
            logits = fused.step(model, p, lookup(model.embeddings, ids)[0])  # x [H]
            if logits is not None:
                return logits
    if ids.size > 1 and model.activation_dtype == np.float32:
        p = fused.plan(model)
        # a short prompt, or a longer one where fused calls win: its tokens are their rows
        if p is not None and (ids.size <= FUSED_PREFILL_MAX or calls_win(model, p, ids.size)):
            x = np.ascontiguousarray(lookup(model.embeddings, ids), dtype=np.float32)  # [n, H]
            logits = fused.prefill_calls(model, p, x)
            if logits is not None:
                return logits
    if ids.size == 1:  # a decode step off the fused path: no per-block trial
        return model.reference_forward(ids)
    if model.activation_dtype == np.float32:
        fused.plan(model)  # made once: its repacked rows (csrc/pk_r16.h) are what the gemm reads
    with prefill.pacing(
        model, ids.size
    ) as pace:  # threads per block, adapted to the machine's load
        return model.reference_forward(ids, pace)

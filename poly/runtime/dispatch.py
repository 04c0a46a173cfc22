"""The one place that chooses between the fused C step and the reference path.

A one-token `Transformer.forward` under the C backend, on float32 activations, runs the fused
step (poly/runtime/fused.py) when its plan applies, and so does a prompt of up to 64 tokens (its
tokens as the step's rows, sharing each block's cache), and a longer one as calls of up to 64
where those win (calls_win): this machine's measurement (poly/runtime/crossover.py, kept per CPU
in the tune cache) or, without one, the shipped rule (`shipped_rule`); everything else (prompts, tiling, other
activations, forms without a C kernel, the numpy/numba backends, float64) runs the reference
path of the model (poly/model/transformer.py), whose blocks run on the thread count the prefill
tuner picks (poly/runtime/prefill.py).
"""

from __future__ import annotations

import numpy as np

from poly.nn import mha
from poly.runtime import ckernels, crossover, fused, prefill

# The shipped rule (`shipped_rule`); the A/B runs behind each value: benchmarks/results/README.md
# prompts up to this long: one fused call. Measured per machine at first use (tune cache)
FUSED_PREFILL_MAX = 64  # = ckernels.STEP_ROWS
# longer prompts on models this wide or narrower: fused calls. Measured per machine (tune cache)
SMALL_WIDTH = 1024
# blocks all of these kinds: fused calls at any width. Measured per machine (tune cache)
CALLS_WIN = frozenset({ckernels.F16, ckernels.Q4_1})
# Loom q4 blocks leave SMALL_WIDTH's fused calls past this. Measured per machine (tune cache)
NARROW_EXCEPT = frozenset({ckernels.LOOM_Q4})
NARROW_EXCEPT_MAX = 320
# longer prompts that reach past this position: the reference path at any width. A fused call
# attends row by row, reading every earlier key and value once per row; the reference path
# multiplies 128 queries at a time by the keys in two GEMMs (attention.attend). Not probed (a
# probe at such contexts costs seconds): docs/performance.md, "Long prompts"
LONG_CONTEXT = 1024


def shipped_rule(model, p: fused.Plan, n: int) -> bool:
    """The default without a measurement (POLY_TUNE=0, a loaded machine): whether an n-token
    prompt runs as fused calls of at most STEP_ROWS rows rather than on the reference path."""
    if n <= FUSED_PREFILL_MAX:
        return True
    if not ckernels.SIMD:
        return False
    if p.block_kinds <= CALLS_WIN:
        return True
    excepted = n > NARROW_EXCEPT_MAX and p.block_kinds & NARROW_EXCEPT
    return model.config.hidden_size <= SMALL_WIDTH and not excepted


def calls_win(model, p: fused.Plan, n: int) -> bool:
    """Whether an n-token prompt (n > STEP_ROWS) runs faster as fused calls of at most
    STEP_ROWS rows than on the reference path (the AVX2 and AVX-512 builds only): this
    machine's finding (tune cache), else the shipped rule."""
    if not ckernels.SIMD:
        return False
    return crossover.fused_wins(model, p, n, shipped_rule(model, p, n))


def fused_prompt(model, p: fused.Plan, n: int) -> bool:
    """Whether an n-token prompt (n >= 2) runs as fused calls: one call up to FUSED_PREFILL_MAX
    tokens unless this machine measured otherwise, `calls_win` past it but for one that reaches
    past LONG_CONTEXT."""
    if n <= FUSED_PREFILL_MAX:
        return crossover.fused_wins(model, p, n, True) if ckernels.SIMD else True
    if p.attn and mha.live_cache(p.attn[0]).length + n > LONG_CONTEXT:
        return False
    return calls_win(model, p, n)


def forward(model, ids: np.ndarray) -> np.ndarray:
    """Logits [V] of the last of `ids` (int64 [n], checked) for `model`."""
    if ids.size == 1 and model.activation_dtype == np.float32:
        p = fused.plan(model)
        if p is not None:
            logits = fused.step(model, p, model.embed(ids)[0])  # x [H] (times embedding_scale)
            if logits is not None:
                return logits
    if ids.size > 1 and model.activation_dtype == np.float32:
        p = fused.plan(model)
        # a short prompt, or a longer one where fused calls win: its tokens are their rows
        if p is not None and fused_prompt(model, p, ids.size):
            x = np.ascontiguousarray(model.embed(ids), dtype=np.float32)  # [n, H]
            logits = fused.prefill_calls(model, p, x)
            if logits is not None:
                return logits
    if ids.size == 1:  # a decode step off the fused path: no per-block trial
        return model.reference_forward(ids)
    if model.activation_dtype == np.float32:
        # made once: its repacked rows (csrc/formats/interleave16.h) are what the gemm reads
        fused.plan(model)
    with prefill.pacing(
        model, ids.size
    ) as pace:  # threads per block, adapted to the machine's load
        return model.reference_forward(ids, pace)


def forward_rows(model, ids: np.ndarray) -> np.ndarray:
    """Logits [n, V] of every one of `ids` (int64 [n], checked), continuing the KV cache: one
    fused call when n <= STEP_ROWS and the fused step applies (speculative decoding's check of
    proposed tokens), else the reference path."""
    if model.activation_dtype == np.float32 and ids.size <= ckernels.STEP_ROWS:
        p = fused.plan(model)
        if p is not None:
            x = np.ascontiguousarray(model.embed(ids), dtype=np.float32)  # [n, H]
            logits = fused.verify_rows(model, p, x)
            if logits is not None:
                return logits
    return model.forward_all(ids)

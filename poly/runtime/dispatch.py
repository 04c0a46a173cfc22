"""The one place that chooses between the fused C step and the reference path.

A one-token `Transformer.forward` under the C backend, on float32 activations, runs the fused
step (poly/runtime/fused.py) when its plan applies, and so does a prompt of up to 64 tokens (its
tokens as the step's rows, sharing each block's cache), and a longer one as calls of up to 64
where those win (fused.calls_win); everything else (prompts, tiling, other
activations, forms without a C kernel, the numpy/numba backends, float64) runs the reference
path of the model (poly/model/transformer.py), whose blocks run on the thread count the prefill
tuner picks (poly/runtime/prefill.py).
"""

from __future__ import annotations

import numpy as np

from poly.nn.embedding import lookup
from poly.runtime import fused, prefill

# prompts of up to this many tokens run as the rows of one fused step (csrc/pk_decode.c):
# SmolLM2 16 tokens Q8_0 34 -> 20 ms, F32 55 -> 37 ms; 24-64 tokens 15-20 % faster than the
# reference path, whose products run in the C gemm (it takes longer prompts)
FUSED_PREFILL_MAX = 64  # = ckernels.STEP_ROWS; 2 calls of 64 were slower than gemm at 96-128


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
        if p is not None and (ids.size <= FUSED_PREFILL_MAX or fused.calls_win(p)):
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

"""Sequential: runs sub-layers in order and resolves each Residual's skip source.

skip="input" adds the Sequential's input; skip=k adds the output of sub-layer k; skip=None keeps
Loom's rule (the previous sub-layer's input).
"""

from __future__ import annotations

import numpy as np

from poly.errors import LayerConfigError
from poly.layer import LayerKind, LayerType


def forward(layer, x: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
    block_input = x
    outputs: list[np.ndarray] = []
    prev_input = None
    for i, sub in enumerate(layer.sequential_layers):
        if sub.is_disabled:
            outputs.append(x)
            continue
        sub_skip = prev_input
        if sub.type == LayerType.RESIDUAL and sub.skip is not None:
            if sub.skip == "input":
                sub_skip = block_input
            elif isinstance(sub.skip, int) and 0 <= sub.skip < i:
                sub_skip = outputs[sub.skip]
            else:
                raise LayerConfigError(f"residual {i}: bad skip source {sub.skip!r}")
        prev_input = x
        x = sub.forward(x, sub_skip)
        outputs.append(x)
    return x


KIND = LayerKind(LayerType.SEQUENTIAL, forward)

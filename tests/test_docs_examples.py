"""The code blocks of docs/build-by-hand.md run as written."""

import re
from pathlib import Path

import numpy as np


def test_build_by_hand_guide_runs():
    text = (Path(__file__).parent.parent / "docs" / "build-by-hand.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 2
    scope: dict = {}
    for code in blocks:
        exec(compile(code, "build-by-hand.md", "exec"), scope)  # noqa: S102 (our own docs)
    assert scope["y"].shape == (5, 64) and scope["y2"].shape == (1, 64)
    assert scope["out"].shape == (3, 64) and scope["out8"].dtype == np.float32
    assert scope["logits"].shape == (1000,) and scope["logits"].dtype == np.float32


def test_architecture_adding_a_layer_kind_runs():
    text = (Path(__file__).parent.parent / "docs" / "architecture.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1
    scope: dict = {}
    exec(compile(blocks[0], "architecture.md", "exec"), scope)  # noqa: S102 (our own docs)
    layer = scope["layer"]
    assert layer.weights.versions[layer.weights.active]["w"].scheme == "int8"
    assert scope["y"].shape == (2, 8) and scope["y"].dtype == np.float32

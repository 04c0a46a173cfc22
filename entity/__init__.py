"""entity: checkpoints in and out of poly (HF safetensors, GGUF, the .entity format)."""

from __future__ import annotations

# Imported eagerly: the submodule `entity.convert` would otherwise rebind the package attribute
# `convert` to the module the first time anyone imports it, shadowing this function.
from entity.convert import convert
from entity.load import load

__all__ = ["convert", "load"]

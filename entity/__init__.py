"""entity: checkpoints in and out of poly (HF safetensors, GGUF, the .entity format)."""

from __future__ import annotations

import importlib
from typing import Any

from entity.load import load


def convert(*args: Any, **kwargs: Any) -> Any:
    """``entity.convert.convert`` (imported on first use so loading never depends on it)."""
    module = importlib.import_module("entity.convert")
    # Importing the submodule rebinds the package attribute `convert`; keep this function.
    globals()["convert"] = _convert_wrapper
    return module.convert(*args, **kwargs)


_convert_wrapper = convert

__all__ = ["convert", "load"]

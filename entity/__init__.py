"""entity: checkpoints in and out of poly (HF safetensors, GGUF, the .entity format)."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from entity.load import load

__all__ = ["convert", "load"]

# Names bound to a function of the submodule they share a name with; loaded on first use, since
# `entity.convert` pulls in the .entity writer and the quantizers, which loading never needs.
_LAZY = {"convert": "entity.convert"}


class _Package(types.ModuleType):
    # Importing the submodule `entity.convert` (`from entity.convert import X` anywhere) binds it
    # on this package afterwards: keep the function of the same name bound instead.
    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)  # the import binds it (above)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


sys.modules[__name__].__class__ = _Package

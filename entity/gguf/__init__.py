"""GGUF files: the reader (`reader`), the tokenizer and chat template they carry (`tokenizer`)
and the loader (`loader`). ``load_gguf`` and ``GGUFFile`` are importable from here (loaded on
first use)."""

from __future__ import annotations

from typing import Any

_EXPORTS = {"load_gguf": "loader", "gguf_config": "loader", "GGUFFile": "reader",
            "open_gguf": "reader"}  # fmt: skip
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"entity.gguf.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'entity.gguf' has no attribute {name!r}")

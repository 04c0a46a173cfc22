"""HuggingFace snapshots: ``config.json`` (`config`), tensor names (`names`), safetensors files
(`safetensors_io`), the local hub cache (`cache`) and the loader (`loader`).

``load_hf``, ``iter_hf_blocks``, ``open_hf`` and ``attach_hf_metadata`` are importable from here
(loaded on first use, so that reading the cache does not import the loader).
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_hf", "iter_hf_blocks", "open_hf", "attach_hf_metadata", "HFSource"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from entity.hf import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'entity.hf' has no attribute {name!r}")

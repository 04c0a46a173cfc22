"""Where poly keeps things, and the one naming rule for `.entity` files.

``poly_home()`` is ``$POLY_HOME`` or ``~/.cache/poly`` (read at call time); downloaded models go
to ``models_dir()``, converted ones to ``entities_dir()``. ``entity_filename(source, quant)`` is
the single rule that `entity.convert` (default output), `lucy demo` and the menu's catalogue use,
so a model converted by any of them is found by the others and listed once:

    <model>.<quant>.entity

``<model>`` is the HF repo id with "/" as "--" (from a ``models--org--name`` cache path or a
bare model id), else the file or directory name without its extension and without a trailing
quant tag (GGUF's ``.Q4_1``/``-Q4_K_M``/``.F16``, or our own ``.q4`` of an `.entity`): the
demo's ``SmolLM2-135M-Instruct.Q4_1.gguf`` in q4 is ``SmolLM2-135M-Instruct.q4.entity``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from poly.runtime.cache_files import poly_home

__all__ = ["poly_home", "models_dir", "entities_dir", "model_name", "entity_filename"]

ENTITY_SUFFIX = ".entity"
# A trailing quant tag: GGUF file types (Q4_1, Q4_K_M, IQ2_XS, F16, BF16 ...) or our schemes.
_QUANT_TAG = re.compile(
    r"[.-](?:I?Q\d(?:_[A-Z0-9]+)*|[BF]F?\d{2}|F32|q4|q8|f16|bf16|f32)$", re.IGNORECASE
)
_EXTENSION = re.compile(r"\.(?:gguf|entity|safetensors)$", re.IGNORECASE)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def models_dir() -> Path:
    """Downloaded source models (the demo's GGUF): ``poly_home()/models``."""
    return poly_home() / "models"


def entities_dir() -> Path:
    """Converted `.entity` files: ``poly_home()/entities``."""
    return poly_home() / "entities"


def model_name(source: str | os.PathLike) -> str:
    """The model part of an `.entity` name for a source path or HF model id (see module doc)."""
    text = os.fspath(source)
    p = Path(text).expanduser()
    parts = p.resolve().parts if p.exists() else p.parts
    repo = next((s[len("models--") :] for s in reversed(parts) if s.startswith("models--")), None)
    if repo is not None:
        return _UNSAFE.sub("_", repo)
    model_id = not p.exists() and not p.is_absolute() and text.count("/") == 1
    model_id = model_id and not _EXTENSION.search(text)
    name = text.replace("/", "--") if model_id else p.name  # "org/name" -> "org--name"
    if not (model_id or p.is_dir()):  # a file: drop its extension, then its quant tag
        name = _EXTENSION.sub("", name)
    name = _QUANT_TAG.sub("", name) or name
    return _UNSAFE.sub("_", name).strip("._") or "model"


def entity_filename(source: str | os.PathLike, quant: str) -> str:
    """``<model>.<quant>.entity`` for ``source`` (a path or an HF model id) in scheme ``quant``."""
    return f"{model_name(source)}.{quant}{ENTITY_SUFFIX}"

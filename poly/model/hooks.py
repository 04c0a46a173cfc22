"""Behaviour the model reaches through injection, never by importing upper layers.

poly.runtime provides "forward" (one place choosing the fused C step or the reference path) and
"forward_batch"; poly.text provides "prompt_ids" and "stream". `import poly` installs both.
A provider may name its function ("module:attribute"): the module loads at the first `need`
(poly.text's prompting and generation are not imported by a process that only opens a model).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from poly.errors import UsageError

HOOKS: dict[str, Callable | str] = {}
_PROVIDERS = {
    "forward": "poly.runtime",
    "forward_batch": "poly.runtime",
    "prompt_ids": "poly.text",
    "stream": "poly.text",
}


def provide(name: str, fn: Callable | str) -> None:
    """Install the implementation of hook `name`: a function, or where one is ("module:name")."""
    if name not in _PROVIDERS:
        raise UsageError(f"unknown model hook {name!r} (known: {', '.join(_PROVIDERS)})")
    HOOKS[name] = fn


def need(name: str) -> Callable:
    """The implementation of hook `name`; an error naming the package to import if missing."""
    fn = HOOKS.get(name)
    if fn is None:
        raise UsageError(f"{name} needs {_PROVIDERS.get(name, 'poly')} (import poly)")
    if isinstance(fn, str):
        module, _, attr = fn.partition(":")
        fn = HOOKS[name] = getattr(importlib.import_module(module), attr)
    return fn

"""Behaviour the model reaches through injection, never by importing upper layers.

poly.runtime provides "forward" (one place choosing the fused C step or the reference path) and
"forward_batch"; poly.text provides "prompt_ids" and "stream". `import poly` installs both.
"""

from __future__ import annotations

from collections.abc import Callable

from poly.errors import UsageError

HOOKS: dict[str, Callable] = {}
_PROVIDERS = {
    "forward": "poly.runtime",
    "forward_batch": "poly.runtime",
    "prompt_ids": "poly.text",
    "stream": "poly.text",
}


def provide(name: str, fn: Callable) -> None:
    """Install the implementation of hook `name`."""
    if name not in _PROVIDERS:
        raise UsageError(f"unknown model hook {name!r} (known: {', '.join(_PROVIDERS)})")
    HOOKS[name] = fn


def need(name: str) -> Callable:
    """The implementation of hook `name`; an error naming the package to import if missing."""
    fn = HOOKS.get(name)
    if fn is None:
        raise UsageError(f"{name} needs {_PROVIDERS.get(name, 'poly')} (import poly)")
    return fn

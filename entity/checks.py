"""Checks every loader applies to what a file says about token ids (issue #18 item 11)."""

from __future__ import annotations

from collections.abc import Iterable

from poly.errors import FormatError, PolyError

__all__ = ["check_eos_ids"]


def check_eos_ids(
    ids: Iterable[int], vocab_size: int, *, path: str | None, cls: type[PolyError] = FormatError
) -> None:
    """EOS ids read from a file must lie in the vocabulary: a bad file (exit 4), found at load,
    not a usage error (exit 2) at the first generation."""
    bad = [i for i in ids if type(i) is not int or not 0 <= i < vocab_size]
    if bad:
        raise cls(
            f"EOS token ids {bad[:8]} are outside the vocabulary [0, {vocab_size})",
            path=None if path is None else str(path),
        )

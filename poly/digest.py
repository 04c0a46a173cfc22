"""The one hash behind the caches' names (layout files, kept tokenizers, tuning records):
BLAKE2b from CPython's `_blake2`, the module hashlib itself wraps. Importing hashlib loads and
initializes OpenSSL's libcrypto, a cost in RSS and time that every model open would pay for
these names (issue 62, docs/performance.md)."""

from __future__ import annotations

try:
    from _blake2 import blake2b as _blake2b
except ImportError:  # a Python without it: hashlib's (OpenSSL's or its own)
    from hashlib import blake2b as _blake2b


def hasher(data: bytes | bytearray | memoryview = b""):
    """A 32-byte BLAKE2b hash object (`update`, `hexdigest`) started with `data`."""
    return _blake2b(data, digest_size=32)


def hexdigest(data: bytes | bytearray | memoryview) -> str:
    return hasher(data).hexdigest()

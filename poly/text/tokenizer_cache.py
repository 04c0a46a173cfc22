"""A tokenizer.json kept in the form the tokenizers library parses fastest (issue 62: open time).

`tokenizers.Tokenizer.from_str` spends most of its time on a large BPE vocabulary in serde's
generic handling of the model section; the same tokenizer written with its vocabulary sorted by
token and its merges as "a b" strings parses faster (docs/performance.md). The first `poly.text.tokenizer.Tokenizer`
built from a tokenizer.json text checks it (`_validate_structure`), builds it, and writes that
form here, kept only when it serializes back to the very same tokenizer (`to_str` equal; else a
`.skip` marker). A later build from the same text (its hash) reads the kept form and skips the
JSON checks that text passed. A GGUF's tokenizer is kept the same way, named by the file's
metadata bytes (`entity.gguf.tokenizer.build_tokenizer`: its vocabulary and merges not built
again). Files: ``$POLY_HOME/tokenizers/<BLAKE2b>-<tokenizers version>.json`` (default
~/.cache/poly), written to a temporary name and renamed; one that does not parse is ignored and
written again; past MAX_KEPT files the ones used longest ago go. POLY_LAYOUT_CACHE=0 turns this
off with the layout cache.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import tokenizers

from poly.digest import hasher
from poly.runtime.cache_files import poly_home, write_renamed

MAX_KEPT = 32  # tokenizers kept (each is about the size of its tokenizer.json)


def key(text: str | bytes | memoryview, checks: str) -> str:
    """The name of `text`'s kept form (a tokenizer.json, or what a tokenizer is built from): the
    hash of it and of `checks` (how it was checked and built), and the tokenizers version."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    digest = hasher(data)
    digest.update(b"\0" + checks.encode())
    return f"{digest.hexdigest()}-{tokenizers.__version__}"


def _folder() -> Path | None:
    from poly.runtime import layout_cache

    return poly_home() / "tokenizers" if layout_cache.enabled() else None


def lookup(name: str) -> tokenizers.Tokenizer | None:
    """The kept tokenizer `name` (`key`), or None: not kept, off, or a file that does not parse."""
    folder = _folder()
    if folder is None:
        return None
    path = folder / f"{name}.json"
    try:
        with open(path, "rb") as f:
            tok = tokenizers.Tokenizer.from_buffer(f.read())
        os.utime(path)  # used now: the last to go past MAX_KEPT
        return tok
    except Exception:  # missing, unreadable, or not a tokenizer (the Rust side raises Exception)
        return None


def fast_form(data: Any) -> bytes | None:
    """A parsed BPE tokenizer.json as the JSON serde parses fastest: vocabulary sorted by token,
    merges as "a b" strings where no part holds a space; None for other models."""
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE":
        return None
    vocab, merges = model.get("vocab"), model.get("merges")
    if not isinstance(vocab, dict) or not isinstance(merges, list):
        return None
    if all(_plain_pair(m) for m in merges):
        merges = [f"{a} {b}" for a, b in merges]
    model = dict(model, vocab=dict(sorted(vocab.items())), merges=merges)
    return json.dumps(dict(data, model=model), ensure_ascii=False, separators=(",", ":")).encode()


def _plain_pair(m: Any) -> bool:
    return (
        isinstance(m, list)
        and len(m) == 2
        and all(isinstance(s, str) and " " not in s for s in m)
        and not m[0].startswith("#version")  # a merges.txt header line, to the legacy parser
    )


def wanted(name: str) -> bool:
    """Whether `store` would keep anything for `name` (on, and not marked `.skip`): a caller makes
    the fast form only then."""
    folder = _folder()
    return folder is not None and not (folder / f"{name}.skip").exists()


def store(name: str, form: bytes | None, built: str) -> None:
    """Keep `form` (`fast_form`) as `name` when it builds the tokenizer whose `to_str()` is
    `built` exactly, else a `.skip` marker (that text is built from its JSON every time). Errors
    leave nothing kept."""
    folder = _folder()
    if folder is None:
        return
    try:
        same = form is not None and tokenizers.Tokenizer.from_buffer(form).to_str() == built
    except Exception:  # the Rust side raises Exception
        same = False
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}{'.json' if same else '.skip'}"
    if write_renamed(path, lambda f: f.write(form if same else b"")):
        _prune(folder)


def _prune(folder: Path) -> None:
    """Remove the files used longest ago past MAX_KEPT (another process may remove them too)."""
    entries = []
    for p in folder.iterdir():
        with contextlib.suppress(OSError):
            entries.append((p.stat().st_mtime, p))
    for _, p in sorted(entries)[: max(0, len(entries) - MAX_KEPT)]:
        with contextlib.suppress(OSError):
            p.unlink()

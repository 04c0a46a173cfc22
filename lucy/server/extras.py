"""``lucy serve``'s KV persistence and speculation options: ``--slot-save-path``,
``--prompt-cache``, ``--lookup`` / ``--draft`` (docs/serve.md)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from poly.errors import UsageError

MIB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slot-save-path", dest="slot_save_path", default=None, metavar="DIR",
                   help="folder for POST /slots/{id}?action=save|restore (llama.cpp's API)")  # fmt: skip
    p.add_argument("--prompt-cache", dest="prompt_cache", default=None, metavar="DIR",
                   help="keep long prompts' KV in DIR: a restarted server skips their prefill")  # fmt: skip
    p.add_argument("--prompt-cache-min", dest="prompt_cache_min", type=int, default=256,
                   metavar="N", help="--prompt-cache: prompts of at least N tokens")  # fmt: skip
    p.add_argument("--spec-always", dest="spec_always", action="store_true",
                   help="--lookup/--draft: speculate on every lone greedy step, even when "
                   "measured slower than plain decoding")  # fmt: skip
    p.add_argument("--prompt-cache-mb", dest="prompt_cache_mb", type=float, default=1024.0,
                   metavar="MB", help="--prompt-cache: size bound, oldest files go first")  # fmt: skip


def check(args) -> None:
    """Refused before the model loads."""
    tp = (getattr(args, "tp", None) or 1) > 1
    lookup, draft = getattr(args, "lookup", None), getattr(args, "draft", None)
    if lookup is not None and not 1 <= lookup <= 15:
        raise UsageError(f"--lookup must be in 1..15 (one pass checks up to 15), got {lookup}")
    if lookup and draft:
        raise UsageError("choose one way to propose tokens: --lookup or --draft")
    n = getattr(args, "draft_tokens", None)
    if n is not None and (draft is None or not 1 <= n <= 15):
        raise UsageError("--draft-tokens needs --draft and a count in 1..15")
    for flag, name in (("--slot-save-path", "slot_save_path"), ("--prompt-cache", "prompt_cache")):
        folder = getattr(args, name, None)
        if folder is not None and not Path(folder).is_dir():
            raise UsageError(f"{flag} {folder}: not a folder")
        if folder is not None and not os.access(folder, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {folder}: not writable")
    if getattr(args, "prompt_cache_min", 1) < 1 or not getattr(args, "prompt_cache_mb", 1) > 0:
        raise UsageError("--prompt-cache-min must be >= 1 and --prompt-cache-mb > 0")
    wants = [f for f, v in (("--lookup", lookup), ("--draft", draft),
                            ("--prompt-cache", getattr(args, "prompt_cache", None)),
                            ("--slot-save-path", getattr(args, "slot_save_path", None))) if v]  # fmt: skip
    if tp and wants:
        raise UsageError(f"{wants[0]} does not run with --tp yet")


def load_draft(args, load_model, **load_kw):
    """The --draft model (None without one), loaded as the served model is."""
    if getattr(args, "draft", None) is None:
        return None
    return load_model(args.draft, None, **load_kw)


def setup(args, model, kv, model_id: str, draft=None):
    """(the scheduler's KV store, its ServerSpeculation or None)."""
    from poly.serving.speculate import ServerSpeculation

    if args is None:
        return kv, None
    if getattr(args, "prompt_cache", None) is not None:
        from poly.serving.persist import DiskPromptCache, clean

        if not getattr(kv, "paged", False):
            raise UsageError("--prompt-cache needs the paged KV pool (not --kv-pages 0, a "
                             "q8_0 cache or a sliding-window model)")  # fmt: skip
        clean(args.prompt_cache)
        kv = DiskPromptCache(kv, args.prompt_cache, model_id, args.prompt_cache_min,
                             int(args.prompt_cache_mb * MIB))  # fmt: skip
    spec = None
    if getattr(args, "lookup", None) or draft is not None:
        spec = ServerSpeculation(model, lookup=getattr(args, "lookup", None), draft=draft,
                                 draft_tokens=getattr(args, "draft_tokens", None),
                                 always=getattr(args, "spec_always", False))  # fmt: skip
    return kv, spec


def attach(app, state, args) -> None:
    """The slot routes and the slot bookkeeping of every request."""
    from lucy.server.slots import SlotTable, add_routes

    folder = None if args is None else getattr(args, "slot_save_path", None)
    state.slots = SlotTable(state.scheduler.max_batch, folder)
    add_routes(app, state, state.slots)

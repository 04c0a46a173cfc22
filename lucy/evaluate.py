"""`lucy eval`: perplexity and KL divergence from a reference on a text file, under a progress
bar; Ctrl-C prints the windows measured so far before the usual "interrupted" (exit 130).

The measuring is `poly.text.evaluate`; here: reading the text, loading MODEL and REF, the file
size (bits per weight), and the table or JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lucy import actions, plots
from lucy.terminal import clean, make_console, progress_bar
from poly.errors import ModelNotFoundError, UsageError
from poly.text.evaluate import (
    Measure,
    check_same_vocab,
    evaluate,
    parameter_count,
    text_tokens,
    window_starts,
)

MAX_TEXT_BYTES = 64 << 20  # a text to score, not a corpus to hold in memory


def read_text(path: str) -> str:
    """The text file ("-": stdin) as UTF-8; one-line errors for a missing, unreadable or empty
    file."""
    try:
        text = _read_bytes(path).decode("utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(f"text file {path} is not UTF-8 (byte {err.start})") from None
    except OSError as err:
        raise ModelNotFoundError(f"cannot read text file {path}: {err.strerror}") from None
    if not text.strip():
        raise UsageError(f"text file {path} is empty")
    return text


def _read_bytes(path: str) -> bytes:
    if path == "-":
        raw = sys.stdin.buffer.read(MAX_TEXT_BYTES + 1)
    else:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ModelNotFoundError(f"text file {path} not found", path=str(p))
        with p.open("rb") as f:
            raw = f.read(MAX_TEXT_BYTES + 1)
    if len(raw) > MAX_TEXT_BYTES:
        raise UsageError(f"text file {path} is over {MAX_TEXT_BYTES >> 20} MB")
    return raw


def checkpoint_bytes(spec: str) -> int | None:
    """The size of what `spec` names on disk: a file's size, or an HF snapshot's weight files
    (*.safetensors) summed; None when it cannot be found (a cached id that moved)."""
    path = Path(spec).expanduser()
    if not path.exists():
        try:
            from entity.hf.cache import resolve_cached

            path = Path(resolve_cached(spec))
        except Exception:  # noqa: BLE001 - a size is a courtesy, never a failure
            return None
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return path.stat().st_size


def run_eval(args) -> int:
    """Each MODEL in turn against REF (loaded once): its table or JSON line; --plot draws them."""
    if args.plot:
        plots.require(args.plot)
    text = read_text(args.text)  # before the (slow) loads: a bad file fails at once
    ref = actions.load_model(args.reference) if args.reference else None
    points = [_eval_one(args, spec, ref, text) for spec in args.model]
    if args.plot:
        sized = [p for p in points if p.get("bpw") is not None]
        if not sized:
            raise UsageError("--plot: no file size known for the models (bits per weight)")
        plots.save(plots.eval_figure(sized, args.reference), args.plot)
    return 0


def _eval_one(args, spec: str, ref, text: str) -> dict:
    model = actions.load_model(spec)
    if ref is not None:
        check_same_vocab(model, ref)
    tokens = text_tokens(model, text, ref)
    for m in (model, ref):
        if m is not None and args.ctx > m.config.max_seq_len:
            raise UsageError(f"--ctx {args.ctx} is over the model's context "
                             f"({m.config.max_seq_len})")  # fmt: skip
    total = len(window_starts(len(tokens), args.ctx))
    measure = Measure()
    size = checkpoint_bytes(spec)
    try:
        result = _measure(model, ref, tokens, args.ctx, measure, size, total)
    except KeyboardInterrupt:
        if measure.windows:  # what was measured is printed, then cli.run's "interrupted", 130
            partial = measure.result(n_ctx=args.ctx, complete=False, bpw=_bpw(size, model))
            _show(args, spec, partial, total, len(tokens))
        raise
    return _show(args, spec, result, total, len(tokens))


def _bpw(size: int | None, model) -> float | None:
    return None if size is None else size * 8.0 / parameter_count(model)


def _measure(model, ref, tokens, n_ctx, measure, size, total):
    con = make_console(stderr=True)
    with progress_bar(con) as bar:
        task = bar.add_task("evaluating", total=total)

        def progress(done: int, of: int, detail: str) -> None:
            bar.update(task, completed=done, total=of, description=detail)

        return evaluate(model, tokens, reference=ref, n_ctx=n_ctx, progress=progress,
                        measure=measure, file_bytes=size)  # fmt: skip


def _show(args, spec: str, result, total: int, n_tokens: int) -> dict:
    data = {"model": str(spec), "reference": args.reference, "text": str(args.text),
            "text_tokens": n_tokens, "windows_total": total, **result.to_json()}  # fmt: skip
    if args.json:
        print(json.dumps(data), flush=True)  # one line per MODEL
    else:
        make_console().print(eval_table(data))
    return data


ROWS = (
    ("perplexity", "ppl", "{:.4f}"),
    ("perplexity of REF", "ref_ppl", "{:.4f}"),
    ("mean KL divergence", "kld_mean", "{:.5g}"),
    ("  ± (standard error)", "kld_stderr", "{:.5g}"),
    ("median KLD", "kld_median", "{:.5g}"),
    ("90 % KLD", "kld_p90", "{:.5g}"),
    ("99 % KLD", "kld_p99", "{:.5g}"),
    ("max KLD", "kld_max", "{:.5g}"),
    ("top-1 agreement", "top1", "{:.2%}"),
    ("bits per weight", "bpw", "{:.2f}"),
)


def eval_table(data: dict):
    """The measured numbers, one row each (those without a value left out)."""
    from rich.table import Table

    done = f"{data['windows']}/{data['windows_total']} windows"
    if not data["complete"]:
        done += ", interrupted"
    title = f"eval: {clean(Path(data['model']).name)}"
    if data["reference"]:
        title += f" vs {clean(Path(data['reference']).name)}"
    table = Table(title=title, caption=f"{data['tokens']} tokens scored of {data['text_tokens']}"
                  f", context {data['n_ctx']}, {done}")  # fmt: skip
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, key, fmt in ROWS:
        if data.get(key) is not None:
            table.add_row(label, fmt.format(data[key]))
    return table

"""The `lucy` command line: argparse front end over entity/poly, one line per error.

`main()` is the console script. Every `PolyError` becomes `lucy: error: <message>` on stderr and
the error's documented exit code (`poly.errors.EXIT_CODES`); `--debug` shows tracebacks instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

from poly.errors import ModelNotFoundError, NoNetworkError, PolyError, UsageError
from poly.quant.schemes import CLI_QUANTS

PROG = "lucy"
QUANTS = CLI_QUANTS  # ("q4", "q8", "f16", "bf16", "f32"): poly.quant.schemes records
DEMO_QUANT = "q4"  # the demo file: entity.paths.entity_filename(GGUF, DEMO_QUANT)


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')")


# --- parser -------------------------------------------------------------------------------------


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    p.add_argument("--top-k", dest="top_k", type=int, default=None, help="0 = disabled")
    p.add_argument("--top-p", dest="top_p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Run, convert and inspect local LLMs (no args: menu).")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    p = sub.add_parser("models", help="list HF-cache models and .entity files")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("chat", help="chat with a model")
    p.add_argument("model", help=".entity / HF dir / .gguf / cached model id")
    _add_sampling(p)

    p = sub.add_parser("convert", help="convert HF/GGUF to .entity")
    p.add_argument("src")
    p.add_argument("-o", "--out", dest="dst", default=None, help="output .entity path")
    p.add_argument("--quant", choices=QUANTS, default="q4")
    p.add_argument("--force", action="store_true", help="overwrite an existing output")
    p.add_argument("--verify", action="store_true", help="re-open and compare every tensor")

    p = sub.add_parser("generate", help="one completion")
    p.add_argument("model")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--greedy", action="store_true", help="pure argmax, no logit processors")
    p.add_argument("--json", action="store_true")
    _add_sampling(p)

    p = sub.add_parser("bench", help="prefill/decode tok/s and peak RSS")
    p.add_argument("model", nargs="?", help="model to measure (with --compare: a .gguf, optional)")
    p.add_argument(
        "--compare",
        action="store_true",
        help="run benchmarks/compare.py: poly vs llama.cpp vs transformers, side by side",
    )
    p.add_argument("--prompt-tokens", dest="prompt_tokens", type=int, default=64)
    p.add_argument("--new-tokens", dest="new_tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("inspect", help="grid, layers, dtypes, memory")
    p.add_argument("model")
    p.add_argument("--json", action="store_true")

    sub.add_parser("demo", help="SmolLM2-135M: convert once to .entity, then chat")

    p = sub.add_parser("download", help="download a model into the HF cache")
    p.add_argument("repo_id")
    return parser


# --- helpers shared with the menu ---------------------------------------------------------------


def console(stderr: bool = False):
    from lucy.views import make_console

    return make_console(stderr)


def load_model(spec: str):
    import entity

    return entity.load(spec)


def convert_with_progress(con, src, dst=None, quant="q4", force=False, verify=False):
    """Run `entity.convert` under a rich progress bar; returns its report."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    import entity

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
    )
    quiet = not con.is_terminal  # no redraws into pipes and logs
    with Progress(*columns, TimeElapsedColumn(), console=con, transient=True, disable=quiet) as bar:
        task = bar.add_task(f"converting {Path(str(src)).name}", total=None)

        def progress(done, total, detail=""):
            bar.update(task, completed=done, total=total, description=f"{detail}"[:40])

        return entity.convert(src, dst, quant=quant, force=force, verify=verify, progress=progress)


def demo_entity(con) -> Path:
    """SmolLM2 GGUF → q4 .entity in the entity dir, converted once and reused."""
    from entity.paths import entities_dir, entity_filename
    from entity.smollm2 import GGUF_NAME, ensure_smollm2

    dst = entities_dir() / entity_filename(GGUF_NAME, DEMO_QUANT)
    if not dst.exists():
        gguf = ensure_smollm2()
        dst.parent.mkdir(parents=True, exist_ok=True)
        con.print(f"converting {gguf.name} → {dst} (once)")
        convert_with_progress(con, gguf, dst, quant=DEMO_QUANT)
    return dst


def download(repo_id: str) -> Path:
    """Snapshot a repo into the HF cache; any connection failure is one `NoNetworkError`."""
    from huggingface_hub import errors as hf
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=DOWNLOAD_PATTERNS))
    except hf.HFValidationError as exc:
        raise UsageError(f"not a valid repo id: {repo_id!r}") from exc
    except (hf.RepositoryNotFoundError, hf.RevisionNotFoundError) as exc:
        raise ModelNotFoundError(f"{repo_id} not found on the Hub (or gated)") from exc
    except (hf.LocalEntryNotFoundError, OSError, hf.HfHubHTTPError) as exc:
        raise NoNetworkError(
            f"no network: cannot download {repo_id} ({type(exc).__name__})"
        ) from exc


# Safe files only: never pickled *.bin / *.pt weights.
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]


# --- subcommands --------------------------------------------------------------------------------


def cmd_models(args) -> int:
    from lucy import views

    rows = views.list_models()
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=1))
    else:
        console().print(views.models_table(rows))
    return 0


def cmd_chat(args) -> int:
    from lucy import chat_ui

    overrides = chat_ui.sampling_overrides(args)
    chat_ui.check_options(overrides)  # bad values fail before the (slow) load
    model = load_model(args.model)
    chat_ui.run_chat(model, system=args.system, overrides=overrides)
    return 0


def cmd_convert(args) -> int:
    from lucy import views

    con = console()
    start = time.perf_counter()
    report = convert_with_progress(con, args.src, args.dst, args.quant, args.force, args.verify)
    views.print_convert_report(con, report, time.perf_counter() - start)
    return 0


def cmd_generate(args) -> int:
    from lucy import chat_ui

    overrides = chat_ui.sampling_overrides(args, greedy=args.greedy)
    chat_ui.check_options(overrides)
    model = load_model(args.model)
    result = chat_ui.generate_once(
        model, args.prompt, overrides, chat=args.chat, system=args.system
    )
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"])
    return 0


def cmd_bench(args) -> int:
    from lucy import bench, views

    if args.compare:
        return bench.run_compare(args.model, runs=args.runs, as_json=args.json)
    if not args.model:
        raise UsageError("lucy bench needs a MODEL (or --compare)")
    result = bench.run_bench(args.model, args.prompt_tokens, args.new_tokens, args.runs)
    if args.json:
        print(json.dumps(result))
    else:
        console().print(views.bench_table(result))
    return 0


def cmd_inspect(args) -> int:
    from lucy import views

    data = views.inspect_data(load_model(args.model))
    if args.json:
        print(json.dumps(data))
    else:
        views.print_inspect(console(), data)
    return 0


def cmd_demo(args) -> int:
    from lucy import chat_ui

    path = demo_entity(console())
    chat_ui.run_chat(load_model(str(path)))
    return 0


def cmd_download(args) -> int:
    path = download(args.repo_id)
    print(f"downloaded {args.repo_id} → {path}")
    return 0


def cmd_menu(args) -> int:
    from lucy import menu

    return menu.run_menu()


COMMANDS = {
    None: cmd_menu,
    "models": cmd_models,
    "chat": cmd_chat,
    "convert": cmd_convert,
    "generate": cmd_generate,
    "bench": cmd_bench,
    "inspect": cmd_inspect,
    "demo": cmd_demo,
    "download": cmd_download,
}


# --- entry point --------------------------------------------------------------------------------


def _fail(message: str, code: int, debug: bool) -> int:
    if debug:
        traceback.print_exc()
    line = " ".join(str(message).split())  # exactly one line, whatever the message holds
    print(f"{PROG}: error: {line}", file=sys.stderr, flush=True)
    return code


def run(argv: list[str] | None = None) -> int:
    """Parse and dispatch; returns the process exit code instead of exiting."""
    argv = sys.argv[1:] if argv is None else list(argv)
    for stream in (sys.stdin, sys.stdout, sys.stderr):  # bad bytes never crash the terminal UI
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    debug = "--debug" in argv  # accepted anywhere on the line, not only before the subcommand
    try:
        args = build_parser().parse_args([a for a in argv if a != "--debug"])
        return COMMANDS[args.command](args)
    except PolyError as err:
        return _fail(str(err), err.exit_code, debug)
    except KeyboardInterrupt:
        return _fail("interrupted", 130, debug)
    except BrokenPipeError:
        return 0
    except Exception as err:  # noqa: BLE001 - the CLI's last line of defence
        return _fail(f"{type(err).__name__}: {err}", 1, debug)


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(argv))

"""The `lucy` command line: the argparse parser and the entry point, one line per error.

`main()` is the console script. Every `PolyError` becomes `lucy: error: <message>` on stderr and
the error's documented exit code (`poly.errors.EXIT_CODES`); `--debug` shows tracebacks instead.
The subcommands themselves live in `lucy.commands`.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import traceback

from lucy.catalogue import QUANTS
from lucy.terminal import one_line
from poly import __version__
from poly.errors import PolyError, UsageError

PROG = "lucy"
FROM_MODEL = "the model file's setting, else the fallback"


class _Formatter(argparse.HelpFormatter):
    """Every option's help ends with its default (when it has one worth showing)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        shown = default not in (None, False, argparse.SUPPRESS) and action.option_strings
        if shown and "default" not in text:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (naming the closest valid flag) and exit 2."""

    def __init__(self, *args, **kw):
        kw.setdefault("allow_abbrev", False)
        kw.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kw)

    def error(self, message: str) -> None:  # type: ignore[override]
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            message = self._unknown(message[len(prefix) :].split()[0])
        raise UsageError(f"{message} (see '{self.prog} --help')")

    def _unknown(self, flag: str) -> str:
        name = flag.split("=", 1)[0]
        close = difflib.get_close_matches(name, list(self._option_string_actions), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        return f"unrecognized argument {name}{hint}"

    def parse_known_args(self, args=None, namespace=None):
        """A subcommand checks its own flags first: a typo is named (with the closest flag)
        before argparse reports a missing required one, and the help pointer is its own."""
        if self._subparsers is None and args is not None:
            for arg in args:
                if arg == "--":
                    break
                flag = arg.split("=", 1)[0]
                if _looks_like_flag(arg) and flag not in self._option_string_actions:
                    self.error(self._unknown(flag))
        return super().parse_known_args(args, namespace)


def _looks_like_flag(arg: str) -> bool:
    if not arg.startswith("-") or arg == "-" or " " in arg:
        return False
    try:
        float(arg)
        return False  # a negative number is a value
    except ValueError:
        return True


# --- parser -------------------------------------------------------------------------------------


def _add_max_experts(p: argparse.ArgumentParser, memory: bool = True) -> None:
    p.add_argument("--max-experts", dest="max_experts", type=int, default=None,
                   help="MoE model: keep at most N experts resident (LRU, paged from the file)")  # fmt: skip
    if memory:
        p.add_argument("--memory", default=None, metavar="SIZE",
                       help="fit a memory budget (e.g. 6G): picks --max-experts and the context")  # fmt: skip


def _add_kv_cache(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache", dest="kv_cache", choices=("f32", "f16", "q8_0"), default=None,
                   help="KV cache precision: f32 (default, exact), f16 (half the memory) or q8_0 "
                        "(llama.cpp's blocks, 8.5 bits a value; the reference path)")  # fmt: skip


def _add_speculation(p: argparse.ArgumentParser, draft: bool = True) -> None:
    """Speculative decoding: N proposed tokens checked in one pass (docs/speculative.md)."""
    p.add_argument("--lookup", type=int, default=None, metavar="N",
                   help="prompt lookup: propose up to N tokens that followed the first earlier "
                   "occurrence of the last n-gram (8 tokens down to 1; 1..63)")  # fmt: skip
    if not draft:
        return
    p.add_argument("--draft", default=None, metavar="MODEL",
                   help="a draft model with the same vocabulary proposes tokens (e.g. the q4 "
                   "of the same weights)")  # fmt: skip
    p.add_argument("--draft-tokens", dest="draft_tokens", type=int, default=None, metavar="N",
                   help="tokens the draft proposes per pass, at most (1..63; default 8); fewer "
                   "after an early rejection")  # fmt: skip


def _add_repetition(p: argparse.ArgumentParser) -> None:
    """min-p and the repetition controls, under llama.cpp's flag names and meanings."""
    for flag, kind, what in (
        ("--min-p", float, "drop tokens below P x the top one's probability; 0 = off"),
        ("--repeat-penalty", float, "penalise ids seen in the last N (CTRL); 1 = off"),
        ("--repeat-last-n", int, "the repeat penalty's N; -1 = all, 0 = off"),
        ("--dry-multiplier", float, "DRY: penalise extending a repeated sequence; 0 = off"),
        ("--dry-base", float, "DRY: penalty growth per extra repeated token"),
        ("--dry-allowed-length", int, "DRY: repeats up to this length are free"),
        ("--dry-penalty-last-n", int, "DRY: tokens it looks back at; -1 = all, 0 = off"),
    ):
        dest = {"--repeat-penalty": "repetition_penalty"}.get(flag, flag[2:].replace("-", "_"))
        p.add_argument(flag, dest=dest, type=kind, default=None,
                       help=f"{what} (default: {FROM_MODEL})")  # fmt: skip


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="system message (turns on the chat template)")
    p.add_argument(
        "--temperature", type=float, default=None, help=f"0 = greedy (default: {FROM_MODEL})"
    )
    p.add_argument(
        "--top-k", dest="top_k", type=int, default=None, help=f"0 = off (default: {FROM_MODEL})"
    )
    p.add_argument(
        "--top-p", dest="top_p", type=float, default=None, help=f"1 = off (default: {FROM_MODEL})"
    )
    _add_repetition(p)
    p.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one)")
    p.add_argument(
        "--max-tokens",
        dest="max_tokens",
        type=int,
        default=None,
        help=f"most tokens to generate (default: {FROM_MODEL})",
    )
    p.add_argument(
        "--verbose", action="store_true", help="print the settings in use and where they came from"
    )


def _add_tp(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="N",
        help="tensor parallel over N MPI ranks (mpiexec -n N python -m mpi4py -m lucy ...)",
    )


MODEL_HELP = ".entity file, HF model dir, .gguf file or cached HF model id"


def _models_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="list HF-cache models, .entity files and the demo's GGUFs")
    p.add_argument("--json", action="store_true", help="one JSON list instead of a table")


def _chat_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="chat with a model")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument(
        "--on-full",
        choices=("ask", "drop-oldest", "stop"),
        default=None,
        help="when the context is full: ask (terminal default), drop-oldest turns, or stop "
        "(exit 8; the default for piped stdin)",
    )
    _add_sampling(p)
    _add_speculation(p)
    _add_tp(p)
    _add_max_experts(p)
    _add_kv_cache(p)


def _convert_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="convert HF/GGUF to .entity")
    p.add_argument("src", help="HF model dir, .gguf file or cached HF model id")
    p.add_argument(
        "-o", "--out", dest="dst", default=None, help="output .entity path (default: in POLY_HOME)"
    )
    p.add_argument("--quant", choices=QUANTS, default="q4", help="weight format of the output")
    p.add_argument("--force", action="store_true", help="overwrite an existing output")
    p.add_argument("--verify", action="store_true", help="re-open and compare every tensor")
    p.add_argument(
        "--bpw", default=None, metavar="X",
        help="choose each tensor's type so the whole file is <= X bits per weight (+0.05)",
    )  # fmt: skip
    p.add_argument(
        "--calibration", default=None, metavar="FILE",
        help="calibration text for the importance matrix (default: the shipped text)",
    )  # fmt: skip
    p.add_argument(
        "--to", choices=("entity", "gguf"), default="entity",
        help="output format: .entity, or a GGUF file llama.cpp loads (llama/qwen2/qwen3)",
    )  # fmt: skip


def _generate_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="one completion, streamed to stdout")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--prompt", required=True, help="the prompt text (required)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--greedy", action="store_true", help="pure argmax, no logit processors")
    p.add_argument("--json", action="store_true", help="one JSON object at the end, no streaming")
    _add_sampling(p)
    _add_speculation(p)
    _add_tp(p)
    _add_max_experts(p)
    _add_kv_cache(p)


def _bench_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="prefill/decode tok/s and peak RSS")
    p.add_argument("model", nargs="?", help="model to measure (with --compare: a .gguf, optional)")
    p.add_argument(
        "--compare",
        action="store_true",
        help="run benchmarks/compare.py: poly vs llama.cpp vs transformers, side by side",
    )
    p.add_argument("--prompt-tokens", dest="prompt_tokens", type=int, default=64,
                   help="prompt length in tokens")  # fmt: skip
    p.add_argument("--new-tokens", dest="new_tokens", type=int, default=32,
                   help="tokens to decode per run")  # fmt: skip
    p.add_argument("--runs", type=int, default=3, help="timed runs (the median is shown)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.add_argument("--lengths", type=int, nargs="+", default=None, metavar="N",
                   help="also measure prefill of N-token prompts and decode after N tokens of "
                   "context, for each N")  # fmt: skip
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw prefill and decode tok/s against prompt length and context into a "
                   "PNG (the plot extra; --lengths, default 16 64 256 1024 where they fit)")  # fmt: skip
    _add_speculation(p)
    _add_tp(p)
    _add_max_experts(p)
    _add_kv_cache(p)


def _eval_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="perplexity and KL divergence from a reference, on a text")
    p.add_argument("model", nargs="+", help=MODEL_HELP + " (several: each in turn)")
    p.add_argument("--reference", default=None, metavar="REF",
                   help="the model to compare with (usually the float32 of the same weights)")  # fmt: skip
    p.add_argument(
        "--text", required=True, metavar="FILE", help="UTF-8 text to score, - for stdin (required)"
    )
    p.add_argument("--ctx", type=int, default=512, metavar="N",
                   help="window length in tokens; the second half of each is scored")  # fmt: skip
    p.add_argument("--json", action="store_true",
                   help="one JSON object (a line per MODEL) instead of a table")  # fmt: skip
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw each MODEL's KL divergence from REF (perplexity without --reference) "
                   "against its bits per weight into a PNG (the plot extra)")  # fmt: skip


def _inspect_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="grid, layers, dtypes, memory")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    _add_max_experts(p, memory=False)
    p.add_argument("--fit", default=None, metavar="SIZE",
                   help="will it fit in SIZE (e.g. 8G): weights, experts, KV cache, bytes per token")  # fmt: skip
    p.add_argument("--ctx", type=int, default=None, help="--fit: the context, tokens")


def _demo_parser(sub, name: str) -> None:
    sub.add_parser(name, help="SmolLM2-135M: convert once to .entity, then chat")


def _download_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="download a model into the HF cache")
    p.add_argument("repo_id", help="HF repo id, org/name")


def _serve_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="OpenAI-compatible HTTP server (the serve extra)")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--max-batch", dest="max_batch", type=int, default=16,
                   help="sequences decoded together")  # fmt: skip
    p.add_argument("--ctx", type=int, default=None, help="context per sequence, tokens")
    p.add_argument("--kv-pages", dest="kv_pages", type=int, default=None,
                   help="pages of 16 positions in the KV pool (0: contiguous caches)")  # fmt: skip
    p.add_argument("--api-key", dest="api_key", default=None, help="required bearer token")
    p.add_argument("--verbose", action="store_true",
                   help="print the sampling settings a request that leaves them out runs with")  # fmt: skip
    p.add_argument("--max-queue", dest="max_queue", type=int, default=64,
                   help="waiting requests before 429")  # fmt: skip
    p.add_argument("--log-level", dest="log_level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's and the request lines' (info) log level")  # fmt: skip
    p.add_argument("--header-timeout", dest="header_timeout", type=float, default=10.0,
                   help="seconds a client has to send a request's head")  # fmt: skip
    p.add_argument("--body-timeout", dest="body_timeout", type=float, default=60.0,
                   help="seconds a client has to send a request's body")  # fmt: skip
    p.add_argument("--max-connections", dest="max_connections", type=int, default=None,
                   help="open client connections; more get 503 (default: 256, or fewer if "
                   "ulimit -n is low)")  # fmt: skip
    _add_kv_cache(p)
    _add_max_experts(p)
    _add_tp(p)
    _add_speculation(p)
    from lucy.server.extras import add_arguments

    add_arguments(p)


# The order here is the order `lucy --help` lists the subcommands in.
SUBCOMMANDS = {
    "models": _models_parser,
    "chat": _chat_parser,
    "convert": _convert_parser,
    "generate": _generate_parser,
    "bench": _bench_parser,
    "eval": _eval_parser,
    "inspect": _inspect_parser,
    "demo": _demo_parser,
    "download": _download_parser,
    "serve": _serve_parser,
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Run, convert and inspect local LLMs (no args: menu).")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--version", action="version", version=f"lucy {__version__} (polyloom)")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    for name, add_parser in SUBCOMMANDS.items():
        add_parser(sub, name)
    return parser


# --- entry point --------------------------------------------------------------------------------


def _fail(message: str, code: int, debug: bool) -> int:
    if debug:
        traceback.print_exc()
    print(f"{PROG}: error: {one_line(message)}", file=sys.stderr, flush=True)
    return code


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the flush at exit does not hit the closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real stdout (embedded, tests): nothing to protect
        pass


def run(argv: list[str] | None = None) -> int:
    """Parse and dispatch; returns the process exit code instead of exiting."""
    from lucy.commands import COMMANDS

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
    except BrokenPipeError:  # the reader left (`lucy inspect M | head`): a normal end, quietly
        _silence_stdout()
        return 0
    except Exception as err:  # noqa: BLE001 - the CLI's last line of defence
        return _fail(f"{type(err).__name__}: {err}", 1, debug)


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(argv))

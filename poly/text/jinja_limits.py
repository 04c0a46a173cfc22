"""Size and work limits for every filter, test, global, string method and operator a chat
template can reach (issue #18 item 2).

Two rules close the template bombs:

1. Nothing is evaluated at compile time. Jinja folds constant expressions while compiling, even
   in dead branches (`{% if false %}{{ 'x'|center(999999999) }}{% endif %}`), before any render
   limit applies. The optimizer is switched off and every filter and test is wrapped as a
   `pass_context` callable, which Jinja never folds.
2. At render time every operation whose result size is set by an argument (`center(w)`,
   `indent(w)`, `slice(n)`, `batch(n, fill)`, `lipsum(n)`, `replace`, `str.ljust(w)`, printf and
   `str.format` widths, `tojson(indent=)`) is checked *before* it runs, and the size of every
   produced string or sequence is charged to a per-render allocation budget (which also bounds
   the quadratic `sum`/`+`/`~` growth loops). The budget lives in `RenderBudget`.
"""

from __future__ import annotations

import contextvars
import re
import time
from collections.abc import Callable
from typing import Any

import jinja2
import jinja2.filters
import jinja2.utils

from poly.errors import TemplateError

__all__ = [
    "harden_environment",
    "precheck_method",
    "charge",
    "concat",
    "budget",
    "RenderBudget",
    "TemplateLimitError",
    "BUDGET",
]


class TemplateLimitError(TemplateError):
    """Rendering exceeded a size, loop or time bound."""

    code = "template_limit"


MAX_OUTPUT_CHARS = 16 << 20
MAX_LOOP_STEPS = 1_000_000  # summed over every range() of one render
MAX_RENDER_SECONDS = 10.0
# Chars/items of every string or sequence a render produces, summed (bounds memory and the
# quadratic growth of `+`, `~` and `sum` in loops): twice the output limit.
MAX_ALLOC_UNITS = 2 * MAX_OUTPUT_CHARS
# printf widths/precisions of 7+ digits, or taken from the arguments (`%*d`).
HUGE_FORMAT = re.compile(r"%[-+ #0]*(?:\*|\d{7,})|%[-+ #0]*\d*\.(?:\*|\d{7,})")


class RenderBudget:
    """Per-render counters: loop steps, chars/items built, and the deadline."""

    def __init__(self) -> None:
        self.steps = 0
        self.allocated = 0
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS

    def tick(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > MAX_LOOP_STEPS:
            raise TemplateLimitError(f"template loops exceed {MAX_LOOP_STEPS} steps")
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"template rendering exceeded {MAX_RENDER_SECONDS:g} s")

    def alloc(self, n: int) -> None:
        self.allocated += n
        if self.allocated > MAX_ALLOC_UNITS:
            raise TemplateLimitError(f"template builds more than {MAX_ALLOC_UNITS} chars/items")
        self.tick(0)


BUDGET: contextvars.ContextVar[RenderBudget | None] = contextvars.ContextVar(
    "poly_chat_budget", default=None
)


def budget() -> RenderBudget:
    """The budget of the current render (a fresh one outside `ChatTemplate.render`)."""
    current = BUDGET.get()
    if current is None:
        current = RenderBudget()
        BUDGET.set(current)
    return current


# Filters whose running time is super-linear in a long input (regex scans, text wrapping).
_TEXT_SCAN_LIMIT = 1 << 20
_SCANNING = frozenset({"striptags", "urlize", "wordwrap", "title", "wordcount", "pprint"})
_HUGE_BRACE = re.compile(r"\{[^{}]*:[^{}]*(?:\d{7,}|\{)")
_MAX_JSON_INDENT = 64


def charge(value: Any) -> Any:
    """Charge the size of a produced string/sequence/mapping to the render budget."""
    if isinstance(value, str | list | tuple | dict | bytes):
        budget().alloc(len(value))
    return value


def _refuse(msg: str):
    raise TemplateLimitError(msg)


def _width(n: Any, what: str, times: int = 1) -> None:
    if isinstance(n, int) and n > 0 and n * max(times, 1) > MAX_OUTPUT_CHARS:
        _refuse(f"{what} too large")


def _replace_size(s: str, old: Any, new: Any, count: Any = -1) -> None:
    if not (isinstance(old, str) and isinstance(new, str)) or len(new) <= len(old):
        return
    hits = len(s) + 1 if old == "" else s.count(old)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    _width(len(s) + hits * (len(new) - len(old)), "replace() result")


def _printf(fmt: Any) -> None:
    if isinstance(fmt, str) and HUGE_FORMAT.search(fmt):
        _refuse("format width or precision too large")


def _brace_format(fmt: Any) -> None:
    if isinstance(fmt, str) and _HUGE_BRACE.search(fmt):
        _refuse("format width too large (or nested)")


def _lines(s: Any) -> int:
    return s.count("\n") + 1 if isinstance(s, str) else 1


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _precheck_filter(name: str, value: Any, args: tuple, kwargs: dict) -> None:
    work = budget()
    if name == "center":
        _width(_arg(args, kwargs, 0, "width", 80), "center() width")
    elif name == "indent":
        _width(_arg(args, kwargs, 0, "width", 4), "indent() width", _lines(value))
    elif name == "slice":
        n = _arg(args, kwargs, 0, "slices")
        work.tick(n if isinstance(n, int) and n > 0 else 0)
    elif name == "batch":
        n = _arg(args, kwargs, 0, "linecount")
        if _arg(args, kwargs, 1, "fill_with") is not None and isinstance(n, int) and n > 0:
            work.tick(n)
    elif name == "replace" and isinstance(value, str):
        _replace_size(
            value,
            _arg(args, kwargs, 0, "old"),
            _arg(args, kwargs, 1, "new"),
            _arg(args, kwargs, 2, "count", -1),
        )
    elif name == "format":
        _printf(value)
    elif name == "tojson":
        ind = _arg(args, kwargs, 1, "indent")
        if (isinstance(ind, int) and ind > _MAX_JSON_INDENT) or (
            isinstance(ind, str) and len(ind) > _MAX_JSON_INDENT
        ):
            _refuse("tojson indent too large")
    elif name in _SCANNING and isinstance(value, str) and len(value) > _TEXT_SCAN_LIMIT:
        _refuse(f"{name}() input too long ({len(value)} chars)")


def _safe_sum(iterable: Any, start: Any = 0) -> Any:
    total = start
    for item in iterable:
        total = charge(total + item)
    return total


def _wrap(name: str, func: Callable, is_filter: bool) -> Callable:
    # what jinja2.pass_context / pass_eval_context / pass_environment marked the callable with
    kind = getattr(getattr(func, "jinja_pass_arg", None), "name", None)

    @jinja2.pass_context
    def limited(context, *args, **kwargs):
        budget().tick(0)  # the time limit
        if is_filter and args:
            _precheck_filter(name, args[0], args[1:], kwargs)
        if kind == "context":
            result = func(context, *args, **kwargs)
        elif kind == "eval_context":
            result = func(context.eval_ctx, *args, **kwargs)
        elif kind == "environment":
            result = func(context.environment, *args, **kwargs)
        else:
            result = func(*args, **kwargs)
        return charge(result)

    limited.__name__ = f"limited_{name}"
    return limited


def _sum_filter(environment, iterable, attribute=None, start=0):
    if attribute is not None:
        getter = jinja2.filters.make_attrgetter(environment, attribute)
        iterable = map(getter, iterable)
    return _safe_sum(iterable, start)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    for v in (n, min, max):
        if not isinstance(v, int) or v < 0:
            _refuse("lipsum() arguments must be small non-negative integers")
    budget().tick(n * max)
    return charge(jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max))


def concat(*parts: Any) -> str:
    """`a ~ b ~ c`: the joined string, charged to the budget."""
    budget().tick(0)
    return charge("".join(map(str, parts)))


def precheck_method(obj: Any, args: tuple, kwargs: dict) -> None:
    """Checks a call of a bound `str` method before it runs (`'x'.ljust(10**9)`)."""
    owner = getattr(obj, "__self__", None)
    if not isinstance(owner, str):
        return
    name = getattr(obj, "__name__", "")
    if name in ("center", "ljust", "rjust", "zfill"):
        _width(_arg(args, kwargs, 0, "width"), f"{name}() width")
    elif name == "expandtabs":
        size = _arg(args, kwargs, 0, "tabsize", 8)
        _width(size, "expandtabs() size", owner.count("\t"))
    elif name == "replace":
        _replace_size(
            owner,
            _arg(args, kwargs, 0, "old"),
            _arg(args, kwargs, 1, "new"),
            _arg(args, kwargs, 2, "count", -1),
        )
    elif name in ("format", "format_map"):
        _brace_format(owner)
    elif name in _SCANNING and len(owner) > _TEXT_SCAN_LIMIT:
        _refuse(f"{name}() input too long")


def harden_environment(env: jinja2.Environment) -> None:
    """Constant folding off; every filter and test wrapped; lipsum and sum size-checked."""
    env.optimized = False
    env.filters["sum"] = jinja2.pass_environment(_sum_filter)
    env.filters = {k: _wrap(k, f, True) for k, f in env.filters.items()}
    env.tests = {k: _wrap(k, f, False) for k, f in env.tests.items()}
    env.globals["lipsum"] = _lipsum

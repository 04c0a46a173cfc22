"""The hardened Jinja environment chat templates render in.

It mirrors transformers' `_compile_jinja_template` (trim_blocks, lstrip_blocks, loopcontrols,
`raise_exception`, `strftime_now`, HF's `tojson`, guarded `dict`/`namespace`) so our text equals
`apply_chat_template`. On top of the sandbox we reject, before anything runs, any access to
underscore names and any include/import/extends; range, `*`, `**`, `%`, output size and render
time are bounded (CVE-2024-34359 came from an unsandboxed template).
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from poly.errors import TemplateError, TemplateSecurityError


class TemplateLimitError(TemplateError):
    """Rendering exceeded a size, loop or time bound."""

    code = "template_limit"


MAX_TEMPLATE_CHARS = 1 << 20  # real templates are < 20 kB
MAX_OUTPUT_CHARS = 16 << 20
MAX_LOOP_STEPS = 1_000_000  # summed over every range() of one render
MAX_RENDER_SECONDS = 10.0
MAX_INT_BITS = 4096
# printf widths/precisions of 7+ digits, or taken from the arguments (`%*d`).
_HUGE_FORMAT = re.compile(r"%[-+ #0]*(?:\*|\d{7,})|%[-+ #0]*\d*\.(?:\*|\d{7,})")

# --- the sandboxed environment ---------------------------------------------------------------


class RenderBudget:
    """Per-render counters, charged by every loop iteration and every range()."""

    def __init__(self) -> None:
        self.steps = 0
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS

    def tick(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > MAX_LOOP_STEPS:
            raise TemplateLimitError(f"template loops exceed {MAX_LOOP_STEPS} steps")
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"template rendering exceeded {MAX_RENDER_SECONDS:g} s")


BUDGET: contextvars.ContextVar[RenderBudget | None] = contextvars.ContextVar(
    "poly_chat_budget", default=None
)
_GUARD_NAME = "poly_loop_guard"


def _budget() -> RenderBudget:
    budget = BUDGET.get()
    if budget is None:  # rendering outside ChatTemplate.render (e.g. a test)
        budget = RenderBudget()
        BUDGET.set(budget)
    return budget


def _bounded_range(*args: int) -> range:
    # Like the sandbox's safe_range, but the whole range is charged to the render budget.
    rng = range(*args)
    _budget().tick(len(rng))
    return rng


def _loop_guard(iterable: Any):
    # Wraps every {% for %} iterable: loops over long strings or lists cannot run unbounded.
    budget = _budget()
    for item in iterable:
        budget.tick()
        yield item


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(str(message))


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # HF's override: no HTML escaping, and the json.dumps options exposed.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` without exposing the dict type itself (HF's TemplateDict)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore attributes (HF's TemplateNamespace)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _HardenedEnvironment(ImmutableSandboxedEnvironment):
    """Unsafe attribute access raises at once instead of yielding a silent Undefined."""

    intercepted_binops = frozenset(["**", "*", "%"])

    def unsafe_undefined(self, obj: Any, attribute: str):
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} is not allowed"
        )

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and max(abs(left), 2).bit_length() * right > MAX_INT_BITS:
                raise TemplateLimitError("integer power too large")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(n, int):
                    if len(seq) * n > MAX_OUTPUT_CHARS:
                        raise TemplateLimitError("sequence repetition too large")
        if operator == "%" and isinstance(left, str) and _HUGE_FORMAT.search(left):
            raise TemplateLimitError("format width or precision too large")
        return super().call_binop(context, operator, left, right)


class _AssistantTracker(jinja2.ext.Extension):
    """Parses HF's `{% generation %}...{% endgeneration %}` as a plain block (no mask tracking)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _build_environment() -> _HardenedEnvironment:
    env = _HardenedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_AssistantTracker, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    env.globals["range"] = _bounded_range
    env.globals[_GUARD_NAME] = _loop_guard
    return env


_ENV = _build_environment()
_FORBIDDEN_NODES = (
    jinja2.nodes.Include,
    jinja2.nodes.Import,
    jinja2.nodes.FromImport,
    jinja2.nodes.Extends,
)


def _check_ast(tree: jinja2.nodes.Template) -> None:
    """Refuses, before any rendering, the constructs only an attack needs."""
    for node in tree.find_all(_FORBIDDEN_NODES):
        kind = type(node).__name__.lower()
        raise TemplateSecurityError(
            f"chat templates may not use {{% {kind} %}} (line {node.lineno})"
        )
    for node in tree.find_all(jinja2.nodes.Name):
        if node.name == _GUARD_NAME:
            raise TemplateSecurityError(f"{_GUARD_NAME!r} is a reserved name")
    for node in tree.find_all((jinja2.nodes.Getattr, jinja2.nodes.Getitem)):
        name = node.attr if isinstance(node, jinja2.nodes.Getattr) else None
        if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
            name = node.arg.value
        if isinstance(name, str) and name.startswith("_"):
            raise TemplateSecurityError(
                f"chat template reaches for internal attribute {name!r} (line {node.lineno})"
            )


def _guard_loops(tree: jinja2.nodes.Template) -> None:
    # {% for x in it %} becomes {% for x in poly_loop_guard(it) %}.
    for node in tree.find_all(jinja2.nodes.For):
        guard = jinja2.nodes.Name(_GUARD_NAME, "load", lineno=node.lineno)
        node.iter = jinja2.nodes.Call(guard, [node.iter], [], None, None, lineno=node.lineno)


@functools.lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    if len(source) > MAX_TEMPLATE_CHARS:
        raise TemplateLimitError(
            f"chat template has {len(source)} chars (limit {MAX_TEMPLATE_CHARS})"
        )
    try:
        tree = _ENV.parse(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TemplateError(f"chat template syntax error (line {e.lineno}): {e.message}") from e
    _check_ast(tree)
    _guard_loops(tree)
    try:
        return _ENV.from_string(tree)
    except (jinja2.exceptions.TemplateError, RecursionError) as e:
        raise TemplateError(f"chat template does not compile: {e}") from e

"""The hardened Jinja environment chat templates render in.

It mirrors transformers' `_compile_jinja_template` (trim_blocks, lstrip_blocks, loopcontrols,
`raise_exception`, `strftime_now`, HF's `tojson`, guarded `dict`/`namespace`) so our text equals
`apply_chat_template`. On top of the sandbox we reject, before anything runs, any access to
underscore names and any include/import/extends; range, `*`, `**`, `%`, output size and render
time are bounded (CVE-2024-34359 came from an unsandboxed template).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import jinja2.visitor
from jinja2.sandbox import ImmutableSandboxedEnvironment

from poly.errors import TemplateError, TemplateSecurityError
from poly.text import jinja_limits

# The limits and the per-render budget live in poly.text.jinja_limits (re-exported here).
TemplateLimitError = jinja_limits.TemplateLimitError
RenderBudget = jinja_limits.RenderBudget
BUDGET = jinja_limits.BUDGET
MAX_TEMPLATE_CHARS = 1 << 20  # real templates are < 20 kB
MAX_OUTPUT_CHARS = jinja_limits.MAX_OUTPUT_CHARS
MAX_LOOP_STEPS = jinja_limits.MAX_LOOP_STEPS
MAX_RENDER_SECONDS = jinja_limits.MAX_RENDER_SECONDS
MAX_ALLOC_UNITS = jinja_limits.MAX_ALLOC_UNITS
MAX_INT_BITS = 4096
_GUARD_NAME = "poly_loop_guard"
_CONCAT_NAME = "poly_concat"
_budget = jinja_limits.budget


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

    intercepted_binops = frozenset(["**", "*", "%", "+"])

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
        if operator == "%" and isinstance(left, str) and jinja_limits.HUGE_FORMAT.search(left):
            raise TemplateLimitError("format width or precision too large")
        return jinja_limits.charge(super().call_binop(context, operator, left, right))

    def wrap_str_format(self, value: Any):
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:  # `'{:>999999999}'.format(1)`: refused when the method is reached
            jinja_limits.precheck_method(value, (), {})
        return wrapped

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's signature
        jinja_limits.precheck_method(__obj, args, kwargs)
        _budget().tick(0)
        return jinja_limits.charge(super().call(__context, __obj, *args, **kwargs))


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
    env.globals[_CONCAT_NAME] = jinja_limits.concat
    jinja_limits.harden_environment(env)
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
        if node.name in (_GUARD_NAME, _CONCAT_NAME):
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
    _ConcatGuard().visit(tree)


class _ConcatGuard(jinja2.visitor.NodeTransformer):
    """`a ~ b` becomes `poly_concat(a, b)` (size-charged; Jinja compiles `~` to a plain join)."""

    def visit_Concat(self, node: jinja2.nodes.Concat) -> jinja2.nodes.Call:  # noqa: N802
        self.generic_visit(node)
        fn = jinja2.nodes.Name(_CONCAT_NAME, "load", lineno=node.lineno)
        return jinja2.nodes.Call(fn, list(node.nodes), [], None, None, lineno=node.lineno)


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

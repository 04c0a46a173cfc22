"""Fuzz targets for untrusted text programs (issue #18 acceptance 4): chat templates (compile
and render under the sandbox's bounds) and tokenizer.json pre-tokenizer regexes.

Budget as for the parser suite (`harness.FUZZ`): 300 derandomized examples in CI,
``POLY_FUZZ_EXAMPLES=100000`` in the long mode. The only acceptable outcomes are success or a
`PolyError`; every example is bounded in time (generous: the render limit is 10 s) and the
process' peak RSS stays bounded over the whole run.
"""

from __future__ import annotations

import functools
import json
import resource
import time

from hypothesis import given
from hypothesis import strategies as st

from poly.errors import PolyError
from tests.fuzz.harness import FUZZ

PEAK_RSS_MB = 2500  # the whole pytest process, after any number of examples
EXAMPLE_SECONDS = 60  # one compile + render (limit 10 s) or one tokenizer load + encodes


def _peak_mb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


# --- chat templates --------------------------------------------------------------------------------

BIG = st.sampled_from([0, 1, 2, 7, 40, 10**3, 10**6, 10**7, 999_999_999, 2**31, 10**18, -5])
STR = st.sampled_from(["''", "'x'", "'ab\\ncd'", "'<a>'", "'%s'", "'%999999999d'",
                       "'{}'", "'{:>999999999}'", "'\\t'", "'a.b'", "'Ġé'"])  # fmt: skip
FILTERS = [
    "center({n})", "indent({n}, true)", "slice({n})", "batch({n}, 0)", "batch({n})",
    "replace('', {s})", "replace('a', {s})", "truncate({n})", "wordwrap({n})", "format({n})",
    "join({s})", "tojson(indent={n})", "tojson", "list", "length", "sum", "sum(start=[])",
    "reverse", "sort", "unique", "string", "upper", "title", "striptags", "urlize",
    "wordcount", "trim", "first", "last", "default({s})", "int", "float", "round({n})",
    "map('center', {n})", "map('upper')", "select('odd')", "reject('none')", "dictsort",
    "items", "pprint", "e", "count", "abs", "filesizeformat", "xmlattr", "urlencode",
]  # fmt: skip
METHODS = ["center({n})", "ljust({n})", "rjust({n})", "zfill({n})", "expandtabs({n})",
           "format({n})", "replace('', {s})", "split()", "join([{s}, {s}])", "upper()"]  # fmt: skip
TESTS = ["odd", "even", "string", "number", "divisibleby({n})", "sequence", "defined"]


@st.composite
def expressions(draw, depth: int = 0):
    n, s = draw(BIG), draw(STR)
    atoms = [s, str(n), f"[{s}, {n}]", "messages", "messages[0]['content']",
             f"lipsum(n={n})", f"range({n})|list", "namespace(x=1).x", f"({s} * {n})",
             f"({n} ** {draw(BIG)})", f"({s} % {n})"]  # fmt: skip
    expr = draw(st.sampled_from(atoms))
    if depth < 3:
        kind = draw(st.integers(0, 5))
        if kind == 1:
            expr = f"({expr})|" + draw(st.sampled_from(FILTERS)).format(n=n, s=s)
        elif kind == 2:
            expr = f"({expr}).{draw(st.sampled_from(METHODS)).format(n=n, s=s)}"
        elif kind == 3:
            op = draw(st.sampled_from(["~", "+", "*", "%", "**", "//", "in"]))
            expr = f"({expr}) {op} ({draw(expressions(depth + 1))})"
        elif kind == 4:
            expr = f"(({expr}) is {draw(st.sampled_from(TESTS)).format(n=n)})"
        elif kind == 5:
            expr = f"({expr}) if ({draw(expressions(depth + 1))}) else ({s})"
    return expr


@st.composite
def templates(draw):
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        e = draw(expressions())
        shape = draw(st.integers(0, 5))
        if shape == 0:
            parts.append("{{ " + e + " }}")
        elif shape == 1:  # dead branch: must not be evaluated (constant folding)
            parts.append("{% if false %}{{ " + e + " }}{% endif %}")
        elif shape == 2:
            n = draw(BIG)
            parts.append(f"{{% for i in range({n}) %}}{{{{ {e} }}}}{{% endfor %}}")
        elif shape == 3:
            parts.append("{% set ns = namespace(v='ab') %}{% for i in range(40) %}"
                         "{% set ns.v = ns.v ~ ns.v %}{% endfor %}{{ " + e + " }}")  # fmt: skip
        elif shape == 4:
            parts.append("{% filter " + draw(st.sampled_from(FILTERS)).format(
                n=draw(BIG), s=draw(STR)) + " %}{{ " + e + " }}{% endfilter %}")  # fmt: skip
        else:
            parts.append("{% macro m(k) %}{{ m(k) }}{% endmacro %}{{ m(1) }}")
    return "".join(parts)


@FUZZ
@given(source=st.one_of(templates(), st.text(max_size=200)))
def test_chat_templates_compile_and_render_bounded(source):
    from poly.text.chat import ChatTemplate

    t = time.monotonic()
    try:
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    except PolyError:
        pass
    assert time.monotonic() - t < EXAMPLE_SECONDS
    assert _peak_mb() < PEAK_RSS_MB


# --- tokenizer.json pre-tokenizer regexes ---------------------------------------------------------

ATOMS = ["a", "b", r"\w", r"\s", r"\d", ".", "[ab]", r"\p{L}", r"[^\s]", "'s", " ?", r"\S"]
QUANTS = ["", "", "+", "*", "?", "{1,3}", "{2,}", "+?", "*+"]


@st.composite
def regexes(draw, depth: int = 0):
    items = []
    for _ in range(draw(st.integers(1, 3))):
        if depth < 3 and draw(st.booleans()):
            inner = draw(regexes(depth + 1))
            if draw(st.booleans()):
                inner += "|" + draw(regexes(depth + 1))
            item = draw(st.sampled_from(["(", "(?:", "(?i:"])) + inner + ")"
        else:
            item = draw(st.sampled_from(ATOMS))
        items.append(item + draw(st.sampled_from(QUANTS)))
    return "".join(items) + draw(st.sampled_from(["", "$", "(?!\\S)"]))


_TEXTS = ["a" * 27 + "!", "aaaaaaaaaaaaaaaaaaaaaaaaaa b", "The quick brown fox's 123 ça va?", ""]


def _tokenizer_json(regex: str) -> str:
    """The fixture tokenizer with ``regex`` as a Split in front of its pre-tokenizer."""
    data = json.loads(_base_json())
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        data.get("pre_tokenizer") or {"type": "ByteLevel", "add_prefix_space": False,
                                      "trim_offsets": True, "use_regex": False}]}  # fmt: skip
    return json.dumps(data)


@functools.cache
def _base_json() -> str:
    from tests.hf_fixtures import build_tokenizer

    return build_tokenizer().to_str()


@FUZZ
@given(regex=st.one_of(regexes(), st.text(max_size=40)), text=st.sampled_from(_TEXTS))
def test_tokenizer_pre_tokenizer_regexes_never_escape(regex, text):
    from poly.text.tokenizer import Tokenizer

    t = time.monotonic()
    try:
        tok = Tokenizer.from_str(_tokenizer_json(regex))
        ids = tok.encode(text)
        tok.decode(ids)
    except PolyError:
        pass  # a refused regex, a panic turned into TokenizerError, ... (never a BaseException)
    assert time.monotonic() - t < EXAMPLE_SECONDS
    assert _peak_mb() < PEAK_RSS_MB

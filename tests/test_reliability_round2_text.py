"""Reliability round 2 (issue #18), chat templates and tokenizers (items 2, 3): one test (or more) per item, reproducing the
reported input. Memory bounds are the peak RSS of a child process (`tests.round2_support`),
generous for a loaded machine; no test asserts a tight wall-clock time.
"""

from __future__ import annotations

import pytest

from tests.fuzz.corpus import expect_error
from tests.hf_fixtures import make_tiny_checkpoint
from tests.round2_support import lucy, one_error_line, run_py

pytestmark = pytest.mark.timeout(300)


# --- item 2: chat-template bombs are bounded at compile and at render ---------------------------

DEAD_BOMB = "{% if false %}{{ 'x'|center(999999999) }}{% endif %}"
DEAD_THREE = (
    "{% if false %}{{ 'x'|center(999999999) }}{{ 'y'|indent(999999999, true) }}"
    "{{ lipsum(n=300000) }}{% endif %}"
)
RENDER_BOMBS = {
    "lipsum": "{{ lipsum(n=300000) }}",
    "lipsum-words": "{{ lipsum(n=1, min=10**9, max=10**9) }}",
    "slice": "{{ [1]|slice(10**7)|list|length }}",
    "indent": "{{ 'a\nb'|indent(999999999, true) }}",
    "center": "{{ 'x'|center(999999999) }}",
    "filter-block": "{% filter center(999999999) %}x{% endfilter %}",
    "map-center": "{{ ['x']|map('center', 999999999)|list }}",
    "ljust": "{{ 'x'.ljust(999999999) }}",
    "zfill": "{{ 'x'.zfill(999999999) }}",
    "expandtabs": "{{ ('\t' * 1000).expandtabs(9999999) }}",
    "str-format": "{{ '{:>999999999}'.format(1) }}",
    "str-format-nested": "{{ '{:>{}}'.format(1, 999999999) }}",
    "printf": "{{ '%999999999d'|format(1) }}",
    "replace-filter": "{{ ('a' * 100000)|replace('', 'x' * 2000) }}",
    "replace-method": "{{ ('a' * 100000).replace('', 'x' * 2000) }}",
    "tojson-indent": "{{ [[[[1]]]]|tojson(indent=999999999) }}",
    "batch-fill": "{{ [1]|batch(10**8, 0)|list|length }}",
    "concat-doubling": "{% set ns = namespace(s='xx') %}{% for i in range(40) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "plus-doubling": "{% set ns = namespace(s='xx') %}{% for i in range(40) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    "join-doubling": "{% set ns = namespace(s=['ab']) %}{% for i in range(40) %}"
    "{% set ns.s = [ns.s|join, ns.s|join] %}{% endfor %}",
    "sum-quadratic": "{{ ([[1] * 1000] * 3000)|sum(start=[])|length }}",
    "wordwrap-long": "{{ ('a' * 3000000)|wordwrap(1) }}",
}
_RENDER_ALL = """
import json, sys
from poly.text.chat import ChatTemplate
from poly.text.jinja_sandbox import TemplateLimitError
out = {}
for name, src in json.loads(sys.stdin.read()).items():
    try:
        ChatTemplate(src).render([{"role": "user", "content": "hi"}])
        out[name] = "rendered"
    except TemplateLimitError as e:
        out[name] = "limit: " + str(e)
print(json.dumps(out))
"""


def test_item2_dead_branch_bomb_is_not_folded_at_compile():
    from poly.text.chat import ChatTemplate

    for src in (DEAD_BOMB, DEAD_THREE):
        assert ChatTemplate(src).render([{"role": "user", "content": "hi"}]) == ""
    code, out, err, rss = run_py(
        ["-c", f"from poly.text.chat import ChatTemplate; ChatTemplate({DEAD_THREE!r})"]
    )
    assert code == 0, err
    assert rss < 300, rss  # was 3.5 GB


def test_item2_inspect_and_convert_of_a_gguf_with_a_dead_branch_bomb(tmp_path):
    from tests.fuzz.corpus import STRING, byte_vocab, gguf_model

    p = tmp_path / "bomb.gguf"
    tmpl = (STRING, DEAD_THREE + "{{ messages[0]['content'] }}")
    p.write_bytes(gguf_model({"tokenizer.chat_template": tmpl}, tokens=byte_vocab(), hidden=32))
    code, out, err, rss = lucy("inspect", p)
    assert code == 0, err
    assert rss < 600, rss  # was 3.9 GB / 31 s
    code, out, err, rss = lucy("convert", p, "-o", tmp_path / "bomb.entity")
    assert code == 0, err
    assert rss < 600, rss  # was 4.0 GB / 38.8 s


def test_item2_render_bombs_are_bounded():
    import json

    code, out, err, rss = run_py(["-c", _RENDER_ALL], stdin=json.dumps(RENDER_BOMBS))
    assert code == 0, err
    results = json.loads(out)
    assert {k: v.startswith("limit: ") for k, v in results.items()} == dict.fromkeys(
        RENDER_BOMBS, True
    ), results
    assert rss < 800, rss  # each was 0.8-3 GB or 16-40 s; the budget is 32 M chars per render


def test_item2_real_templates_still_render_equal_to_jinja():
    """The hardening changes no output: the family templates are compared to transformers in
    tests/test_chat_template.py; here filters, tests and `~` are compared to plain Jinja."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from poly.text.chat import ChatTemplate

    src = (
        "{% for m in messages %}{{ '<|im_start|>' ~ m['role'] ~ '\\n' ~ m['content']|trim ~ "
        "'<|im_end|>\\n' }}{% if m['content'] is string and loop.last %}{{ m['content']|length }}"
        "{% endif %}{% endfor %}{{ ('a' ~ 'b')|upper|center(6) }}{{ [1, 2]|sum }}"
        "{{ 'x{}'.format(3) }}{{ [[1], [2]]|sum(start=[]) }}{{ 'a\\nb'|indent(2, true) }}"
    )
    messages = [{"role": "user", "content": " hi "}]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    assert ChatTemplate(src).render(messages) == env.from_string(src).render(messages=messages)


# --- item 3: a tokenizer regex panic never escapes ------------------------------------------------

PANIC_REGEXES = [r"(\w+\s?)+$", r"(?:a|a)+$", r"((a)+)+$"]
PANIC_TEXT = "aaaaaaaaaaaaaaaaaaaaaaaaaaa!"


def _split_json(regex: str) -> str:
    import json

    from tests.hf_fixtures import build_tokenizer

    data = json.loads(build_tokenizer().to_str())
    data["pre_tokenizer"] = {
        "type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False
    }  # fmt: skip
    return json.dumps(data)


@pytest.mark.parametrize("regex", PANIC_REGEXES)
def test_item3_nested_quantifier_check_refuses_the_panicking_shapes(regex):
    from poly.errors import TokenizerError
    from poly.text.tokenizer import Tokenizer

    exc = expect_error(
        lambda: Tokenizer.from_str(_split_json(regex)), TokenizerError, "bad_tokenizer"
    )
    assert "nested quantifier" in str(exc) and "\n" not in str(exc)


def test_item3_real_pre_tokenizer_regexes_pass_the_check():
    from entity.gguf import tokenizer as gguf_tokenizer
    from poly.text.regex_guard import nested_quantifier

    regexes = [v for v in vars(gguf_tokenizer).values() if isinstance(v, str) and "\\p{" in v]
    regexes += [
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
        r"(?:\r\n|\n)+",
    ]  # fmt: skip
    assert [r for r in regexes if nested_quantifier(r)] == []


@pytest.mark.parametrize("regex", PANIC_REGEXES)
def test_item3_panic_inside_encode_is_a_tokenizer_error(regex):
    """Past the load check (built through the tokenizers API), the Onig panic is still typed."""
    import tokenizers

    from poly.errors import TokenizerError
    from poly.text.tokenizer import Tokenizer

    tok = Tokenizer.from_tokenizers(tokenizers.Tokenizer.from_str(_split_json(regex)))
    exc = expect_error(lambda: tok.encode(PANIC_TEXT), TokenizerError, "bad_tokenizer")
    assert "panic" in str(exc) and "\n" not in str(exc)
    assert tok.encode("ab") == tok.encode("ab")  # the tokenizer stays usable


def test_item3_cli_generate_with_a_panicking_regex_exits_4(tmp_path):

    d = make_tiny_checkpoint(tmp_path / "m", "llama")
    (d / "tokenizer.json").write_text(_split_json(PANIC_REGEXES[0]))
    code, out, err, rss = lucy("generate", d, "--prompt", PANIC_TEXT, "--max-tokens", "2")
    assert code == 4, err
    assert "nested quantifier" in one_error_line(err)

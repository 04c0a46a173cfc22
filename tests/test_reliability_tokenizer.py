"""Reliability catalogue B4 (tokenizer.json, tokenizer_config.json, chat templates)."""

from __future__ import annotations

import json
import shutil
import threading

import pytest

from poly.errors import (
    IntegrityError,
    LimitExceededError,
    TemplateError,
    TemplateSecurityError,
    TokenizerError,
)
from poly.text.chat import ChatTemplate
from poly.text.tokenizer import Tokenizer
from tests.fuzz.corpus import expect_error
from tests.hf_fixtures import build_tokenizer, make_tiny_checkpoint

GOOD = json.loads(build_tokenizer().to_str())
MSGS = [{"role": "user", "content": "hi"}]


def _edit(fn) -> str:
    data = json.loads(json.dumps(GOOD))
    fn(data)
    return json.dumps(data)


def _set(path: list, value):
    def fn(data):
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return fn


def test_good_tokenizer_matches_reference():
    ref = build_tokenizer()
    ours = Tokenizer.from_str(json.dumps(GOOD))
    text = "The quick brown fox, ça va? 0123"
    assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids


TOKENIZER_CASES = [
    ("B4-49-json", "{not json"),
    ("B4-49-deep", "[" * 100_000 + "]" * 100_000),
    ("B4-49-array", "[]"),
    ("B4-49-model-type", _edit(_set(["model", "type"], "Quantum"))),
    ("B4-49-merge-oov", _edit(lambda d: d["model"]["merges"].insert(0, ["\u2603\u2603", "\u2604"]))),
    ("B4-49-vocab-type", _edit(_set(["model", "vocab"], [1, 2, 3]))),
    ("B4-49-unk-oov", _edit(_set(["model", "unk_token"], "<missing>"))),
    ("B4-51-nested-quantifier", _edit(_set(["pre_tokenizer"], {
        "type": "Split", "pattern": {"Regex": "(a+)+$"}, "behavior": "Isolated", "invert": False}))),
    ("B4-51-nested-normalizer", _edit(_set(["normalizer"], {
        "type": "Replace", "pattern": {"Regex": "(x*)*y"}, "content": ""}))),
]  # fmt: skip


@pytest.mark.parametrize(
    "text", [c[1] for c in TOKENIZER_CASES], ids=[c[0] for c in TOKENIZER_CASES]
)
def test_bad_tokenizer(text):
    expect_error(lambda: Tokenizer.from_str(text), TokenizerError, "bad_tokenizer")


def test_b4_49_bad_bytes_file(tmp_path):
    p = tmp_path / "tokenizer.json"
    p.write_bytes(b"\xff\xfe{}")
    expect_error(lambda: Tokenizer.from_file(p), TokenizerError, "bad_tokenizer")
    expect_error(lambda: Tokenizer.from_file(tmp_path / "missing.json"), TokenizerError)


def test_b4_52_vocab_cap(monkeypatch):
    # the bound is tested with a lowered cap; a real 10^8-entry file is never built
    import poly.text.tokenizer as mod

    monkeypatch.setattr(mod, "MAX_VOCAB", 100)
    expect_error(lambda: Tokenizer.from_str(json.dumps(GOOD)), LimitExceededError, "limit_exceeded")


def test_b4_52_file_size_cap(tmp_path, monkeypatch):
    import poly.text.tokenizer as mod

    monkeypatch.setattr(mod, "MAX_TOKENIZER_BYTES", 1000)
    p = tmp_path / "tokenizer.json"
    p.write_text(json.dumps(GOOD))
    expect_error(lambda: Tokenizer.from_file(p), LimitExceededError, "limit_exceeded")


def test_b4_surrogate_and_control_text_is_encodable():
    tok = Tokenizer.from_str(json.dumps(GOOD))
    text = "abc\udcff\ud800\x1b]0;x\x07"  # surrogateescape'd terminal bytes, escape codes
    try:
        ids = tok.encode(text)
    except TokenizerError:
        return
    assert all(isinstance(i, int) for i in ids)
    tok.decode(ids).encode("utf-8")


def test_tokenizer_shared_by_threads():
    tok = Tokenizer.from_str(json.dumps(GOOD))
    text = "The quick brown fox jumps over the lazy dog. " * 50
    want = tok.encode(text)
    errors, barrier = [], threading.Barrier(4)

    def work():
        barrier.wait()
        for _ in range(20):
            try:
                assert tok.encode(text) == want
            except Exception as exc:  # noqa: BLE001 - collected and reported
                errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:1]


# --- B4-50: added tokens outside the config vocabulary --------------------------------------


def test_b4_50_added_token_id_out_of_range(tmp_path):
    from entity.hf import load_hf

    src = make_tiny_checkpoint(tmp_path / "src", "llama")
    d = tmp_path / "m"
    shutil.copytree(src, d)
    data = json.loads((d / "tokenizer.json").read_text())
    data["added_tokens"].append({"id": 5000, "content": "<extra>", "single_word": False,
                                 "lstrip": False, "rstrip": False, "normalized": False,
                                 "special": True})  # fmt: skip
    (d / "tokenizer.json").write_text(json.dumps(data))
    expect_error(lambda: load_hf(d), IntegrityError, "integrity", seconds=10)


# --- templates (B4-53 .. 55) -----------------------------------------------------------------

SSTI = [
    "{{ lipsum.__globals__['os'].popen('touch MARKER').read() }}",
    "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{% for x in ().__class__.__base__.__subclasses__() %}{{ x }}{% endfor %}",
    "{{ request.application.__globals__.__builtins__.__import__('os').system('touch MARKER') }}",
    "{{ namespace.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ messages.__class__.__init__.__globals__ }}",
]


@pytest.mark.parametrize("payload", SSTI, ids=[f"ssti{i}" for i in range(len(SSTI))])
def test_b4_53_ssti_never_runs(tmp_path, payload):
    marker = tmp_path / "pwned"
    source = payload.replace("MARKER", str(marker))

    def run():
        ChatTemplate(source).render(MSGS)

    exc = expect_error(run, TemplateError)
    assert exc.code in ("unsafe_template", "bad_template")
    assert not marker.exists()


def test_b4_53_classic_lipsum_is_a_security_error():
    expect_error(
        lambda: ChatTemplate(SSTI[0]).render(MSGS), TemplateSecurityError, "unsafe_template"
    )


LIMITS = [
    ("B4-54-infinite", "{% for i in range(10**9) %}{% for j in range(10**9) %}x{% endfor %}{% endfor %}"),
    ("B4-54-big-output", "{{ 'x' * 10**9 }}"),
    ("B4-54-pow", "{{ 2 ** 99999999 }}"),
    ("B4-54-format", "{{ '%99999999d' % 1 }}"),
    ("B4-54-recursion", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"),
    ("B4-54-nested-loops", "{% for a in 'x' * 5000 %}{% for b in 'x' * 5000 %}{% endfor %}{% endfor %}"),
]  # fmt: skip


@pytest.mark.parametrize("source", [c[1] for c in LIMITS], ids=[c[0] for c in LIMITS])
def test_b4_54_render_is_bounded(source):
    exc = expect_error(lambda: ChatTemplate(source).render(MSGS), TemplateError, seconds=12)
    assert exc.code in ("template_limit", "bad_template", "unsafe_template")


def test_b4_54_template_size_cap():
    expect_error(lambda: ChatTemplate("x" * (2 << 20)), TemplateError)


@pytest.mark.parametrize(
    "source",
    ["{% for %}", "{{ messages[0]['content'] ", "{% endfor %}", "{{ raise_exception('no system') }}",
     "{{ undefined_thing.attr.more }}"],
    ids=["syntax", "unclosed", "stray-end", "raise_exception", "undefined"],
)  # fmt: skip
def test_b4_55_syntax_and_undefined(source):
    exc = expect_error(lambda: ChatTemplate(source).render(MSGS), TemplateError)
    assert exc.code == "bad_template"


@pytest.mark.parametrize("messages", [None, "hi", [{"role": 1}], [{"content": "x"}], [[1, 2]]])
def test_bad_messages(messages):
    expect_error(lambda: ChatTemplate.preset("chatml").render(messages), TemplateError)

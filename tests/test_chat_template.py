"""poly.text.chat: rendering equals transformers' apply_chat_template; hostile templates run nothing."""
# ruff: noqa: F811  (fixtures imported from tests.conftest_tokenizers are re-bound as arguments)

from __future__ import annotations

import copy
import time

import pytest

from poly.errors import TemplateError, TemplateSecurityError
from poly.text.chat import PRESETS, ChatTemplate, TemplateLimitError, messages_from_prompt
from poly.text.tokenizer import Tokenizer
from tests.conftest_tokenizers import (  # noqa: F401  (fixtures)
    hf_smol_tokenizer,
    smol_hf_pair,
    smol_tokenizer_config,
    smol_tokenizer_dir,
)

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "What is 2+2?"}],
    "with_system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke.\nA short one."},
    ],
    "non_ascii": [
        {"role": "user", "content": "Café ñandú über 日本語 中文 👋🏽🤖"},
        {"role": "assistant", "content": "¡Hola! こんにちは 🎉"},
        {"role": "user", "content": "  spaces\tand\ttabs  "},
    ],
}

# Templates in the style of real model families. We wrote these sources; the expected text always
# comes from transformers rendering the same source.
QWEN_STYLE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}You are Qwen.{%- endif %}
{{- "\\n\\n# Tools\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud.<|im_end|>\\n' }}
{%- endif %}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA3_STYLE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
{%- set system_message = messages[0]['content']|trim %}
{%- set messages = messages[1:] %}
{%- else %}
{%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Qwen3-like: namespace, loop controls, reasoning fields, an extra kwarg (enable_thinking).
QWEN3_STYLE = """{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'system' %}{%- continue %}{%- endif %}
{{- '<|im_start|>' + message.role + '\\n' }}
{%- if message.role == 'assistant' and message.reasoning_content is defined and loop.index0 > ns.last_user %}
{{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}
{%- endif %}
{{- message.content.lstrip() + '<|im_end|>\\n' }}
{%- if loop.index0 > 6 %}{%- break %}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""

STYLES = {"qwen": QWEN_STYLE, "llama3": LLAMA3_STYLE, "qwen3": QWEN3_STYLE}


@pytest.fixture(scope="module")
def smol_template(smol_tokenizer_config) -> ChatTemplate:
    return ChatTemplate.from_tokenizer_config(smol_tokenizer_config)


@pytest.fixture(scope="module")
def smol_tokenizer(smol_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(smol_tokenizer_dir)


@pytest.fixture
def hf_tok(hf_smol_tokenizer):
    """A private copy, so setting chat_template does not leak into other tests."""
    return copy.deepcopy(hf_smol_tokenizer)


def _hf_ids(out) -> list[int]:
    # transformers 5 returns a BatchEncoding (dict) from apply_chat_template(tokenize=True).
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# --- parity with transformers -----------------------------------------------------------------


@pytest.mark.parametrize("conv", list(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False])
def test_smol_template_text_and_ids_match(
    smol_template, smol_tokenizer, hf_smol_tokenizer, conv, gen
):
    msgs = CONVERSATIONS[conv]
    expected = hf_smol_tokenizer.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=gen
    )
    text = smol_template.render(msgs, add_generation_prompt=gen)
    assert text == expected
    hf_ids = hf_smol_tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen)
    assert smol_tokenizer.encode(text) == _hf_ids(hf_ids)


def test_smol_template_read_from_config(smol_template, smol_tokenizer_config, hf_smol_tokenizer):
    assert smol_template.source == hf_smol_tokenizer.chat_template
    assert smol_template.bos_token == hf_smol_tokenizer.bos_token
    assert smol_template.eos_token == hf_smol_tokenizer.eos_token


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("conv", list(CONVERSATIONS))
def test_family_templates_match_transformers(hf_tok, style, conv):
    msgs = CONVERSATIONS[conv]
    hf_tok.chat_template = STYLES[style]
    ours = ChatTemplate(STYLES[style], bos_token=hf_tok.bos_token, eos_token=hf_tok.eos_token)
    for gen in (True, False):
        expected = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        assert ours.render(msgs, add_generation_prompt=gen) == expected


def test_tools_reasoning_and_extra_kwargs_match_transformers(hf_tok):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "météo",
                "description": "Weather <b>now</b> & later",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    msgs = CONVERSATIONS["multi_turn"] + [
        {"role": "assistant", "content": "\n Sure.", "reasoning_content": "\nThey want a joke.\n"}
    ]
    cases = [(QWEN_STYLE, {"tools": tools}), (QWEN3_STYLE, {"enable_thinking": False})]
    for src, extra in cases:
        hf_tok.chat_template = src
        expected = hf_tok.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=True, **extra
        )
        assert ChatTemplate(src).render(msgs, **extra) == expected


@pytest.mark.parametrize("name", PRESETS)
def test_presets_render_like_transformers(hf_tok, name):
    preset = ChatTemplate.preset(name)
    hf_tok.chat_template = preset.source
    for msgs in CONVERSATIONS.values():
        expected = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert preset.render(msgs) == expected


def test_raise_exception_becomes_template_error(hf_tok):
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    hf_tok.chat_template = LLAMA3_STYLE
    with pytest.raises(Exception, match="must alternate"):
        hf_tok.apply_chat_template(bad, tokenize=False)
    with pytest.raises(TemplateError, match="must alternate"):
        ChatTemplate(LLAMA3_STYLE).render(bad)


# --- Loom's presets (inventory §5.6) ----------------------------------------------------------

# role -> (prefix, suffix), copied from loom_inventory.md §5.6; None = the preset has no system role.
LOOM_TABLE = {
    "chatml": (
        ("<|im_start|>system\n", "<|im_end|>\n"),
        ("<|im_start|>user\n", "<|im_end|>\n"),
        ("<|im_start|>assistant\n", "<|im_end|>\n"),
    ),
    "plain": (None, ("", ""), ("", "")),
    "bitnet-inst": (None, ("<s>[INST] ", " [/INST]"), (" ", " </s>")),
    "microsoft-bitnet": (
        ("System: ", "<|eot_id|>"),
        ("User: ", "<|eot_id|>"),
        ("Assistant: ", "<|eot_id|>"),
    ),
    "llama3": (
        ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n", "<|eot_id|>"),
        ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>"),
        ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    ),
}


def loom_build_prompt(name, turns, system, user) -> str:
    """Loom's BuildPrompt, as the inventory describes it."""
    sys_role, user_role, asst_role = LOOM_TABLE[name]
    out = ""
    if system.strip() and sys_role is not None:
        out += sys_role[0] + system.strip() + sys_role[1]
    for u, a in turns:
        out += user_role[0] + u + user_role[1] + asst_role[0] + a + asst_role[1]
    return out + user_role[0] + user + user_role[1] + asst_role[0]


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("system", ["", "  Be brief. "])
def test_presets_equal_loom_build_prompt(name, system):
    turns = [("Hi", "Hello!"), ("日本語?", "はい 👋")]
    msgs = [{"role": "system", "content": system}] if system else []
    for u, a in turns:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    msgs.append({"role": "user", "content": "Bye"})
    assert ChatTemplate.preset(name).render(msgs) == loom_build_prompt(name, turns, system, "Bye")


def test_from_tokenizer_config_variants():
    src = "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
    cfg = {
        "chat_template": [
            {"name": "tool_use", "template": "x"},
            {"name": "default", "template": src},
        ],
        "bos_token": {"content": "<s>", "lstrip": False},
        "eos_token": "</s>",
    }
    tpl = ChatTemplate.from_tokenizer_config(cfg)
    assert tpl.render(messages_from_prompt("hi", system="sys")) == "<s>sys</s>hi</s>"
    fallback = ChatTemplate.from_tokenizer_config({"eos_token": "</s>"}, fallback="llama3")
    assert fallback.source == ChatTemplate.preset("llama3").source
    assert fallback.eos_token == "</s>"
    with pytest.raises(TemplateError):
        ChatTemplate.from_tokenizer_config({}, fallback=None)
    with pytest.raises(TemplateError):
        ChatTemplate.from_tokenizer_config({}, fallback="nope")
    with pytest.raises(TemplateError):
        ChatTemplate.from_tokenizer_config({"chat_template": 3})
    with pytest.raises(TemplateError):
        ChatTemplate.preset("vicuna")


def test_messages_from_prompt():
    assert messages_from_prompt("q") == [{"role": "user", "content": "q"}]
    assert messages_from_prompt("q", "s")[0] == {"role": "system", "content": "s"}


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [],
        None,
        ["hello"],
        [{"content": "no role"}],
        [{"role": "user"}],
        [{"role": "user", "content": 3}],
        [{"role": 1, "content": "x"}],
    ],
)
def test_bad_messages_raise_template_error(messages):
    with pytest.raises(TemplateError):
        ChatTemplate.preset("chatml").render(messages)


# --- hostile templates --------------------------------------------------------------------------

STATIC_ATTACKS = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ raise_exception.__globals__ }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ joiner.__init__.__globals__['__builtins__'] }}",
    "{{ self.__init__.__globals__ }}",
    "{{ namespace.__init__ }}",
    "{% include '/etc/passwd' %}",
    "{% import 'os' as os %}",
    "{% extends '/etc/passwd' %}",
    "{% from 'x' import y %}",
]

RUNTIME_ATTACKS = [
    "{% set n = '__cla' ~ 'ss__' %}{{ ''[n] }}",
    "{{ ''|attr('__class__') }}",
    "{{ '{0.__class__}'.format('') }}",
    "{{ messages.append(1) }}",
    "{% set ns = namespace(__class__=1) %}",
    "{{ (messages|first).update({'a': 1}) }}",
]

LIMIT_ATTACKS = [
    "{% for i in range(10**12) %}x{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set s = 'x' * 1000000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "{{ 9 ** 999999999 }}",
    "{{ 'x' * 100000000 }}",
    "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "{{ '%099999999d' % 1 }}",
]


@pytest.mark.parametrize("src", STATIC_ATTACKS)
def test_static_attacks_refused_before_rendering(src):
    # Refused at construction: no template code ever runs.
    with pytest.raises(TemplateSecurityError):
        ChatTemplate(src)


@pytest.mark.parametrize("src", RUNTIME_ATTACKS)
def test_runtime_attacks_raise_security_error(src):
    with pytest.raises(TemplateSecurityError):
        ChatTemplate(src).render(messages_from_prompt("hi"))


@pytest.mark.parametrize("src", LIMIT_ATTACKS)
def test_resource_attacks_are_bounded(src):
    start = time.process_time()
    with pytest.raises(TemplateLimitError):
        ChatTemplate(src).render(messages_from_prompt("hi"))
    assert time.process_time() - start < 30  # a guard against hanging the suite, not a speed test


@pytest.mark.parametrize(
    "src",
    ["{% for %}", "{{ unclosed", "{% endfor %}", "{% if x %}", "{{ 1 + }}", "{% generation %}"],
)
def test_syntax_errors_raise_template_error(src):
    with pytest.raises(TemplateError) as info:
        ChatTemplate(src)
    assert not isinstance(info.value, TemplateSecurityError)


def test_non_string_template_and_cache():
    with pytest.raises(TemplateError):
        ChatTemplate(None)
    a, b = ChatTemplate("{{ messages[0].content }}"), ChatTemplate("{{ messages[0].content }}")
    assert a._template is b._template  # compiled once
    assert a.render(messages_from_prompt("x")) == "x"

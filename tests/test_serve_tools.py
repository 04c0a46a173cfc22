"""Tool calls through `lucy serve` on the real SmolLM2-135M-Instruct, with the official client.

The parameters schemas are written the way users write them (no ``additionalProperties``); the
arguments are checked with jsonschema against the same schema closed by hand. SmolLM2's chat
template cannot show tools, so the server lists them in a system message and takes llama.cpp's
generic JSON turn (lucy.server.toolcalls).
"""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytest.importorskip("fastapi")

from tests.serve_helpers import KEY, running_server  # noqa: E402

pytestmark = pytest.mark.real_model

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "the city"},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
}
STRICT = {**PARAMS, "additionalProperties": False}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": PARAMS,
    },
}
# nested objects, still without additionalProperties anywhere
TRIP = {"type": "function", "function": {"name": "book_trip", "parameters": {"type": "object",
        "properties": {"to": {"type": "object", "properties": {"city": {"type": "string"},
        "country": {"type": "string"}}, "required": ["city"]}, "nights": {"type": "integer"}},
        "required": ["to", "nights"]}}}  # fmt: skip
TRIP_STRICT = {"type": "object", "additionalProperties": False, "required": ["to", "nights"],
               "properties": {"to": {"type": "object", "additionalProperties": False,
               "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
               "required": ["city"]}, "nights": {"type": "integer"}}}  # fmt: skip
ASKS = [  # weather requests SmolLM2-135M answers with a call at temperature 0 (5 of 12 measured)
    "Use the get_weather tool to check the weather in Paris.",
    "Call get_weather for London in celsius.",
    "Get the weather for New York.",
]


@pytest.fixture(scope="module")
def served(smollm2_gguf):
    with running_server(smollm2_gguf) as (base, _):
        c = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
        yield c, smollm2_gguf.stem


def _chat(served, prompt: str, **kw):
    client, model = served
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 60)
    msgs = [{"role": "user", "content": prompt}]
    return client.chat.completions.create(model=model, messages=msgs, **kw)


def _one_call(choice, name: str = "get_weather") -> dict:
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == name
    return json.loads(call.function.arguments)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_arguments_hold_only_declared_keys(served, tool_choice):
    # before: {"city": "Paris", "unit": "c", "type": "string", "description": ...} to max_tokens
    for prompt in ["What is the weather in Paris?", "Tell me the current weather in Tokyo."]:
        r = _chat(served, prompt, tools=[WEATHER], tool_choice=tool_choice)
        jsonschema.validate(_one_call(r.choices[0]), STRICT)
    r = _chat(served, "Is it cold in Oslo?", tools=[WEATHER], tool_choice=tool_choice,
              temperature=1.0, seed=7, n=3)  # fmt: skip
    for ch in r.choices:
        jsonschema.validate(_one_call(ch), STRICT)


def test_nested_objects_are_closed_too(served):
    r = _chat(served, "Book me three nights in Rome.", tools=[WEATHER, TRIP],
              tool_choice={"type": "function", "function": {"name": "book_trip"}},
              temperature=1.0, seed=3, n=3)  # fmt: skip
    for ch in r.choices:
        jsonschema.validate(_one_call(ch, "book_trip"), TRIP_STRICT)


def test_auto_calls_when_asked(served):
    called = []
    for prompt in ASKS:
        ch = _chat(served, prompt, tools=[WEATHER]).choices[0]  # tool_choice defaults to auto
        if ch.finish_reason == "tool_calls":
            args = _one_call(ch)
            jsonschema.validate(args, STRICT)
            assert ch.message.content is None
            called.append(args["city"])
        else:
            assert ch.message.tool_calls is None and ch.message.content
    assert len(called) >= 2, called  # before: 0 (auto was unconstrained text)
    assert any("Paris" in c or "London" in c or "New York" in c for c in called)


def test_auto_still_answers_in_text(served):
    for prompt in ["Say hello", "What is 2 + 2?"]:
        ch = _chat(served, prompt, tools=[WEATHER], tool_choice="auto").choices[0]
        assert ch.finish_reason == "stop" and ch.message.tool_calls is None
        text = ch.message.content
        assert text and not text.lstrip().startswith("{"), text  # the reply, not its JSON wrapper
    assert "4" in text


def test_auto_call_streams(served):
    client, model = served
    s = client.chat.completions.create(model=model, temperature=0, max_tokens=60, stream=True,
                                       messages=[{"role": "user", "content": ASKS[0]}],
                                       tools=[WEATHER])  # fmt: skip
    calls, finish = [], None
    for c in s:
        if c.choices and c.choices[0].delta.tool_calls:
            calls += c.choices[0].delta.tool_calls
        if c.choices and c.choices[0].finish_reason:
            finish = c.choices[0].finish_reason
    assert finish == "tool_calls" and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), STRICT)


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_call_cut_by_max_tokens_is_length(served, tool_choice):
    whole = _chat(served, ASKS[0], tools=[WEATHER], tool_choice=tool_choice)
    _one_call(whole.choices[0])
    n = whole.usage.completion_tokens
    for budget in (3, n // 2, n - 1):
        ch = _chat(served, ASKS[0], tools=[WEATHER], tool_choice=tool_choice,
                   max_tokens=budget).choices[0]  # fmt: skip
        assert ch.finish_reason == "length" and not ch.message.tool_calls, (budget, ch)
    client, model = served
    s = client.chat.completions.create(model=model, temperature=0, max_tokens=n - 1, stream=True,
                                       messages=[{"role": "user", "content": ASKS[0]}],
                                       tools=[WEATHER], tool_choice=tool_choice)  # fmt: skip
    chunks = [c.choices[0] for c in s if c.choices]
    assert chunks[-1].finish_reason == "length"
    assert not any(c.delta.tool_calls for c in chunks)


def test_reply_cut_by_max_tokens_is_its_text(served):
    whole = _chat(served, "Say hello", tools=[WEATHER]).choices[0].message.content
    cut = _chat(served, "Say hello", tools=[WEATHER], max_tokens=6).choices[0]
    assert cut.finish_reason == "length"
    assert cut.message.content and whole.startswith(cut.message.content), (cut, whole)


# A template that shows tools (Hermes/Qwen style): calls are <tool_call>...</tool_call>.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: <tools>{% for t in tools %}{{ t | tojson }}"
    '{% endfor %}</tools>\nCall one as <tool_call>{"name": ..., "arguments": ...}</tool_call>'
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)


# a random tiny model needs a bound on the string to ever finish the call
SHORT = {
    **PARAMS,
    "properties": {**PARAMS["properties"], "city": {"type": "string", "maxLength": 8}},
}
SHORT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": SHORT}}


@pytest.fixture(scope="module")
def tagged(tmp_path_factory):
    from tests.hf_fixtures import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("tt") / "tiny-tools", "qwen2", seed=4,
                                config_overrides={"max_position_embeddings": 2048})  # fmt: skip
    (ckpt / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TOOLS_TEMPLATE
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    with running_server(ckpt) as (base, _):
        c = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
        yield c, "tiny-tools"


def test_tagged_calls_hold_the_schema_and_a_cut_one_is_length(tagged):
    ask = {"tools": [SHORT_TOOL], "tool_choice": "required", "max_tokens": 200}
    r = _chat(tagged, "Weather in Paris?", temperature=1.0, seed=5, n=3, **ask)
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls", ch
        for call in ch.message.tool_calls:  # a random model may write a list of calls
            assert call.function.name == "get_weather"
            jsonschema.validate(
                json.loads(call.function.arguments), {**SHORT, "additionalProperties": False}
            )
    whole = _chat(tagged, "Weather in Paris?", **ask)
    assert whole.choices[0].finish_reason == "tool_calls"
    n = whole.usage.completion_tokens
    cut = _chat(tagged, "Weather in Paris?", **{**ask, "max_tokens": n - 1}).choices[0]
    assert cut.finish_reason == "length" and not cut.message.tool_calls
    assert cut.message.content.startswith(("<tool_call>", "{"))


def test_tagged_auto_grammar_takes_text_or_a_valid_call(smollm2_gguf):
    """The auto grammar, token by token with SmolLM2's tokenizer: any text, or text leading into
    <tool_call>; a call whose arguments jsonschema rejects is refused at the offending token."""
    import entity
    from lucy.server import toolcalls
    from poly.serving.grammar import Grammars

    model = entity.load(str(smollm2_gguf))
    body = toolcalls.tagged_body(toolcalls.call_schema({"get_weather": PARAMS}), True)
    make = Grammars(model).tool_calls(body, True)
    ok, junk = {"city": "Paris", "unit": "c"}, {"city": "Paris", "unit": "c", "type": "string"}
    cases = {
        "It is sunny in Paris today.": True,
        "Let me check.\n<tool_call>[\n" + json.dumps({"name": "get_weather", "arguments": ok})
        + "\n]</tool_call>": True,
        '<tool_call>{"name": "get_weather", "arguments": ' + json.dumps(junk) + "}</tool_call>":
            False,
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>': False,
        json.dumps({"name": "get_weather", "arguments": ok}): True,
    }  # fmt: skip
    for text, valid in cases.items():
        if "<tool_call>" in text:  # the reference: the call's arguments against the closed schema
            body_text = text.split("<tool_call>")[1].split("</tool_call>")[0]
            obj = json.loads(body_text)
            obj = obj[0] if isinstance(obj, list) else obj
            assert (obj["name"] == "get_weather" and jsonschema.Draft202012Validator(
                STRICT).is_valid(obj["arguments"])) == valid  # fmt: skip
        mask = make()
        accepted = True
        for t in model.tokenizer.encode(text, add_special_tokens=False):
            if not mask.allowed()[t]:
                accepted = False
                break
            mask.consume(t)
        assert accepted == valid, text

"""Structured output through `lucy serve` (llguidance token masks), checked with jsonschema."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytest.importorskip("fastapi")

from tests.hf_fixtures import make_tiny_checkpoint  # noqa: E402
from tests.serve_helpers import KEY, running_server  # noqa: E402

MODEL = "tiny-qwen"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "fish"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
        "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}  # fmt: skip
MSGS = [{"role": "user", "content": "Hello world!"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    ckpt = make_tiny_checkpoint(
        tmp_path_factory.mktemp("st") / MODEL,
        "qwen2",
        seed=2,
        config_overrides={"max_position_embeddings": 2048},
    )
    with running_server(ckpt) as (base, _):
        yield openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_json_schema_output_validates_every_time(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=MSGS, response_format=fmt,
                                           max_tokens=120, temperature=1.0, seed=seed, n=3)  # fmt: skip
        for ch in r.choices:
            assert ch.finish_reason == "stop"
            jsonschema.validate(json.loads(ch.message.content), PERSON)


def test_json_schema_stream(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    s = client.chat.completions.create(model=MODEL, messages=MSGS, response_format=fmt,
                                       max_tokens=120, temperature=0.7, seed=5, stream=True)  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in s if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object(client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=200, temperature=0,
                                       response_format={"type": "json_object"})  # fmt: skip
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # ran out of tokens inside the object: still a prefix of one
        assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_tool_call(client, choice):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER, TIME],
                                       tool_choice=choice, max_tokens=120, temperature=1.0, seed=3)  # fmt: skip
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    spec = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])


def test_tool_call_stream(client):
    s = client.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER],
                                       tool_choice="required", max_tokens=120, stream=True)  # fmt: skip
    calls, finish = [], None
    for c in s:
        if c.choices and c.choices[0].delta.tool_calls:
            calls += c.choices[0].delta.tool_calls
        if c.choices and c.choices[0].finish_reason:
            finish = c.choices[0].finish_reason
    assert finish == "tool_calls" and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])


def test_bad_schema_and_tool_choice_are_400(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}})  # fmt: skip
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})  # fmt: skip
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5,
                                       response_format={"type": "yaml"})  # fmt: skip

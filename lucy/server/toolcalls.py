"""Tool calls: the call schema, the two call syntaxes, and a finished turn parsed back into calls.

A call is ``{"name": <tool>, "arguments": <its parameters schema, closed>}``. The syntax follows
what the chat template can do:

- ``"json"``, for a template that cannot show tools (SmolLM2's): the tools are listed in a system
  message and the turn is one JSON object, ``{"tool_call": CALL}``, ``{"tool_calls": [CALL, ...]}``
  or ``{"response": <reply>}`` (llama.cpp's generic format). The model makes its choice at the
  first key: SmolLM2-135M, which never opens a ``<tool_call>`` tag by itself, calls this way.
- ``"tagged"``, for a template that shows tools (Hermes, Qwen, SmolLM2's tool-tuned siblings):
  ``<tool_call>`` CALL or [CALL, ...] ``</tool_call>`` or a bare CALL, free text allowed before the
  tag (``poly.serving.grammar.tool_call_lark``).
"""

from __future__ import annotations

import json

from poly.serving.grammar import TOOL_CLOSE, TOOL_OPEN

_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUB_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUB_ONE = ("items", "additionalProperties", "additionalItems", "not", "contains", "if", "then",
            "else", "unevaluatedProperties")  # fmt: skip
_RESPONSE_HEAD = '{"response":"'


def shows_tools(template) -> bool:
    """Whether a chat template renders the request's tools itself (the server's test too)."""
    return template is not None and "tools" in template.source


def closed(schema, top: bool = True):
    """``schema`` with every object that lists ``properties`` but says nothing of other keys made
    closed (``additionalProperties: false``), as OpenAI's strict mode and llama.cpp's server read
    tool parameters; llguidance follows JSON Schema, where a missing one lets any key in."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUB_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {k: closed(v) for k, v in schema[key].items()}
    for key in _SUB_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [closed(v) for v in schema[key]]
    for key in _SUB_ONE:
        sub = schema.get(key)
        if isinstance(sub, (dict, list)):
            out[key] = [closed(v) for v in sub] if isinstance(sub, list) else closed(sub)
    if isinstance(schema.get("allOf"), list):  # parts merge: closing each would forbid the others'
        out["allOf"] = [closed(v, top=False) for v in schema["allOf"]]
    if (
        top
        and "properties" in schema
        and not {"additionalProperties", "patternProperties"} & set(schema)
    ):
        out["additionalProperties"] = False
    return out


def call_schema(specs: dict) -> dict:
    """One call to any of ``specs`` (name -> parameters schema)."""
    options = [
        {"type": "object", "properties": {"name": {"const": n}, "arguments": closed(p)},
         "required": ["name", "arguments"], "additionalProperties": False}
        for n, p in specs.items()
    ]  # fmt: skip
    return options[0] if len(options) == 1 else {"anyOf": options}


def _only(key: str, schema: dict) -> dict:
    return {"type": "object", "properties": {key: schema}, "required": [key],
            "additionalProperties": False}  # fmt: skip


def json_turn(call: dict, parallel: bool, answer: dict | None) -> dict:
    """The "json" syntax's schema; ``answer`` (the reply's schema) None: a call only."""
    options = [_only("tool_call", call)]
    if parallel:
        options.append(_only("tool_calls", {"type": "array", "items": call, "minItems": 1}))
    if answer is not None:
        options.append(_only("response", answer))
    return {"anyOf": options}


def tagged_body(call: dict, parallel: bool) -> dict:
    """What goes between the tags (or bare) in the "tagged" syntax: a call or a list of calls."""
    many = {"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1})}
    # a blank or two where JSON allows one (the model's own layout), never a run of them
    return {"x-guidance": {"whitespace_pattern": "[ \\n]{0,2}"}, "anyOf": [call, many]}


def parse(text: str, syntax: str, names) -> tuple[str | None, list[dict]]:
    """(content, calls) of a finished turn; a turn that is not a whole valid call is content."""
    if syntax == "json":
        try:
            obj = json.loads(text)
        except ValueError:
            return text, []
        if not isinstance(obj, dict):
            return text, []
        if "response" in obj:
            reply = obj["response"]
            return (reply if isinstance(reply, str) else json.dumps(reply, ensure_ascii=False)), []
        raw = [obj["tool_call"]] if "tool_call" in obj else obj.get("tool_calls")
        lead, calls = None, _calls(raw, names)
    else:
        lead, calls = _tagged(text, names)
    return (lead, calls) if calls else (text, [])


def _tagged(text: str, names) -> tuple[str | None, list[dict]]:
    lead, sep, body = text.partition(TOOL_OPEN)
    if sep:
        body, end, _ = body.partition(TOOL_CLOSE)
        if not end:
            return None, []
    elif text.lstrip().startswith("{"):
        lead, body = "", text
    else:
        return None, []
    try:
        obj = json.loads(body)
    except ValueError:
        return None, []
    return lead.strip() or None, _calls(obj if isinstance(obj, list) else [obj], names)


def _calls(raw, names) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        return []
    out = []
    for c in raw:
        if not isinstance(c, dict) or c.get("name") not in names:
            return []
        args = c.get("arguments", c.get("parameters", {}))
        out.append({"name": c["name"], "arguments": json.dumps(args, ensure_ascii=False)})
    return out


def cut_text(text: str, syntax: str) -> str:
    """A turn cut by ``max_tokens``: never a call; a cut "json" reply is unwrapped to its text."""
    if syntax != "json" or not text.startswith(_RESPONSE_HEAD):
        return text
    body = text[len(_RESPONSE_HEAD) :]
    for end in range(len(body), max(len(body) - 6, 0) - 1, -1):  # drop a half-written escape
        try:
            return json.loads('"' + body[:end] + '"')
        except ValueError:
            continue
    return text


def system_text(tools: list) -> str:
    """The tools and the "json" syntax, for a chat template that cannot show them."""
    listing = json.dumps([t["function"] for t in tools], ensure_ascii=False)
    return (
        f"You can call these tools:\n<tools>{listing}</tools>\n"
        "Respond in JSON format, either with `tool_call` (a request to call a tool, "
        '{"name": ..., "arguments": {...}}) or with `response` (your reply to the user).'
    )

"""response_format and tools/tool_choice -> a token mask, and tool calls back in OpenAI's shape.

- ``response_format`` ``json_object`` / ``json_schema``: the output is constrained to JSON (of the
  schema) by llguidance (poly.serving.grammar).
- ``tools`` with ``tool_choice`` ``"required"`` or ``{"type": "function", "function": {"name"}}``:
  the output is constrained to ``{"name": <tool>, "arguments": <its parameters schema>}`` and
  returned as ``message.tool_calls`` with finish_reason ``"tool_calls"``.
- ``tool_choice`` ``"auto"`` (the default with tools): unconstrained; a reply that parses as such
  an object (bare or inside ``<tool_call>`` tags) becomes a tool call. ``"none"``: plain text.
The tools reach the prompt through the chat template's ``tools`` variable; a template without
one gets them described in a system message.
"""

from __future__ import annotations

import json
import threading
import uuid
from dataclasses import dataclass

from lucy.server.errors import bad_request
from poly.errors import PolyError

_LOCK = threading.Lock()


@dataclass
class Plan:
    mask_factory: object = None
    tools: list | None = None
    names: tuple[str, ...] = ()
    tool_mode: str = "none"  # none | auto | forced
    buffered: bool = False  # tool calls: the text is parsed at the end, not streamed

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        if self.tool_mode != "none":
            call = parse_tool_call(text, self.names)
            if call is not None:
                calls = [
                    {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": call}
                ]
                return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
        return {"role": "assistant", "content": text}, finish


def parse_tool_call(text: str, names) -> dict | None:
    body = text.strip()
    if body.startswith("<tool_call>"):
        body = body.removeprefix("<tool_call>").split("</tool_call>")[0].strip()
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def grammars(state):
    """The model's llguidance tokenizer, built once per server."""
    from poly.serving.grammar import Grammars

    with _LOCK:
        if state.grammars is None:
            state.grammars = Grammars(state.model)
        return state.grammars


def _tools(body: dict) -> tuple[list, dict]:
    tools = body.get("tools") or []
    specs = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(
                f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string", "tools")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be an object", "tools")
        specs[name] = params
    return tools, specs


def _call_schema(specs: dict) -> dict:
    options = [
        {"type": "object", "properties": {"name": {"const": n}, "arguments": p},
         "required": ["name", "arguments"], "additionalProperties": False}
        for n, p in specs.items()
    ]  # fmt: skip
    return options[0] if len(options) == 1 else {"anyOf": options}


def _response_schema(body: dict) -> dict | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise bad_request(
                "response_format.json_schema.schema must be an object", "response_format"
            )
        return js.get("schema") or {"type": "object"}
    raise bad_request(
        "response_format.type must be text, json_object or json_schema", "response_format"
    )


def plan(state, body: dict) -> Plan:
    """Runs in a worker thread (compiling a grammar can take a while)."""
    tools, specs = _tools(body)
    choice = body.get("tool_choice", "auto" if tools else "none")
    schema = _response_schema(body)
    out = Plan(tools=tools or None, names=tuple(specs))
    if tools and choice != "none":
        if choice == "auto":
            out.tool_mode = "auto"
        elif choice == "required":
            out.tool_mode, schema = "forced", _call_schema(specs)
        elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
            name = choice["function"].get("name")
            if name not in specs:
                raise bad_request(f"tool_choice names an unknown function {name!r}", "tool_choice")
            out.tool_mode, schema = "forced", _call_schema({name: specs[name]})
        else:
            raise bad_request(
                "tool_choice must be none, auto, required or a function", "tool_choice"
            )
        out.buffered = True  # the text may turn out to be a call: parsed at the end
    elif choice not in ("none", "auto") and not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    if schema is not None:
        try:
            out.mask_factory = grammars(state).json_schema(schema)
        except PolyError as err:
            raise bad_request(
                str(err), "response_format" if out.tool_mode != "forced" else "tools"
            ) from None
    return out


def tools_system_text(tools: list) -> str:
    listing = json.dumps([t["function"] for t in tools], ensure_ascii=False)
    return (
        "You can call these functions. To call one, reply with only a JSON object "
        '{"name": <function name>, "arguments": <arguments object>}.\n' + listing
    )

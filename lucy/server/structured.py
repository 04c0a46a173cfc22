"""response_format and tools/tool_choice -> a token mask, and tool calls back in OpenAI's shape.

- ``response_format`` ``json_object`` / ``json_schema``: the output is constrained to JSON (of the
  schema) by llguidance (poly.serving.grammar).
- ``tools``: a call's arguments are held to the tool's parameters schema, an object without
  ``additionalProperties`` taken as closed. ``tool_choice`` ``"required"`` or a named function:
  the turn must be a call. ``"auto"`` (the default with tools): the turn may be a reply or a call,
  the model choosing. ``"none"``: plain text. The call syntax follows the chat template
  (lucy.server.toolcalls). A finished call comes back as ``message.tool_calls`` with
  finish_reason ``"tool_calls"``; a turn cut by ``max_tokens`` is never a call (``"length"``).
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass

from lucy.server import toolcalls
from lucy.server.errors import bad_request
from poly.errors import PolyError

_LOCK = threading.Lock()


@dataclass
class Plan:
    mask_factory: object = None
    tools: list | None = None  # for the chat template (and its system message)
    names: tuple[str, ...] = ()
    tool_mode: str = "none"  # none | auto | forced
    syntax: str = "json"  # how calls are written: json | tagged (lucy.server.toolcalls)
    buffered: bool = False  # tool calls: the text is parsed at the end, not streamed

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        if self.tool_mode == "none":
            return {"role": "assistant", "content": text}, finish
        if finish == "length":  # a cut call is no call
            return {"role": "assistant", "content": toolcalls.cut_text(text, self.syntax)}, finish
        content, calls = toolcalls.parse(text, self.syntax, self.names)
        if not calls:
            return {"role": "assistant", "content": content}, finish
        calls = [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": c}
            for c in calls
        ]
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


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
    native = toolcalls.shows_tools(getattr(state.model, "chat_template", None))
    out = Plan(tools=tools or None, names=tuple(specs), syntax="tagged" if native else "json")
    if choice not in ("none", "auto") and not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    if not tools or choice == "none":
        if not native:  # no system message asking for calls the grammar would not take
            out.tools = None
        if schema is not None:
            out.mask_factory = _compile(grammars(state).json_schema, schema, "response_format")
        return out
    if choice == "auto":
        out.tool_mode = "auto"
    elif choice == "required":
        out.tool_mode = "forced"
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in specs:
            raise bad_request(f"tool_choice names an unknown function {name!r}", "tool_choice")
        out.tool_mode, specs = "forced", {name: specs[name]}
    else:
        raise bad_request("tool_choice must be none, auto, required or a function", "tool_choice")
    out.mask_factory = _tool_mask(state, out, specs, body.get("parallel_tool_calls"), schema)
    out.buffered = True  # the text may turn out to be a call: parsed at the end
    return out


def _tool_mask(state, out: Plan, specs: dict, parallel, schema: dict | None):
    """The grammar of a turn that may (auto) or must (forced) be a call; ``schema``: the reply's
    (response_format), else free text."""
    call, parallel = toolcalls.call_schema(specs), parallel is not False
    forced = out.tool_mode == "forced"
    if out.syntax == "tagged":
        text = False if forced else (schema if schema is not None else True)
        body = toolcalls.tagged_body(call, parallel)
        return _compile(grammars(state).tool_calls, body, "tools", text)
    answer = None if forced else (schema if schema is not None else {"type": "string"})
    return _compile(
        grammars(state).json_schema, toolcalls.json_turn(call, parallel, answer), "tools"
    )


def _compile(build, schema, param: str, *args):
    try:
        return build(schema, *args)
    except PolyError as err:
        raise bad_request(str(err), param) from None


def tools_system_text(tools: list) -> str:
    """The system message that lists the tools for a chat template that cannot show them."""
    return toolcalls.system_text(tools)

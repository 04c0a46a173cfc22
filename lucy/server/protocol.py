"""OpenAI request fields -> poly serving parameters (every bad field is a 400 naming it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lucy.server.errors import bad_request
from poly.errors import SamplingParamsError
from poly.serving import SamplingParams
from poly.text.gendefaults import MODEL_FILE, resolve
from poly.text.prompt_budget import encode_within
from poly.text.sampling import repeat_last_n_fields

_NUM = (int, float)
# field -> (accepted types, SamplingParams name or None when handled elsewhere)
_FIELDS: dict[str, tuple[tuple, str | None]] = {
    "model": ((str,), None),
    "max_tokens": ((int,), "max_tokens"),
    "max_completion_tokens": ((int,), "max_tokens"),
    "temperature": (_NUM, "temperature"),
    "top_p": (_NUM, "top_p"),
    "top_k": ((int,), "top_k"),
    "min_p": (_NUM, "min_p"),
    "seed": ((int,), "seed"),
    "stop": ((str, list), "stop"),
    "n": ((int,), "n"),
    "presence_penalty": (_NUM, "presence_penalty"),
    "frequency_penalty": (_NUM, "frequency_penalty"),
    "repetition_penalty": (_NUM, "repetition_penalty"),
    # llama.cpp server's names for the repetition controls (repeat_last_n: converted below)
    "repeat_penalty": (_NUM, "repetition_penalty"),
    "repeat_last_n": ((int,), None),
    "dry_multiplier": (_NUM, "dry_multiplier"),
    "dry_base": (_NUM, "dry_base"),
    "dry_allowed_length": ((int,), "dry_allowed_length"),
    "dry_penalty_last_n": ((int,), "dry_penalty_last_n"),
    "dry_sequence_breakers": ((list,), "dry_sequence_breakers"),
    "stream": ((bool,), None),
    "stream_options": ((dict,), None),
    "user": ((str,), None),
    "ignore_eos": ((bool,), "ignore_eos"),
    "logit_bias": ((dict,), None),
    "id_slot": ((int,), None),  # llama.cpp's: the slot whose cache the request uses (-1: any)
}
_CHAT = {
    "messages": ((list,), None),
    "logprobs": ((bool,), None),
    "top_logprobs": ((int,), None),
    "response_format": ((dict,), None),
    "tools": ((list,), None),
    "tool_choice": ((str, dict), None),
    "parallel_tool_calls": ((bool,), None),
}
_COMPLETION = {
    "prompt": ((str, list), None),
    "logprobs": ((int,), None),
    "echo": ((bool,), None),
}


@dataclass
class Parsed:
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    body: dict = field(default_factory=dict)


# The knobs a request that leaves them out takes from the model (as `lucy generate` does).
_DEFAULTED = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "repetition_window",
              "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
              "dry_sequence_breakers", "penalize_prompt")  # fmt: skip


def model_defaults(model: Any) -> dict[str, Any]:
    """SamplingParams defaults of `model` by the one rule of `poly.text.gendefaults.resolve`
    (the model file's generation settings over poly's fallback, as `lucy generate` runs with).
    max_tokens only when the model file sets it: otherwise a request runs to the context end,
    as OpenAI's API does."""
    resolved = resolve(model)
    out = {name: getattr(resolved.options, name) for name in _DEFAULTED}
    if resolved.origins["max_tokens"] == MODEL_FILE:
        out["max_tokens"] = resolved.options.max_tokens
    return out


def _check_types(body: dict, table: dict) -> None:
    for name, value in body.items():
        spec = table.get(name)
        if spec is None:
            continue  # unknown fields are ignored, as OpenAI-compatible servers do
        types = spec[0]
        if value is None:
            continue
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if not ok:
            want = " or ".join(t.__name__ for t in types)
            raise bad_request(f"'{name}' must be {want}, got {type(value).__name__}", name)


def parse_common(
    body: Any, extra: dict, logprobs: int | None, defaults: dict | None = None
) -> Parsed:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    table = {**_FIELDS, **extra}
    _check_types(body, table)
    if body.get("logit_bias"):  # refused rather than silently ignored; {} changes nothing
        raise bad_request("'logit_bias' is not supported", "logit_bias")
    kw: dict[str, Any] = dict(defaults or {})
    for name, (_, target) in _FIELDS.items():
        if target is not None and body.get(name) is not None:
            kw[target] = body[name]
    if isinstance(kw.get("stop"), list) and not all(isinstance(s, str) for s in kw["stop"]):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if isinstance(kw.get("stop"), list):
        kw["stop"] = tuple(s for s in kw["stop"] if s)
    elif kw.get("stop") == "":
        kw.pop("stop")
    kw["logprobs"] = logprobs
    if body.get("id_slot") is not None:
        kw["extra"] = {"id_slot": body["id_slot"]}
    try:
        if body.get("repeat_last_n") is not None:
            kw.update(repeat_last_n_fields(body["repeat_last_n"]))
        params = SamplingParams(**kw)
    except SamplingParamsError as err:
        param = str(err).split(" ", 1)[0]
        raise bad_request(str(err), param if param in table else None) from None
    opts = body.get("stream_options") or {}
    return Parsed(
        params,
        stream=bool(body.get("stream")),
        include_usage=bool(opts.get("include_usage")) if isinstance(opts, dict) else False,
        model=body.get("model"),
        body=body,
    )


def parse_chat(body: Any, defaults: dict | None = None) -> Parsed:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _check_types(body, {**_FIELDS, **_CHAT})
    k = None
    if body.get("logprobs"):
        k = body.get("top_logprobs") or 0
    elif body.get("top_logprobs"):
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    parsed = parse_common(body, _CHAT, k, defaults)
    _check_tool_choice(body.get("tool_choice"))
    if not body.get("messages"):
        raise bad_request("'messages' must be a non-empty list", "messages")
    return parsed


def _check_tool_choice(choice: Any) -> None:
    """A dict tool_choice is ``{"type": "function", "function": {"name": <string>}}``."""
    if not isinstance(choice, dict):
        return  # a string (or none) is checked against the tools with them
    fn = choice.get("function")
    if choice.get("type") != "function" or not isinstance(fn, dict):
        raise bad_request(
            "'tool_choice' must be a string or {type: function, function: {name}}",
            "tool_choice",
        )
    if not isinstance(fn.get("name"), str):
        raise bad_request("'tool_choice.function.name' must be a string", "tool_choice")


def parse_completion(body: Any, defaults: dict | None = None) -> Parsed:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _check_types(body, {**_FIELDS, **_COMPLETION})
    if body.get("echo"):
        raise bad_request("'echo' is not supported", "echo")
    if "prompt" not in body or body["prompt"] in ("", []):
        raise bad_request("'prompt' is required and must not be empty", "prompt")
    return parse_common(body, _COMPLETION, body.get("logprobs"), defaults)


def message_text(content: Any, i: int) -> str:
    """A message's content: a string or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request(
                    f"messages[{i}]: only text content parts are supported", "messages"
                )
            if not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}]: a text part needs a string 'text'", "messages")
            out.append(part["text"])
        return "".join(out)
    raise bad_request(f"messages[{i}].content must be a string or a list of parts", "messages")


ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(messages: list) -> list[dict]:
    """The messages as the chat template sees them (text content, known roles)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(ROLES)}", "messages")
        msg = {"role": "system" if role == "developer" else role,
               "content": message_text(m.get("content"), i)}  # fmt: skip
        for key in ("name", "tool_call_id", "tool_calls"):
            if m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
    return out


def prompt_ids(model, prompt: Any, budget: int) -> list[int]:
    """/v1/completions' prompt: a string (tokenized within ``budget`` tokens, never whole when it
    cannot fit: `encode_within`), a list of one string, or token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return encode_within(model.tokenizer, prompt, budget)
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return list(prompt)
    raise bad_request("'prompt' must be a string, a list of one string, or token ids", "prompt")

"""Chat templates: HF Jinja templates rendered in a hardened sandbox (poly.text.jinja_sandbox),
plus Loom's five presets."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from poly.errors import TemplateError, TemplateSecurityError

# jinja2 and the sandbox load with the first template compiled, not with a model's open: a
# model's own template is compiled at its first render (`ChatTemplate(lazy=True)`).


def __getattr__(name: str) -> Any:  # PEP 562: the sandbox's names, loaded on first use
    if name in ("TemplateLimitError", "MAX_TEMPLATE_CHARS", "MAX_OUTPUT_CHARS"):
        from poly.text import jinja_sandbox

        return getattr(jinja_sandbox, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- rendering ---------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """Rebuilds template inputs from plain JSON types, so no rich object's methods leak in."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    for kind in (bool, str, int, float):  # subclasses (enums, numpy scalars) -> base type
        if isinstance(value, kind):
            return kind(value)
    return f"<{type(value).__name__}>"


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """A list of {"role": str, "content": str, ...} dicts; None-valued keys dropped as HF does."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise TemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise TemplateError("messages must not be empty")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TemplateError(f"message {i} must be a dict, got {type(message).__name__}")
        message = {k: v for k, v in message.items() if v is not None}
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise TemplateError(f"message {i} needs a string {key!r}, got {message.get(key)!r}")
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:  # HF aliases the reasoning fields so any template finds them
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(_plain(message))
    return out


def _render(template: Any, context: dict[str, Any]) -> str:
    import jinja2

    from poly.text.jinja_sandbox import BUDGET, MAX_OUTPUT_CHARS, RenderBudget, TemplateLimitError

    token = BUDGET.set(RenderBudget())
    try:
        parts, size = [], 0
        for chunk in template.generate(**context):
            size += len(chunk)
            if size > MAX_OUTPUT_CHARS:
                raise TemplateLimitError(f"rendered prompt exceeds {MAX_OUTPUT_CHARS} chars")
            parts.append(chunk)
        return "".join(parts)
    except TemplateError:
        raise
    except jinja2.exceptions.SecurityError as e:
        raise TemplateSecurityError(f"chat template blocked: {e}") from e
    except jinja2.exceptions.TemplateError as e:  # includes raise_exception(...)
        raise TemplateError(f"chat template error: {e}") from e
    except (RecursionError, MemoryError, OverflowError) as e:
        raise TemplateLimitError(f"chat template exceeded a limit: {type(e).__name__}") from e
    except Exception as e:  # a template is untrusted code: nothing raw escapes
        raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
    finally:
        BUDGET.reset(token)


_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


class ChatTemplate:
    """A compiled chat template. `render(messages)` returns the prompt text.

    Like transformers, the template sees `bos_token`, `eos_token` (and any other `special_tokens`
    given, e.g. `pad_token`) as variables. ``lazy=True`` (a loaded model's template) compiles it
    at the first `render`: a bad one is refused there, not while the model opens.
    """

    def __init__(
        self,
        source: str,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        name: str | None = None,
        special_tokens: Mapping[str, str | None] | None = None,
        lazy: bool = False,
    ):
        if not isinstance(source, str):
            raise TemplateError(f"chat template must be a string, got {type(source).__name__}")
        specials = dict(special_tokens or {})  # bos_token/eos_token arguments win over it
        specials.update(
            {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v}
        )
        for label, tok in specials.items():
            if tok is not None and not isinstance(tok, str):
                raise TemplateError(f"{label} must be a string or None, got {tok!r}")
        self._template = None if lazy else _compile(source)
        self._source = source
        self._specials = {k: v for k, v in specials.items() if v is not None}
        self._name = name

    source = property(lambda self: self._source)
    name = property(lambda self: self._name)
    bos_token = property(lambda self: self._specials.get("bos_token"))
    eos_token = property(lambda self: self._specials.get("eos_token"))
    special_tokens = property(lambda self: dict(self._specials))

    def render(self, messages: Any, *, add_generation_prompt: bool = True, **extra: Any) -> str:
        """Renders like transformers' apply_chat_template(tokenize=False).

        `extra` reaches the template as variables (e.g. `tools`, `enable_thinking`).
        """
        context: dict[str, Any] = {"tools": None, "documents": None, **self._specials}
        context.update(_plain(extra))
        context["messages"] = validate_messages(messages)
        context["add_generation_prompt"] = bool(add_generation_prompt)
        if self._template is None:
            self._template = _compile(self._source)
        return _render(self._template, context)

    @classmethod
    def preset(cls, name: str, **specials: Any) -> ChatTemplate:
        """One of Loom's built-in templates (`PRESETS`)."""
        if name not in _PRESET_ROLES:
            known = ", ".join(PRESETS)
            raise TemplateError(f"unknown chat template preset {name!r}; known: {known}")
        return cls(_preset_source(name), name=name, **specials)

    @classmethod
    def from_tokenizer_config(
        cls,
        cfg: Mapping[str, Any],
        fallback: str | None = "chatml",
        *,
        source: str | None = None,
        name: str | None = None,
        lazy: bool = False,
    ) -> ChatTemplate:
        """From a tokenizer_config.json dict (`source` overrides its `chat_template`, as a
        chat_template.jinja file does); the `fallback` preset when there is no template."""
        if not isinstance(cfg, Mapping):
            raise TemplateError("tokenizer_config must be a JSON object")
        specials = {k: _token_content(cfg.get(k), k) for k in _SPECIAL_KEYS}
        bos, eos = specials.pop("bos_token"), specials.pop("eos_token")
        kw = {"bos_token": bos, "eos_token": eos, "special_tokens": specials, "lazy": lazy}
        source = source if source is not None else _pick_template(cfg.get("chat_template"))
        if source is not None:
            return cls(source, name=name or "tokenizer_config", **kw)
        if fallback is None:
            raise TemplateError("tokenizer_config has no chat_template and no fallback was given")
        return cls.preset(fallback, **kw)

    @classmethod
    def from_dir(cls, dirpath: str | os.PathLike, fallback: str | None = "chatml") -> ChatTemplate:
        """From an HF snapshot dir: tokenizer_config.json, and chat_template.jinja if present."""
        cfg_text = _read_capped(os.path.join(dirpath, "tokenizer_config.json"))
        try:
            cfg = json.loads(cfg_text) if cfg_text is not None else {}
        except ValueError as e:
            raise TemplateError(f"tokenizer_config.json is not JSON: {e}", path=dirpath) from e
        source = _read_capped(os.path.join(dirpath, "chat_template.jinja"))
        return cls.from_tokenizer_config(cfg, fallback, source=source)

    def __repr__(self) -> str:
        return f"ChatTemplate(name={self._name!r}, {len(self._source)} chars)"


def _compile(source: str) -> Any:
    from poly.text.jinja_sandbox import compile_template

    return compile_template(source)


def _read_capped(path: str) -> str | None:
    from poly.text.jinja_sandbox import MAX_TEMPLATE_CHARS, TemplateLimitError

    if not os.path.exists(path):
        return None
    try:
        if os.path.getsize(path) > 4 * MAX_TEMPLATE_CHARS:
            raise TemplateLimitError("file too large", path=path)
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise TemplateError(f"cannot read {os.path.basename(path)}: {e}", path=path) from e


def _token_content(value: Any, key: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise TemplateError(f"{key} must be a string or {{'content': str}}, got {value!r}")


def _pick_template(value: Any) -> str | None:
    """`chat_template` is a string, or a list of {name, template} where "default" is used."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {}
        for entry in value:
            if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)):
                raise TemplateError(f"chat_template entries must be {{name, template}}: {entry!r}")
            named[entry["name"]] = entry.get("template")
        chosen = named.get("default")
        if chosen is not None and not isinstance(chosen, str):
            raise TemplateError("the 'default' chat_template must be a string")
        return chosen
    raise TemplateError(f"chat_template must be a string or a list, got {type(value).__name__}")


def messages_from_prompt(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    """A one-turn conversation: optional system message, then the user prompt."""
    if not isinstance(prompt, str) or (system is not None and not isinstance(system, str)):
        raise TemplateError("prompt and system must be strings")
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": "user", "content": prompt}]


# --- Loom's presets (inventory §5.6), written as Jinja so every template has one renderer ----

# role -> (prefix, suffix); a preset without "system" drops system messages, as Loom does.
_PRESET_ROLES: dict[str, dict[str, tuple[str, str]]] = {
    "chatml": {
        "system": ("<|im_start|>system\n", "<|im_end|>\n"),
        "user": ("<|im_start|>user\n", "<|im_end|>\n"),
        "assistant": ("<|im_start|>assistant\n", "<|im_end|>\n"),
    },
    "plain": {"user": ("", ""), "assistant": ("", "")},
    "bitnet-inst": {"user": ("<s>[INST] ", " [/INST]"), "assistant": (" ", " </s>")},
    "microsoft-bitnet": {
        "system": ("System: ", "<|eot_id|>"),
        "user": ("User: ", "<|eot_id|>"),
        "assistant": ("Assistant: ", "<|eot_id|>"),
    },
    "llama3": {
        "system": (
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n",
            "<|eot_id|>",
        ),
        "user": ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>"),
        "assistant": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    },
}
PRESETS: tuple[str, ...] = tuple(_PRESET_ROLES)


def _lit(text: str) -> str:
    return json.dumps(text)  # a double-quoted literal Jinja parses the same way


@functools.cache
def _preset_source(name: str) -> str:
    roles = _PRESET_ROLES[name]
    parts = ["{%- for m in messages -%}"]
    if "system" in roles:  # Loom trims the system prompt and skips it when empty
        pre, suf = roles["system"]
        parts.append(
            "{%- if m.role == 'system' -%}{%- if m.content | trim -%}"
            f"{{{{ {_lit(pre)} }}}}{{{{ m.content | trim }}}}{{{{ {_lit(suf)} }}}}"
            "{%- endif -%}"
        )
    else:
        parts.append("{%- if m.role == 'system' -%}")
    for role in ("user", "assistant"):
        pre, suf = roles[role]
        parts.append(
            f"{{%- elif m.role == '{role}' -%}}"
            f"{{{{ {_lit(pre)} }}}}{{{{ m.content }}}}{{{{ {_lit(suf)} }}}}"
        )
    parts.append("{%- else -%}{{ raise_exception('unsupported role: ' ~ m.role) }}")
    parts.append("{%- endif -%}{%- endfor -%}")
    parts.append(
        f"{{%- if add_generation_prompt -%}}{{{{ {_lit(roles['assistant'][0])} }}}}{{%- endif -%}}"
    )
    return "".join(parts)

"""Turning what a user passes to generate()/stream() into token ids and options."""

from __future__ import annotations

from typing import Any

from poly.errors import GenerationError, InvalidTokenError, TemplateError
from poly.text.gendefaults import resolve
from poly.text.generation import stream_tokens
from poly.text.speculative import Speculation


def prompt_to_ids(
    model: Any, prompt: Any, *, chat: bool | None = None, system: str | None = None
) -> list[int]:
    if isinstance(prompt, (list, tuple)) and not prompt:
        raise InvalidTokenError("empty prompt: at least one token is needed to produce logits")
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return [int(t) for t in prompt]
    if model.tokenizer is None:
        raise GenerationError("this model has no tokenizer: pass token ids")
    if isinstance(prompt, str) and not chat:
        if system is not None:
            raise GenerationError("a system message needs chat=True")
        return model.tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)):
        messages = list(prompt)
    else:
        raise GenerationError(f"cannot use a {type(prompt).__name__} as a prompt")
    if system is not None:
        messages = [{"role": "system", "content": system}, *messages]
    if model.chat_template is None:
        raise TemplateError("this model has no chat template")
    text = model.chat_template.render(messages, add_generation_prompt=True)
    return model.tokenizer.encode(text, add_special_tokens=False)


def resolve_options(model: Any, options: Any, overrides: dict) -> Any:
    """``overrides`` > ``options`` or the model file's settings > the fallback (gendefaults)."""
    return resolve(model, options, overrides).options


def stream(model: Any, ids: list[int], options: Any, overrides: dict, *, stop: Any = None):
    """`Transformer.stream` after the prompt is ids: resolve options, then generate. The
    speculative keywords (``lookup``, ``lookup_ngram``, ``draft``, ``draft_tokens``,
    ``adaptive``: poly.text.speculative) are not generation options: they go apart."""
    overrides = dict(overrides)
    spec = Speculation.from_options(overrides)
    opts = resolve_options(model, options, overrides)
    return stream_tokens(model, ids, opts, stop=stop, speculation=spec)

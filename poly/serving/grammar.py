"""Structured output: a grammar (JSON schema, Lark, regex) applied as a token mask (llguidance).

``Grammars(model)`` builds llguidance's tokenizer once from the model's tokenizer.json text, sized
to the logits width. ``compile_json_schema(schema)`` returns a factory that the scheduler calls
once per choice (``Scheduler.submit(..., mask_factory=...)``); each ``TokenMask`` sets disallowed
logits to -inf before sampling, consumes the sampled token, and reports ``finished`` once the
grammar accepts nothing but the end. ``tool_calls(body, free_text)`` is the grammar of a tool-call
turn (``tool_call_lark``). Needs the optional ``llguidance`` package.
"""

from __future__ import annotations

import json

import numpy as np

from poly.errors import SamplingParamsError, UsageError

COMPACT = {"whitespace_flexible": False}  # no runs of whitespace: every token makes progress


class TokenMask:
    """One choice's matcher state."""

    def __init__(self, matcher, vocab: int):
        self.m = matcher
        self.vocab = vocab
        self.bits = np.zeros((vocab + 31) // 32, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """bool [V]: the tokens the grammar allows next."""
        self.m.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        return np.unpackbits(self.bits.view(np.uint8), bitorder="little")[: self.vocab].astype(bool)

    def consume(self, token_id: int) -> None:
        self.m.consume_token(int(token_id))
        if self.m.is_error():
            raise SamplingParamsError(f"structured output failed: {self.m.get_error()}")

    @property
    def finished(self) -> bool:
        return bool(self.m.is_stopped())


class Grammars:
    """llguidance's view of one model's tokenizer (about a second to build: keep one)."""

    def __init__(self, model):
        try:
            import llguidance
        except ImportError as err:
            raise UsageError("structured output needs the llguidance package") from err
        self._ll = llguidance
        tok = getattr(model, "tokenizer", None)
        if tok is None:
            raise UsageError("structured output needs a model with a tokenizer")
        self.vocab = int(model.config.vocab_size)  # the logits width
        eos = list(getattr(model, "eos_token_ids", ()) or ())
        self.tokenizer = llguidance.LLTokenizer(tok.to_str(), n_vocab=self.vocab,
                                                eos_token=eos or None)  # fmt: skip

    def _factory(self, grammar: str):
        first = self._ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if first.is_error():
            raise SamplingParamsError(f"invalid grammar: {first.get_error()}")
        vocab = self.vocab

        def make() -> TokenMask:
            return TokenMask(first.deep_copy(), vocab)

        return make

    def json_schema(self, schema) -> object:
        """A mask factory for JSON matching ``schema`` (a dict or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as err:
                raise SamplingParamsError(f"the JSON schema is not JSON: {err}") from None
        if not isinstance(schema, dict):
            raise SamplingParamsError("a JSON schema must be an object")
        try:
            grammar = self._ll.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT)
        except ValueError as err:
            raise SamplingParamsError(f"invalid JSON schema: {err}") from None
        return self._factory(grammar)

    def tool_calls(self, body: dict, text: bool | dict = False) -> object:
        """A mask factory for a tool call, ``<tool_call>BODY</tool_call>`` or a bare BODY (a JSON
        schema), or instead plain text (``text=True``) or JSON of the schema ``text``."""
        if not isinstance(body, dict) or not isinstance(text, (bool, dict)):
            raise SamplingParamsError("a tool call schema must be an object")
        return self._factory(tool_call_lark(body, text))

    def lark(self, text: str) -> object:
        return self._factory(self._ll.LLMatcher.grammar_from_lark(text))

    def regex(self, pattern: str) -> object:
        return self._factory(self._ll.LLMatcher.grammar_from_regex(pattern))


TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


def tool_call_lark(body: dict, text: bool | dict = False) -> str:
    """A Lark grammar (llguidance dialect) for one tool-call turn.

    The call is ``<tool_call>`` BODY ``</tool_call>`` (SmolLM2's and Hermes' syntax) or a bare
    BODY. With ``text=True`` the turn may instead be any text (not starting with ``{``: that is a
    bare call), and text may lead into a tagged call: the trigger is a lazy lexeme, so once
    ``<tool_call>`` appears the body is held to the schema (llguidance's tool-calling recipe).
    With a schema as ``text`` the turn is JSON of it or a tagged call.
    """
    opened, closed = json.dumps(TOOL_OPEN), json.dumps(TOOL_CLOSE)
    if text is True:
        head = (
            f"start: text | lead tagged | bare\ntext: TEXT\nlead[lazy]: TEXT {opened}\n"
            "TEXT: /(?s:.*)/ & ~/\\{(?s:.*)/\nbare: body\n"
        )
    elif isinstance(text, dict):
        head = f"start: answer | {opened} tagged\nanswer: %json {_json(text)}\n"
    else:
        head = f"start: {opened} tagged | bare\nbare: body\n"
    # at most two blanks around the body: room for the model's own layout, none for stalling
    return (
        "%llguidance {}\n" + head + f"tagged: WS body WS {closed}\n"
        "WS: /[ \\n]{0,2}/\nbody: %json " + _json(body) + "\n"
    )


def _json(schema: dict) -> str:
    return json.dumps({"x-guidance": COMPACT, **schema}, ensure_ascii=False)

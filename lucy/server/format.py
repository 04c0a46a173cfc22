"""OpenAI response bodies and stream chunks from scheduler events."""

from __future__ import annotations

import json

from poly.serving import TokenLogprob, Usage


def usage_json(u: Usage) -> dict:
    out = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
    }
    if u.cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": u.cached_tokens}
    return out


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class TokenText:
    """Token id -> its text (cached), for logprobs."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, t: int) -> str:
        s = self.cache.get(t)
        if s is None:
            s = self.tok.decode([t]) if self.tok is not None else str(t)
            self.cache[t] = s
        return s


def chat_logprob(lp: TokenLogprob, text: TokenText) -> dict:
    def one(t: int, v: float) -> dict:
        s = text(t)
        return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

    out = one(lp.token_id, lp.logprob)
    out["top_logprobs"] = [one(t, v) for t, v in lp.top]
    return out


def completion_logprobs(lps: list[TokenLogprob], text: TokenText) -> dict:
    tokens, offsets, pos = [], [], 0
    for lp in lps:
        s = text(lp.token_id)
        tokens.append(s)
        offsets.append(pos)
        pos += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{text(t): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }

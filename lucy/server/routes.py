"""/v1/chat/completions and /v1/completions: stream and non-stream."""

from __future__ import annotations

import time

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from lucy.server import relay, structured, toolcalls
from lucy.server.errors import ApiError, bad_request, from_poly
from lucy.server.format import (
    SSE_DONE,
    TokenText,
    chat_logprob,
    completion_logprobs,
    sse,
    usage_json,
)
from lucy.server.protocol import chat_messages, parse_chat, parse_completion, prompt_ids
from poly.errors import ContextOverflowError, PolyError
from poly.serving import RequestDone, RequestFailed, TokenOut
from poly.text.prompt_budget import encode_within


def _prompt_budget(state, parsed) -> int:
    """Prompt tokens that fit beside max_tokens (the scheduler's own check, made first)."""
    ctx, want = state.scheduler.max_context, parsed.params.max_tokens or 1
    if want >= ctx:
        raise from_poly(ContextOverflowError(
            f"this model's context is {ctx} tokens; max_tokens asks for {want}, leaving no "
            f"room for the prompt"))  # fmt: skip
    return ctx - want


def _render_chat(model, messages, tools, budget: int) -> list[int]:
    tmpl = model.chat_template
    if tmpl is None:
        raise bad_request("this model has no chat template: use /v1/completions", "messages")
    extra = {"tools": tools} if tools else {}
    if tools and not toolcalls.shows_tools(tmpl):  # the template cannot show them: a system message
        note = structured.tools_system_text(tools)
        if messages and messages[0]["role"] == "system":
            messages = [
                {**messages[0], "content": messages[0]["content"] + "\n\n" + note},
                *messages[1:],
            ]
        else:
            messages = [{"role": "system", "content": note}, *messages]
    text = model.chat_template.render(messages, add_generation_prompt=True, **extra)
    return encode_within(model.tokenizer, text, budget)


async def _prepare(state, request: Request, parse):
    state.check_auth(request)
    body = await state.read_json(request)
    parsed = parse(body, state.defaults)
    state.check_model(parsed.model)
    return parsed


async def chat(state, request: Request):
    parsed = await _prepare(state, request, parse_chat)
    body, model = parsed.body, state.model
    messages = chat_messages(body["messages"])
    plan = await run_in_threadpool(structured.plan, state, body)
    try:
        budget = _prompt_budget(state, parsed)
        ids = await run_in_threadpool(_render_chat, model, messages, plan.tools, budget)
    except PolyError as err:
        raise from_poly(err) from None
    handle, q = state.submit(ids, parsed.params, plan.mask_factory)
    rid, created = f"chatcmpl-{handle.id}", int(time.time())
    head = {"id": rid, "created": created, "model": state.model_id}
    text = TokenText(model.tokenizer)
    if parsed.stream:
        gen = _chat_stream(handle, q, head, text, parsed, plan, request)
        return relay.streaming(gen)
    return await _chat_full(handle, q, head, text, parsed, plan, request)


async def _collect(handle, q, request, n):
    choices = [{"text": [], "logprobs": [], "finish": None} for _ in range(n)]
    done = None
    async for ev in relay.events(handle, q, request):
        if isinstance(ev, RequestFailed):
            raise from_poly(ev.error)
        if isinstance(ev, RequestDone):
            done = ev
            break
        c = choices[ev.index]
        c["text"].append(ev.text)
        if ev.logprob is not None:
            c["logprobs"].append(ev.logprob)
    if done is None:
        raise ApiError(499, "client closed the request", "invalid_request_error")
    for c, reason in zip(choices, done.finish_reasons):
        c["finish"] = reason
    return choices, done


async def _chat_full(handle, q, head, text, parsed, plan, request):
    choices, done = await _collect(handle, q, request, parsed.params.n)
    out = []
    for i, c in enumerate(choices):
        message, finish = plan.message("".join(c["text"]), c["finish"])
        lp = None
        if parsed.params.logprobs is not None:
            lp = {"content": [chat_logprob(x, text) for x in c["logprobs"]]}
        out.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
    return {**head, "object": "chat.completion", "choices": out, "usage": usage_json(done.usage)}


async def _chat_stream(handle, q, head, text, parsed, plan, request):
    head = {**head, "object": "chat.completion.chunk"}

    def chunk(i, delta, finish=None, lp=None):
        choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return sse({**head, "choices": [choice]})

    for i in range(parsed.params.n):
        yield chunk(i, {"role": "assistant", "content": ""})
    texts = [[] for _ in range(parsed.params.n)]
    async for ev in relay.events(handle, q, request):
        if isinstance(ev, TokenOut):
            lp = None
            if ev.logprob is not None:
                lp = {"content": [chat_logprob(ev.logprob, text)]}
            if plan.buffered:  # tool calls: sent whole at the end
                texts[ev.index].append(ev.text)
            elif ev.text or lp:
                yield chunk(ev.index, {"content": ev.text}, None, lp)
            if ev.finish_reason is not None:
                message, finish = plan.message("".join(texts[ev.index]), ev.finish_reason)
                if plan.buffered:
                    yield chunk(ev.index, _tool_delta(message))
                yield chunk(ev.index, {}, finish)
        elif isinstance(ev, RequestFailed):
            yield sse(from_poly(ev.error).body())
            break
        elif isinstance(ev, RequestDone):
            if parsed.include_usage:
                yield sse({**head, "choices": [], "usage": usage_json(ev.usage)})
    yield SSE_DONE


def _tool_delta(message: dict) -> dict:
    if not message.get("tool_calls"):
        return {"content": message.get("content") or ""}
    return {"tool_calls": [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]}


async def completions(state, request: Request):
    parsed = await _prepare(state, request, parse_completion)
    model = state.model
    try:
        budget = _prompt_budget(state, parsed)
        ids = await run_in_threadpool(prompt_ids, model, parsed.body["prompt"], budget)
    except PolyError as err:
        raise from_poly(err) from None
    handle, q = state.submit(ids, parsed.params)
    head = {"id": f"cmpl-{handle.id}", "created": int(time.time()), "model": state.model_id}
    text = TokenText(model.tokenizer)
    if parsed.stream:
        return relay.streaming(_completion_stream(handle, q, head, text, parsed, request))
    choices, done = await _collect(handle, q, request, parsed.params.n)
    out = []
    for i, c in enumerate(choices):
        lp = None
        if parsed.params.logprobs is not None:
            lp = completion_logprobs(c["logprobs"], text)
        out.append(
            {"index": i, "text": "".join(c["text"]), "logprobs": lp, "finish_reason": c["finish"]}
        )
    return {**head, "object": "text_completion", "choices": out, "usage": usage_json(done.usage)}


async def _completion_stream(handle, q, head, text, parsed, request):
    head = {**head, "object": "text_completion"}
    async for ev in relay.events(handle, q, request):
        if isinstance(ev, TokenOut):
            lp = completion_logprobs([ev.logprob], text) if ev.logprob is not None else None
            choice = {"index": ev.index, "text": ev.text, "logprobs": lp,
                      "finish_reason": ev.finish_reason}  # fmt: skip
            yield sse({**head, "choices": [choice]})
        elif isinstance(ev, RequestFailed):
            yield sse(from_poly(ev.error).body())
            break
        elif isinstance(ev, RequestDone):
            if parsed.include_usage:
                yield sse({**head, "choices": [], "usage": usage_json(ev.usage)})
    yield SSE_DONE

"""OpenAI-compatible `POST /v1/chat/completions`, shared by the TGI and vLLM simulators.

The two servers differ only in wire details (protocols.md §2.4 and §3.2); each is a
`Dialect` value defined next to its server (`tgi.TGI_CHAT`, `vllm.VLLM_CHAT`), so a quirk is
a field here rather than a second copy of the handler.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson
from aiohttp import web

from proxy.simulators.bodies import json_object, json_response, opt
from proxy.simulators.errors import ENGINE_DEAD, ENGINE_DEAD_TYPE, BadRequest, HttpError
from proxy.simulators.exchange import ErrorEvents, EventWriter, Exchange
from proxy.simulators.runtime import Handler
from proxy.simulators.textgen import (
    STOP_SEQUENCE,
    Generation,
    content_text,
    generate,
    pick_tool,
    prompt_key,
    prompt_token_list,
    token_logprob,
    top_alternatives,
)

JsonObj = dict[str, Any]


@dataclass(frozen=True)
class StreamExtras:
    """Fields a server's chunks carry beyond OpenAI's (vLLM: `prompt_token_ids` on the role
    chunk, `token_ids` on each token's choice, `system_fingerprint` on the last chunk)."""

    role_chunk: Mapping[str, object] = field(default_factory=dict)
    choice: Mapping[str, object] = field(default_factory=dict)
    last_chunk: Mapping[str, object] = field(default_factory=dict)


UsageExtra = Callable[[Exchange, bool], JsonObj]  # (exchange, whole answer?) -> usage fields
# Server-side checks once the model is known; returns the completion limit to generate to.
Check = Callable[[Exchange, "ChatRequest"], "int | None"]


def no_usage_extra(_ex: Exchange, _whole: bool) -> JsonObj:
    return {}


@dataclass(frozen=True)
class Dialect:
    kind: str
    sse_prefix: bytes  # b"data: " (Starlette) or b"data:" (axum)
    strict_model: bool  # unknown `model` → 404; otherwise the one served model answers
    fixed_id: str | None  # TGI: always ""; None: a fresh "chatcmpl-<hex>"
    system_fingerprint: str | None  # None: key absent
    role_chunk: bool  # a first {"role","content":""} chunk per choice
    role_in_deltas: bool  # every delta repeats "role"
    finish_chunk: frozenset[str]  # finishes (internal names) reported in a chunk of their own
    finish_names: Mapping[str, str]  # internal (TGI) finish reason → this server's
    stop_reason: bool  # choices[].stop_reason: the matched stop string or null
    null_usage_in_chunks: bool  # "usage":null on every chunk (else absent)
    logprob_bytes: bool
    reasoning: bool  # honours chat_template_kwargs.enable_thinking
    tool_call_id: Callable[[], str]
    tool_meta_every_fragment: bool  # id/type (and "name":null) repeated on each fragment
    tool_content_null: bool  # tool-call message has "content":null (else no content key)
    tool_function_extra: Mapping[str, object]
    message_extra: Mapping[str, object]
    response_extra: Mapping[str, object]
    usage_extra: UsageExtra
    tools_exclude_response_format: bool
    generation_failure: tuple[int, str, str]  # (status, message, error_type)
    error_events: ErrorEvents
    headers: Callable[[Exchange, int | None], Mapping[str, str]]  # generated tokens or None
    choice_extra: Mapping[str, object] = field(default_factory=dict)  # whole answers' choices
    stream_extras: StreamExtras = StreamExtras()
    check: Check | None = None


class ChatRequest(NamedTuple):
    model: str | None
    messages: list[JsonObj]
    stream: bool
    include_usage: bool
    max_tokens: int | None
    n: int
    stop: tuple[str, ...]
    seed: int
    logprobs: bool
    top_logprobs: int
    tools: list[Any]
    tool_choice: object
    response_format: object
    thinking: bool
    ignore_eos: bool  # vLLM: generate to the cap, whatever the model "wants"
    cap_field: str  # which of max_completion_tokens / max_tokens named the cap
    priority: int = 0  # vLLM --scheduling-policy priority: lower runs earlier


def _stops(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise BadRequest("stop: expected a string or an array of strings", "type")


def parse_chat(raw: bytes) -> ChatRequest:
    body = json_object(raw)
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("messages: expected an array of message objects", "type")
    if not messages:
        raise BadRequest("messages: at least one message is required", "value")
    for message in messages:
        if not isinstance(message.get("role"), str):
            raise BadRequest("messages: every message needs a string `role`", "type")
        if not isinstance(message.get("content"), str | list | None):
            raise BadRequest("messages: `content` must be a string or an array", "type")
    cap_field = "max_completion_tokens"
    max_tokens = opt(body, cap_field, int)
    if max_tokens is None:
        cap_field = "max_tokens"
        max_tokens = opt(body, cap_field, int)
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}.", "value",
                         "max_tokens", max_tokens)
    n = opt(body, "n", int)
    n = 1 if n is None else n
    if not 1 <= n <= 128:
        raise BadRequest("`n` must be between 1 and 128", "value")
    stops = _stops(body.get("stop"))
    top = opt(body, "top_logprobs", int) or 0
    if not 0 <= top <= 20:
        raise BadRequest("`top_logprobs` must be between 0 and 20", "value")
    options = opt(body, "stream_options", dict) or {}
    kwargs = opt(body, "chat_template_kwargs", dict) or {}
    return ChatRequest(
        model=opt(body, "model", str),
        messages=messages,
        stream=bool(opt(body, "stream", bool)),
        include_usage=options.get("include_usage") is True,
        max_tokens=max_tokens,
        n=n,
        stop=stops,
        seed=opt(body, "seed", int) or 0,
        logprobs=bool(opt(body, "logprobs", bool)),
        top_logprobs=top,
        tools=opt(body, "tools", list) or [],
        tool_choice=body.get("tool_choice"),
        response_format=body.get("response_format"),
        thinking=kwargs.get("enable_thinking") is True,
        ignore_eos=opt(body, "ignore_eos", bool) is True,
        cap_field=cap_field,
        priority=opt(body, "priority", int) or 0,
    )


def chat_handler(d: Dialect) -> Handler:
    async def handle(ex: Exchange) -> web.StreamResponse:
        req = parse_chat(ex.record.body)
        models = ex.config.models
        model = (req.model or models[0]) if d.strict_model else models[0]
        if model not in models:
            raise HttpError(404, f"The model `{model}` does not exist. Valid aliases: "
                            f"{', '.join(models)}.", "NotFoundError", "model")
        if d.tools_exclude_response_format and req.tools and req.response_format is not None:
            raise HttpError(422, "Grammar and tools are mutually exclusive", "tool_error")
        ex.model = model
        ex.prompt = prompt_token_list(req.messages)
        ex.prompt_tokens = len(ex.prompt)
        ex.prompt_chars = sum(len(content_text(m.get("content"))) for m in req.messages)
        key = prompt_key(model, req.messages)
        limit = ex.token_cap = req.max_tokens if d.check is None else d.check(ex, req)
        ex.priority = req.priority
        # ignore_eos: the "model" would go on past the cap, so the cap ends it (length).
        natural = limit + 1 if req.ignore_eos and limit is not None else ex.natural_tokens
        tool = pick_tool(req.tools, req.tool_choice)
        thinking = d.reasoning and req.thinking
        ex.generations = [
            generate(
                key,
                req.seed + i,
                natural=natural,
                limit=limit,
                stop=req.stop,
                tool=tool,
                reasoning=thinking,
            )
            for i in range(req.n)
        ]
        if req.stream:
            return await _stream(d, ex, req, model)
        return await _complete(d, ex, req, model)

    return handle


def _logprob(d: Dialect, token: str, top: int) -> JsonObj:
    def entry(text: str, logprob: float) -> JsonObj:
        item: JsonObj = {"token": text, "logprob": logprob}
        if d.logprob_bytes:
            item["bytes"] = list(text.encode())
        return item

    first = entry(token, token_logprob(token))
    first["top_logprobs"] = [entry(t, lp) for t, lp in top_alternatives(token, top)]
    return first


def _usage(d: Dialect, ex: Exchange, generations: Sequence[Generation], whole: bool) -> JsonObj:
    completion = sum(g.completion_tokens for g in generations)
    prompt = ex.prompt_tokens
    usage: JsonObj = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    usage.update(d.usage_extra(ex, whole))
    reasoning = sum(len(g.reasoning) for g in generations)
    if reasoning:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return usage


def _finish(d: Dialect, g: Generation) -> JsonObj:
    finish: JsonObj = {"finish_reason": d.finish_names[g.finish]}
    if d.stop_reason:
        finish["stop_reason"] = g.stop if g.finish == STOP_SEQUENCE else None
    return finish


def _envelope(d: Dialect, model: str, obj: str) -> JsonObj:
    chat_id = d.fixed_id if d.fixed_id is not None else f"chatcmpl-{random.getrandbits(128):032x}"
    env: JsonObj = {"id": chat_id, "object": obj, "created": int(time.time()), "model": model}
    if d.system_fingerprint is not None:
        env["system_fingerprint"] = d.system_fingerprint
    return env


async def _complete(d: Dialect, ex: Exchange, req: ChatRequest, model: str) -> web.Response:
    if not await ex.admit():
        raise HttpError(429, "Model is overloaded", "overloaded")
    if ex.config.fail_generation:
        raise HttpError(*d.generation_failure)
    gens = ex.generations
    await ex.pacer().whole(max(g.completion_tokens for g in gens))
    if ex.state.dead:  # the engine died while this one was generating
        ex.state.close_soon(0)
        raise HttpError(500, ENGINE_DEAD, ENGINE_DEAD_TYPE)
    choices = []
    for index, g in enumerate(gens):
        message: JsonObj = {"role": "assistant"}
        if g.tool_call is None:
            message["content"] = g.text
        elif d.tool_content_null:
            message["content"] = None
        message.update(d.message_extra)
        if g.tool_call is not None:
            function = {
                **d.tool_function_extra,
                "name": g.tool_call.name,
                "arguments": g.tool_call.arguments,
            }
            message["tool_calls"] = [
                {"id": d.tool_call_id(), "type": "function", "function": function}
            ]
        if g.reasoning:
            message["reasoning"] = "".join(g.reasoning)
        logprobs = None
        if req.logprobs and g.tool_call is None:
            logprobs = {"content": [_logprob(d, t, req.top_logprobs) for t in g.tokens]}
        choices.append({"index": index, "message": message, "logprobs": logprobs, **_finish(d, g),
                        **d.choice_extra})
    body = _envelope(d, model, "chat.completion")
    body["choices"] = choices
    body.update(d.response_extra)
    body["usage"] = _usage(d, ex, gens, whole=True)
    generated = sum(g.completion_tokens for g in gens)
    return json_response(body, headers=d.headers(ex, generated))


def _tool_deltas(d: Dialect, g: Generation, role: JsonObj) -> list[JsonObj]:
    assert g.tool_call is not None
    call_id = d.tool_call_id()
    pieces = g.tool_call.fragments()
    if not d.tool_meta_every_fragment:
        pieces.insert(0, "")  # vLLM: name first, arguments follow in their own deltas
    deltas = []
    for k, piece in enumerate(pieces):
        call: JsonObj = {"index": 0}
        if k == 0 or d.tool_meta_every_fragment:
            call.update(id=call_id, type="function")
            call["function"] = {"name": g.tool_call.name if k == 0 else None, "arguments": piece}
        else:
            call["function"] = {"arguments": piece}
        deltas.append({**role, "tool_calls": [call]})
    return deltas


def _steps(d: Dialect, index: int, g: Generation, req: ChatRequest) -> list[list[JsonObj]]:
    """One choice's chunk `choices` entries, grouped by generation step (paced together)."""
    role: JsonObj = {"role": "assistant"} if d.role_in_deltas else {}
    extra = d.stream_extras.choice
    pending: list[tuple[JsonObj, object]] = [({**role, "reasoning": t}, None) for t in g.reasoning]
    if g.tool_call is not None:
        pending += [(delta, None) for delta in _tool_deltas(d, g, role)]
    else:
        for token in g.tokens:
            logprobs = {"content": [_logprob(d, token, req.top_logprobs)]} if req.logprobs else None
            pending.append(({**role, "content": token}, logprobs))
    own_chunk = g.finish in d.finish_chunk
    if not pending and not own_chunk:
        pending.append(({**role, "content": ""}, None))  # nothing generated: an empty chunk
    steps = [
        [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": None, **extra}]
        for delta, lp in pending
    ]
    if own_chunk:  # e.g. vLLM's EOS: the end-of-sequence token's own (empty) chunk
        delta = {} if g.tool_call is not None else {"content": ""}
        last = {"index": index, "delta": delta, "logprobs": None, **_finish(d, g), **extra}
        if not steps:
            steps.append([])
        steps[-1].append(last)
    else:
        steps[-1][-1].update(_finish(d, g))
    if d.role_chunk:
        first = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        steps[0].insert(0, first)
    return steps


def _tail(tail: bytes, fields: Mapping[str, object]) -> bytes:
    """A chunk's closing bytes (after `choices`) with `fields` added at the top level."""
    return tail[:-1] + b"," + orjson.dumps(fields)[1:-1] + b"}" if fields else tail


async def _stream(d: Dialect, ex: Exchange, req: ChatRequest, model: str) -> web.StreamResponse:
    writer = EventWriter(ex, d.sse_prefix, d.error_events)
    await writer.open(d.headers(ex, None))
    if not await ex.admit():
        await writer.fail("Model is overloaded", "overloaded")
    if ex.config.fail_generation:
        await writer.fail(d.generation_failure[1], d.generation_failure[2])
    envelope = _envelope(d, model, "chat.completion.chunk")
    head = orjson.dumps({**envelope, "choices": []})[:-2]  # ends with `"choices":[`
    tail = b'],"usage":null}' if d.null_usage_in_chunks else b"]}"
    per_choice = [_steps(d, i, g, req) for i, g in enumerate(ex.generations)]
    schedule = [
        [(choice, tail) for steps in per_choice if k < len(steps) for choice in steps[k]]
        for k in range(max(len(steps) for steps in per_choice))
    ]
    extras = d.stream_extras
    if d.role_chunk:
        schedule[0][0] = (schedule[0][0][0], _tail(tail, extras.role_chunk))
    if not req.include_usage:  # else the usage chunk is the last
        schedule[-1][-1] = (schedule[-1][-1][0], _tail(tail, extras.last_chunk))
    pacer = ex.pacer()
    for step in schedule:
        await pacer.step()
        for choice, end in step:
            await writer.send(head + orjson.dumps(choice) + end)
    if req.include_usage:
        usage = _usage(d, ex, ex.generations, whole=False)
        await writer.send(orjson.dumps({**envelope, "choices": [], "usage": usage,
                                        **extras.last_chunk}))
    await writer.send(b"[DONE]")
    return writer.response


def error_payloads(body: Callable[[str, str], JsonObj]) -> ErrorEvents:
    """In-band chat error: one `{"error":...}` event, then the usual `[DONE]`."""
    return lambda message, error_type: [orjson.dumps(body(message, error_type)), b"[DONE]"]

"""The request path, one readable function per route family.

    auth (who) -> rate limit -> parse + validate (400/413/422) -> tier access + model (403/404)
    -> credit hold (402) -> route (503) -> translate -> upstream (502/503/504, one retry before
    the first byte) -> relay (JSON, or SSE event by event) -> meter + settle

Each step returns a value or raises `GatewayError`; the error middleware renders it. Identity,
rate limits, tier access and credits are later steps (marked below) that slot into this function
rather than hide in middleware.
"""

from __future__ import annotations

import uuid
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from proxy.appkeys import CONFIG, REQUEST_ID, ROUTER, UPSTREAMS
from proxy.errors import ErrorKind, GatewayError, validation_failed
from proxy.relay import relay_sse
from proxy.request_body import parse_json_object, read_capped
from proxy.schemas import ChatRequest
from proxy.translate import openai_chat
from proxy.validate import RequestInvalid, validate_chat

CHAT_UPSTREAM_PATH = "/v1/chat/completions"


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v2/compat/v1/chat/completions: an OpenAI-style chat completion, start to finish."""
    app = request.app
    config = app[CONFIG]
    # Identity and rate limit come first here (every caller is a guest until keys exist).
    raw = await read_capped(request, config.policies.requests.chat.max_body_bytes)
    body = parse_json_object(raw)
    chat = _validated(body)
    mode = _direct_mode(chat)
    pool = app[ROUTER].chat_pool(chat.model)
    # Tier access and the credit hold go here, before anything reaches an upstream.
    if chat.async_:
        raise GatewayError(ErrorKind.NOT_IMPLEMENTED, "async chat tasks are not available yet")

    task_id = f"{mode}:{uuid.uuid4()}"
    request_id = request[REQUEST_ID]
    headers = {
        "Content-Type": "application/json",
        "Accept": "text/event-stream" if chat.stream else "application/json",
        "X-Request-Id": request_id,
    }
    async with app[UPSTREAMS].call(
        pool, CHAT_UPSTREAM_PATH,
        lambda backend: openai_chat.upstream_body(body, chat, backend.spec.kind),
        headers, request.headers,
    ) as (backend, upstream):
        if chat.stream:
            chunks = openai_chat.ChunkFilter(
                backend.spec.kind, chat.model, openai_chat.wants_usage(chat)
            )
            response, _result = await relay_sse(
                request, upstream, chunks, {"X-Request-Id": request_id, "X-Task-Id": task_id}
            )
            # Metering and settlement of `_result` and `chunks.usage` go here.
            return response
        completion = await _read_completion(upstream)
    completion = openai_chat.fix_response(completion, backend.spec.kind, chat.model)
    completion["task_id"] = task_id
    completion["mode"] = mode
    completion["task_address"] = None
    return web.Response(
        body=orjson.dumps(completion), content_type="application/json",
        headers={"X-Task-Id": task_id},
    )


def _validated(body: dict[str, Any]) -> ChatRequest:
    try:
        return validate_chat(body)
    except RequestInvalid as exc:
        raise validation_failed(exc.detail) from None


def _direct_mode(chat: ChatRequest) -> str:
    """`auto` and `direct` run on the model's direct pool; no network-mode pools exist yet."""
    if chat.mode == "network":
        raise GatewayError(
            ErrorKind.NOT_FOUND, "network mode is not offered for this model; use direct or auto"
        )
    return "direct"


async def _read_completion(upstream: aiohttp.ClientResponse) -> dict[str, Any]:
    try:
        raw = await upstream.read()
    except (aiohttp.ServerTimeoutError, TimeoutError):
        raise GatewayError(ErrorKind.UPSTREAM_TIMEOUT, "the model server did not finish in time")\
            from None
    except aiohttp.ClientError:
        raise GatewayError(ErrorKind.UPSTREAM_ERROR, "the model server broke off its answer")\
            from None
    try:
        completion = orjson.loads(raw)
    except orjson.JSONDecodeError:
        completion = None
    if not isinstance(completion, dict) or "error" in completion:
        raise GatewayError(ErrorKind.UPSTREAM_ERROR, "the model server sent an unusable answer")
    return completion

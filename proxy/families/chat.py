"""Chat on the request path, after admission: the style's request sent to an OpenAI-compatible
backend (`/v1/chat/completions`), its answer relayed back in the style — a stream event by event,
or a whole answer rendered and sent — or, for an async task, returned without a client.

The completion cap the hold assumed is what the upstream gets (styles.wire.upstream_body), so
no token is ever generated beyond the hold. A "prefix" pool keeps a prompt's prefix on one
replica (`affinity`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

from proxy.config.policies import ChatRequestPolicy
from proxy.credits.meter import Result
from proxy.credits.pricing import MediaPart, media_parts, usage_from
from proxy.errors import ErrorKind, GatewayError, validation_failed
from proxy.families.base import Ctx
from proxy.observe.trace import TRACE
from proxy.styles import wire
from proxy.styles.base import ChatCall, ChatStyle
from proxy.upstream import http1
from proxy.upstream.client import read_answer
from proxy.upstream.early import Early
from proxy.upstream.kv_blocks import session_of
from proxy.upstream.pool import Backend, Pool
from proxy.upstream.prefixes import SESSION_HEADER, Prompt, prompt_of
from proxy.upstream.relay import relay_stream, send_whole
from proxy.validate import RequestInvalid

CHAT_UPSTREAM_PATH = "/v1/chat/completions"
COMPLETION_MAX_BYTES = 64 * 1024 * 1024  # a whole chat answer; more is not a completion


def parsed_call(style: ChatStyle, body: dict[str, Any]) -> ChatCall:
    """The client's body as the style reads it; 422 when it is not a valid request."""
    try:
        return style.parse(body)
    except RequestInvalid as exc:
        raise validation_failed(exc.detail) from None


def check_media(call: ChatCall, policy: ChatRequestPolicy, exact: bool) -> None:
    """Media parts go to the engine inline only, within [chat]'s bounds: 422 for a part that
    names a URL other than a data: URL (the engine would fetch it from inside the operator's
    network), a `file_id` or embeddings, or for more parts than `max_media_parts`; 413 for a part
    or all of them past their bytes. `exact`: the OpenAI-style body is the client's own (the
    compat and served routes), so a fault's loc names the part; else it names `messages`."""
    faults: list[dict[str, object]] = []
    parts = list(media_parts(call.openai_body))
    for part in parts:
        if (problem := _unusable(part)) is not None:
            faults.append({"loc": _loc(part, exact), "type": "url_not_allowed", "msg": problem})
    if len(parts) > policy.max_media_parts:
        faults.append({"loc": ["body", "messages"], "type": "too_many_media_parts",
                       "msg": f"a request may carry at most {policy.max_media_parts} media "
                              f"parts (images, audio, video, files); it has {len(parts)}"})
    if faults:
        raise validation_failed(faults)
    largest = max((part.size for part in parts), default=0)
    if largest > policy.max_media_part_bytes:
        raise GatewayError(ErrorKind.PAYLOAD_TOO_LARGE,
                           f"a media part may carry at most {policy.max_media_part_bytes} bytes")
    if sum(part.size for part in parts) > policy.max_media_bytes:
        raise GatewayError(ErrorKind.PAYLOAD_TOO_LARGE,
                           f"media parts may carry at most {policy.max_media_bytes} bytes in all")


def _unusable(part: MediaPart) -> str | None:
    if part.kind == "embeds":
        return "embedding parts are not accepted: send the media itself"
    if part.file_id:
        return "file_id references are not accepted: send the file inline (file_data)"
    if part.url is not None and part.url[:5].lower() != "data:":
        return ("media parts are accepted inline only, as a data: URL (base64): the gateway "
                "does not forward URLs for the model server to fetch")
    return None


def _loc(part: MediaPart, exact: bool) -> list[str | int]:
    return ["body", *part.loc] if exact else ["body", "messages"]


def check_context(call: ChatCall, context: int | None) -> None:
    """422 for a cap no engine of the pool can give: prompt and completion share its context
    (vLLM refuses it with a 400; better refused here, before anything is held)."""
    if context is not None and call.max_tokens is not None and call.max_tokens > context:
        raise validation_failed([{
            "loc": list(call.cap_loc), "type": "less_than_equal",
            "msg": f"Input should be less than or equal to {context}, the model's context "
                   f"length (prompt and completion together)",
        }])


def engine_priority(ctx: Ctx, backend: Backend) -> int | None:
    """The tier's priority for an engine that schedules by it (vLLM: lower runs earlier)."""
    if not backend.spec.priority_scheduling or ctx.ticket is None:
        return None
    return -ctx.ticket.priority


def engine_session(backend: Backend, prompt: Prompt | None) -> str | None:
    """The prompt's name for an engine that reports which session stored each KV block."""
    if backend.kv is None or prompt is None or not prompt.blocks:
        return None
    return session_of(prompt)


def affinity(pool: Pool, call: ChatCall, headers: Mapping[str, str]) -> Prompt | None:
    """The prompt's blocks, for a "prefix" pool to match (hashed only where it is used)."""
    if pool.index is None:
        return None
    return prompt_of(call.openai_body, headers.get(SESSION_HEADER))


async def forward(request: web.Request, ctx: Ctx, style: ChatStyle, call: ChatCall, cap: int,
                  pool: Pool, mode: str, task_id: str, headers: Mapping[str, str],
                  result: Result, early: Early | None = None) -> web.StreamResponse:
    """Call a backend of `pool` and send its answer in the client's style (with `headers`):
    a stream relayed as it comes, or a whole answer rendered; `result` learns what went out.
    One retry on another backend for a failure before the client's first byte."""
    upstream_headers = {
        "Content-Type": "application/json",
        "Accept": "text/event-stream" if call.stream else "application/json",
        "X-Request-Id": ctx.request_id,
    }

    prompt = early.prompt if early is not None else affinity(pool, call, ctx.client_headers)

    def body_for(backend: Backend) -> bytes:
        return wire.upstream_body(call.openai_body, call.stream, backend.spec.kind, cap,
                                  engine_priority(ctx, backend), engine_session(backend, prompt))

    served: list[Backend] = []

    async def relay(backend: Backend, upstream: http1.Response) -> web.StreamResponse:
        served.append(backend)
        trace = request[TRACE]
        capture = trace.spans is not None and trace.spans.capture
        if capture:
            trace.prompt = orjson.dumps(call.openai_body.get("messages"))
        if call.stream:
            chunks = wire.ChunkFilter(backend.spec.kind, call.model, call.want_usage, capture)
            trace.finish_reasons, trace.answer = chunks.reasons, chunks.text
            return await relay_stream(request, upstream, chunks, style.encoder(call, task_id),
                                      headers, result, max_s=ctx.upstreams.settings.max_stream_s)
        completion = wire.fix_response(await read_completion(upstream), backend.spec.kind,
                                       call.model)
        if trace.spans is not None:  # only a trace reads them
            trace.finish_reasons = wire.finish_reasons(completion)
        if capture:
            trace.answer = wire.first_text(completion)
        body = orjson.dumps(style.response(completion, call, task_id, mode))  # may refuse: 502
        result.answered(usage=completion.get("usage"))
        return await send_whole(request, web.Response(
            body=body, content_type="application/json", headers=headers), result)

    response = await ctx.upstreams.call(pool, CHAT_UPSTREAM_PATH, body_for, upstream_headers,
                                        ctx.client_headers, relay, prompt, ctx.ticket, early)
    if prompt is not None and pool.index is not None and served:
        # The engine's count of the prompt, and (vLLM with --enable-prompt-tokens-details)
        # what it found cached: the index's picture follows both.
        reported = result.tally.usage if result.tally else result.usage
        usage = usage_from(reported)
        if usage is not None:
            pool.index.learn(prompt.chars, usage.prompt_tokens)
            if isinstance(reported, dict) and "prompt_tokens_details" in reported:
                pool.index.confirm(served[-1].name, prompt, usage.cached_tokens)
    return response


async def complete(ctx: Ctx, style: ChatStyle, call: ChatCall, cap: int, pool: Pool, mode: str,
                   task_id: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A whole chat answer without a client connection (an async task): the body rendered in
    the style, and the upstream's usage."""
    completion = await fetch_completion(ctx, call, cap, pool)
    return style.response(completion, call, task_id, mode), completion.get("usage")


async def fetch_completion(ctx: Ctx, call: ChatCall, cap: int, pool: Pool,
                           seed: int | None = None) -> dict[str, Any]:
    """One whole completion from `pool` as OpenAI shapes it (the backend's dialect fixed);
    `seed` sent unless the client set one (network mode's replicas must sample alike)."""
    body = call.openai_body if seed is None or "seed" in call.openai_body else {
        **call.openai_body, "seed": seed}
    headers = {"Content-Type": "application/json", "Accept": "application/json",
               "X-Request-Id": ctx.request_id}

    prompt = affinity(pool, call, ctx.client_headers)

    async def use(backend: Backend, upstream: http1.Response) -> dict[str, Any]:
        return wire.fix_response(await read_completion(upstream), backend.spec.kind,
                                 call.model)

    return await ctx.upstreams.call(
        pool, CHAT_UPSTREAM_PATH,
        lambda backend: wire.upstream_body(body, False, backend.spec.kind, cap,
                                           engine_priority(ctx, backend),
                                           engine_session(backend, prompt)), headers,
        ctx.client_headers, use, prompt, ctx.ticket, ctx.early)


async def read_completion(upstream: http1.Response) -> dict[str, Any]:
    raw = await read_answer(upstream, COMPLETION_MAX_BYTES)
    try:
        completion = orjson.loads(raw)
    except orjson.JSONDecodeError:
        completion = None
    if not isinstance(completion, dict) or "error" in completion:
        raise GatewayError(ErrorKind.UPSTREAM_ERROR, "the model server sent an unusable answer")
    return completion


"""Hugging Face TGI router simulator (protocols.md §2, v3.3.x wire format).

Quirks kept on purpose: `data:` without a space, no `[DONE]` on `/generate_stream`, stream
errors in-band with HTTP 200, the prompt-token count only in `x-prompt-tokens`, 429 when more
than `max_concurrency` (`--max-concurrent-requests`) requests are in flight, counters without
`_total`. Beyond `--max-batch-size` running, or once the running batch's token budgets
(prompt plus max new tokens each) would pass the cache's, requests wait in the queue
(`tgi_queue_size`); `x-queue-time` says how long. Differences: a request without
`max_new_tokens` reserves what it will generate, where TGI reserves up to `max_total_tokens`;
the prefix cache (TGI 3 has one) is the vLLM simulator's, block hashes and all.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import orjson
from aiohttp import web

from proxy.simulators.bodies import json_object, json_response, opt
from proxy.simulators.errors import BadRequest, HttpError
from proxy.simulators.exchange import EventWriter, Exchange
from proxy.simulators.faults import error_response
from proxy.simulators.openai_chat import Dialect, chat_handler, error_payloads, no_usage_extra
from proxy.simulators.runtime import inference
from proxy.simulators.state import STATE
from proxy.simulators.textgen import (
    EOS,
    LENGTH,
    STOP_SEQUENCE,
    TOOL_CALLS,
    Generation,
    generate,
    prompt_key,
    text_tokens,
    token_id,
    token_logprob,
    top_alternatives,
)

VERSION = "3.3.7"
COMPUTE_TYPE = "gpu+optimized"
MAX_STOP_SEQUENCES = 4
MAX_TOP_N_TOKENS = 5
GENERATION_FAILURE = (
    424,
    "Request failed during generation: Server error: simulated",
    "generation",
)
# tgi_request_failure{err=...} labels for our recorded failure kinds
_FAILURE_LABELS = {
    "tool_error": "validation",
    "template_error": "template",
    "missing_template_variable": "template",
    "incomplete_generation": "incomplete",
}
_LABELS = ("validation", "overloaded", "generation", "incomplete", "dropped", "template")


def _headers(ex: Exchange, generated: int | None) -> Mapping[str, str]:
    """TGI's response headers; streams only know the compute type up front."""
    chars = str(ex.prompt_chars)
    if generated is None:
        return {
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            "x-compute-type": COMPUTE_TYPE,
            "x-compute-characters": chars,
        }
    total_ms = int((time.monotonic() - ex.started) * 1000)
    queue_ms = min(int(ex.queue_s * 1000), total_ms)
    inference_ms = total_ms - queue_ms
    return {
        "x-compute-type": COMPUTE_TYPE,
        "x-compute-time": f"{total_ms / 1000:.3f}",
        "x-compute-characters": chars,
        "x-total-time": str(total_ms),
        "x-validation-time": "0",
        "x-queue-time": str(queue_ms),
        "x-inference-time": str(inference_ms),
        "x-time-per-token": str(inference_ms // max(generated, 1)),
        "x-prompt-tokens": str(ex.prompt_tokens),
        "x-generated-tokens": str(generated),
    }


TGI_CHAT = Dialect(
    kind="tgi",
    sse_prefix=b"data:",
    strict_model=False,
    fixed_id="",
    system_fingerprint=f"{VERSION}-native",
    role_chunk=False,
    role_in_deltas=True,
    finish_chunk=frozenset(),
    finish_names={
        EOS: "stop",
        STOP_SEQUENCE: "stop_sequence",
        LENGTH: "length",
        TOOL_CALLS: "stop",
    },
    stop_reason=False,
    null_usage_in_chunks=True,
    logprob_bytes=False,
    reasoning=False,
    tool_call_id=lambda: "0",
    tool_meta_every_fragment=True,
    tool_content_null=False,
    tool_function_extra={"description": None},
    message_extra={},
    response_extra={},
    usage_extra=no_usage_extra,
    tools_exclude_response_format=True,
    generation_failure=GENERATION_FAILURE,
    # after the stream started TGI hard-codes 422, whatever the error was
    error_events=error_payloads(lambda m, _t: {"error": {"message": m, "http_status_code": 422}}),
    headers=_headers,
)


class GenerateRequest(NamedTuple):
    inputs: str
    max_new_tokens: int | None
    stop: tuple[str, ...]
    seed: int | None
    details: bool
    top_n_tokens: int
    return_full_text: bool
    stream: bool  # only read by the compat route `POST /`


def parse_generate(raw: bytes) -> GenerateRequest:
    """Types first (axum: plain-text 422), then TGI's own validation (JSON 422)."""
    body = json_object(raw)
    inputs = body.get("inputs")
    if not isinstance(inputs, str):
        raise BadRequest("missing field `inputs` or not a string", "type")
    params = opt(body, "parameters", dict) or {}
    stop = opt(params, "stop", list) or []
    if not all(isinstance(s, str) for s in stop):
        raise BadRequest("parameters.stop: expected an array of strings", "type")
    request = GenerateRequest(
        inputs=inputs,
        max_new_tokens=opt(params, "max_new_tokens", int),
        stop=tuple(stop),
        seed=opt(params, "seed", int),
        details=bool(opt(params, "details", bool)),
        top_n_tokens=opt(params, "top_n_tokens", int) or 0,
        return_full_text=bool(opt(params, "return_full_text", bool)),
        stream=bool(opt(body, "stream", bool)),
    )
    temperature = params.get("temperature")
    if not inputs:
        raise BadRequest("`inputs` cannot be empty", "value")
    if request.max_new_tokens is not None and request.max_new_tokens < 1:
        raise BadRequest("`max_new_tokens` must be strictly positive", "value")
    if isinstance(temperature, int | float) and temperature <= 0:
        raise BadRequest("`temperature` must be strictly positive", "value")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise BadRequest(
            f"`stop` supports up to {MAX_STOP_SEQUENCES} stop sequences. Given: {len(stop)}",
            "value",
        )
    if not 0 <= request.top_n_tokens <= MAX_TOP_N_TOKENS:
        raise BadRequest(f"`top_n_tokens` must be <= {MAX_TOP_N_TOKENS}", "value")
    return request


def _token(text: str, special: bool = False) -> dict[str, Any]:
    return {"id": token_id(text), "text": text, "logprob": token_logprob(text), "special": special}


def _top(text: str, n: int) -> list[dict[str, Any]]:
    return [
        {"id": token_id(t), "text": t, "logprob": lp, "special": False}
        for t, lp in top_alternatives(text, n)
    ]


def _generate(ex: Exchange, req: GenerateRequest) -> Generation:
    model = ex.config.models[0]
    ex.model = model
    ex.prompt = text_tokens(req.inputs)
    ex.prompt_tokens = len(ex.prompt)
    ex.prompt_chars = len(req.inputs)
    ex.token_cap = req.max_new_tokens
    generation = generate(
        prompt_key(model, req.inputs),
        req.seed or 0,
        natural=ex.natural_tokens,
        limit=req.max_new_tokens,
        stop=req.stop,
    )
    ex.generations = [generation]
    return generation


def _not_json(ex: Exchange) -> web.Response | None:
    """axum's `Json` extractor: plain-text 415 unless the content type is JSON."""
    ctype = ex.request.content_type
    if ctype == "application/json" or ctype.endswith("+json"):
        return None
    return web.Response(status=415, text="Expected request with `Content-Type: application/json`")


async def _generate_json(ex: Exchange, req: GenerateRequest) -> dict[str, Any]:
    g = _generate(ex, req)
    if not await ex.admit():
        raise HttpError(429, "Model is overloaded", "overloaded")
    if ex.config.fail_generation:
        raise HttpError(*GENERATION_FAILURE)
    await ex.pacer().whole(len(g.tokens))
    body: dict[str, Any] = {"generated_text": (req.inputs if req.return_full_text else "") + g.text}
    if req.details:
        details: dict[str, Any] = {
            "finish_reason": g.finish,
            "generated_tokens": len(g.tokens),
            "seed": req.seed,
            "prefill": [],
            "tokens": [_token(t) for t in g.tokens],
        }
        if req.top_n_tokens:
            details["top_tokens"] = [_top(t, req.top_n_tokens) for t in g.tokens]
        body["details"] = details
    return body


def _stream_error(message: str, error_type: str) -> list[bytes]:
    return [orjson.dumps({"error": message, "error_type": error_type})]


async def _generate_stream(ex: Exchange, raw: bytes) -> web.StreamResponse:
    req: GenerateRequest | None = None
    invalid = ""
    try:
        req = parse_generate(raw)
    except BadRequest as exc:
        if exc.level != "value":
            raise
        invalid = f"Input validation error: {exc}"
    ex.prompt_chars = len(req.inputs) if req else 0
    writer = EventWriter(ex, b"data:", _stream_error)
    await writer.open(_headers(ex, None))
    if req is None:  # TGI validates inside the stream: the error is in-band, status 200
        await writer.fail(invalid, "validation")
    g = _generate(ex, req)
    if not await ex.admit():
        await writer.fail("Model is overloaded", "overloaded")
    if ex.config.fail_generation:
        await writer.fail(GENERATION_FAILURE[1], GENERATION_FAILURE[2])
    tokens = [_token(t) for t in g.tokens] or [_token("</s>", special=True)]
    pacer = ex.pacer()
    for index, token in enumerate(tokens, 1):
        await pacer.step()
        event: dict[str, Any] = {"index": index, "token": token}
        if req.top_n_tokens:
            event["top_tokens"] = _top(token["text"], req.top_n_tokens)
        event["generated_text"] = event["details"] = None
        if index == len(tokens):
            prefix = req.inputs if req.return_full_text else ""
            event["generated_text"] = prefix + g.text
            if req.details:
                event["details"] = {
                    "finish_reason": g.finish,
                    "generated_tokens": len(g.tokens),
                    "seed": req.seed,
                    "input_length": ex.prompt_tokens,
                }
        await writer.send(orjson.dumps(event))
    return writer.response  # no [DONE]: the connection just ends


async def generate_route(ex: Exchange) -> web.StreamResponse:
    if rejected := _not_json(ex):
        return rejected
    body = await _generate_json(ex, parse_generate(ex.record.body))
    return json_response(body, headers=_headers(ex, len(ex.generations[0].tokens)))


async def generate_stream_route(ex: Exchange) -> web.StreamResponse:
    return _not_json(ex) or await _generate_stream(ex, ex.record.body)


async def compat_route(ex: Exchange) -> web.StreamResponse:
    """`POST /`: switches on `stream`; the non-stream answer is a one-element array."""
    if rejected := _not_json(ex):
        return rejected
    if json_object(ex.record.body).get("stream") is True:
        return await _generate_stream(ex, ex.record.body)
    body = await _generate_json(ex, parse_generate(ex.record.body))
    return json_response([body], headers=_headers(ex, len(ex.generations[0].tokens)))


_chat = chat_handler(TGI_CHAT)


async def chat_route(ex: Exchange) -> web.StreamResponse:
    return _not_json(ex) or await _chat(ex)


async def health(request: web.Request) -> web.Response:
    if request.app[STATE].healthy:
        return web.Response()
    return error_response("tgi", 503, "unhealthy", "healthcheck")


async def info(request: web.Request) -> web.Response:
    config = request.app[STATE].config
    return json_response(
        {
            "model_id": config.models[0],
            "model_sha": "0e9e39f2",
            "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": config.max_concurrency,
            "max_best_of": 2,
            "max_stop_sequences": MAX_STOP_SEQUENCES,
            "max_input_tokens": 8191,
            "max_total_tokens": 8192,
            "validation_workers": 2,
            "max_client_batch_size": 4,
            "router": "text-generation-router",
            "version": VERSION,
            "sha": None,
            "docker_label": None,
        }
    )


async def models(request: web.Request) -> web.Response:
    model = request.app[STATE].config.models[0]
    return json_response(
        {
            "object": "list",
            "data": [{"id": model, "object": "model", "created": 0, "owned_by": model}],
        }
    )


async def metrics(request: web.Request) -> web.Response:
    """metrics-rs exposition: counters keep their bare names (no `_total`)."""
    state = request.app[STATE]
    engine = state.engine
    failures: dict[str, int] = dict.fromkeys(_LABELS, 0)
    for kind, count in state.failures.items():
        label = _FAILURE_LABELS.get(kind, kind)
        failures[label if label in failures else "generation"] += count
    lines = [
        "# TYPE tgi_request_count counter",
        f"tgi_request_count {state.requests}",
        "# TYPE tgi_request_success counter",
        f"tgi_request_success {state.successes}",
        "# TYPE tgi_request_failure counter",
        *(f'tgi_request_failure{{err="{label}"}} {n}' for label, n in failures.items()),
        "# TYPE tgi_queue_size gauge",
        f"tgi_queue_size {state.waiting}",
        "# TYPE tgi_batch_current_size gauge",
        f"tgi_batch_current_size {state.running}",
        "# TYPE tgi_batch_current_max_tokens gauge",
        f"tgi_batch_current_max_tokens {engine.reserved_tokens()}",
        "# TYPE tgi_batch_max_total_tokens gauge",
        f"tgi_batch_max_total_tokens {engine.capacity_tokens}",
    ]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/generate", inference(generate_route))
    app.router.add_post("/generate_stream", inference(generate_stream_route))
    app.router.add_post("/", inference(compat_route))
    app.router.add_post("/v1/chat/completions", inference(chat_route))
    for path in ("/health", "/ping", "/"):
        app.router.add_get(path, health)
    app.router.add_get("/info", info)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)

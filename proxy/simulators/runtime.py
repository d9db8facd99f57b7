"""Per-app state and the request lifecycle shared by every simulator.

Every inference route runs through `inference()`: it records the request for
`/_sim/requests`, applies the `x-sim-*` faults, renders errors in the server's own envelope
and turns a client disconnect into the "cancelled" outcome. Handlers only generate.
Media routes opt into form parsing (`form=True`: multipart uploads, recorded as their fields
and file sizes, never the raw bytes) and into an error envelope of their own (`errors=`).
"""

from __future__ import annotations

import asyncio
import gzip
import math
import time
import urllib.parse
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal, NoReturn, TypeVar

import orjson
from aiohttp import BodyPartReader, hdrs, web
from aiohttp.http_exceptions import HttpProcessingError

from proxy.simulators.engine import Latencies
from proxy.simulators.faults import (
    NO_FAULTS,
    ClientGone,
    FaultHeaderError,
    Faults,
    StreamEnded,
    before_event,
    before_response,
    error_response,
    pause,
    tgi_error_type,
)
from proxy.simulators.scheduler import Scheduler, Seq
from proxy.simulators.textgen import LENGTH, Generation

RECORDS_KEPT = 1000
T = TypeVar("T")
# What vLLM answers (500, and as the in-band error of live streams) once its EngineCore died.
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
ENGINE_DEAD_TYPE = "InternalServerError"


@dataclass(frozen=True)
class SimConfig:
    models: tuple[str, ...]
    ttft_ms: float = 0.0
    tokens_per_s: float = 0.0  # 0: no pacing, tokens as fast as the socket takes them
    # TGI --max-concurrent-requests: 429 beyond it; vLLM --max-num-seqs: its running batch.
    max_concurrency: int = 128
    max_batch_size: int | None = None  # TGI's running batch; None: max_concurrency (no queue)
    startup_delay_s: float = 0.0
    fail_generation: bool = False  # /health stays OK while every generation fails
    default_completion_tokens: int = 16
    # vLLM's engine options (`simulate vllm --max-model-len ...`).
    max_model_len: int = 32768  # the context: prompt + completion
    max_queued: int | None = None  # --max-num-queued-reqs: in flight beyond it -> 503
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details (cached tokens)
    block_size: int = 16  # KV-cache block: prompts share a cached beginning in whole blocks
    # KV-cache capacity in blocks (vLLM's num_gpu_blocks): with 16-token blocks, the 1,048,576
    # tokens of the captured vLLM's cache; so much that only a pool meant to fill it does.
    kv_cache_blocks: int = 65536
    prefill_ms_per_1k_tokens: float = 0.0  # prefill cost of the prompt tokens not cached
    speed: float = 1.0  # divides every latency: 0.33 is a replica three times slower
    death_close_s: float = 3.0  # after an engine death the port closes within this long
    # Media kinds (`simulate tts|whisper|image|video`); the chat kinds ignore these.
    voices: tuple[str, ...] = ()  # tts: accepted voices; () = the default list
    sample_rate: int = 24000  # tts: output rate (22050 emulates Piper)
    word_timestamps: bool = False  # whisper: honour timestamp_granularities[]=word (vLLM won't)
    whisper_cpp_errors_200: bool = False  # whisper /inference: errors with HTTP 200 (<= v1.8)

    @property
    def batch_size(self) -> int:
        return self.max_batch_size or self.max_concurrency

    @property
    def ttft_s(self) -> float:
        """`ttft_ms` at this replica's speed (the media kinds' processing time)."""
        return self.ttft_ms / 1000 / self.speed

    @property
    def token_interval_s(self) -> float:
        return 1 / (self.tokens_per_s * self.speed) if self.tokens_per_s > 0 else 0.0

    @property
    def prefill_s_per_token(self) -> float:
        return self.prefill_ms_per_1k_tokens / 1_000_000 / self.speed


@dataclass(frozen=True, slots=True)
class FormField:
    """One field of a form body; repeated names (`timestamp_granularities[]`) stay separate."""

    name: str
    value: str | bytes
    filename: str | None = None
    content_type: str | None = None

    @property
    def is_file(self) -> bool:
        # As Starlette decides: a part with a filename is an upload, and so is a part whose
        # bytes are not text (aiohttp keeps those as bytes).
        return self.filename is not None or isinstance(self.value, bytes)


def form_summary(fields: Sequence[FormField]) -> dict[str, object]:
    """What `/_sim/requests` shows of a form: text fields, and each file's name, type and size.

    A name ending in `[]` always maps to a list; other repeated names become lists too.
    """
    out: dict[str, object] = {}
    for field in fields:
        value: object = field.value
        if field.is_file:
            value = {"filename": field.filename, "content_type": field.content_type,
                     "size": len(field.value)}
        if field.name in out:
            seen = out[field.name]
            out[field.name] = [*seen, value] if isinstance(seen, list) else [seen, value]
        else:
            out[field.name] = [value] if field.name.endswith("[]") else value
    return out


class Record:
    """One inference request as `/_sim/requests` shows it; the body is parsed only on read."""

    __slots__ = ("body", "form", "headers", "outcome", "path")

    def __init__(self, path: str, headers: Mapping[str, str]) -> None:
        self.path = path
        self.headers = headers
        self.body = b""
        self.form: dict[str, object] | None = None  # form bodies: summarised when read
        self.outcome: str | None = None  # null while in flight

    def as_json(self) -> dict[str, object]:
        body: object = self.form
        if body is None:
            try:
                body = orjson.loads(self.body) if self.body else None
            except orjson.JSONDecodeError:
                body = None
        headers = {name.lower(): value for name, value in self.headers.items()}
        return {"path": self.path, "headers": headers, "body": body, "outcome": self.outcome}


class SimState:
    """Counters and the request log of one simulated server."""

    def __init__(self, kind: str, config: SimConfig) -> None:
        self.kind = kind
        self.config = config
        self.healthy = True
        self.records: deque[Record] = deque(maxlen=RECORDS_KEPT)
        self.in_flight = self.total = self.cancelled = 0
        self.requests = 0  # like `total`, but never reset: Prometheus counters only grow
        self.successes = 0
        self.failures: Counter[str] = Counter()  # TGI error_type, "dropped" or "incomplete"
        self.finished: Counter[tuple[str, str]] = Counter()  # (model, stop|length|abort)
        self.prompt_tokens: Counter[str] = Counter()
        self.generation_tokens: Counter[str] = Counter()
        self.rejected = 0  # vLLM admission rejections (queue full)
        self.engine = Scheduler(config, reserve_whole=kind == "tgi")
        self.latency = Latencies()
        # The engine died (vLLM: its EngineCore); then the port closes, as the server exits.
        self.dead = False
        # Stops listening (set by whoever runs the app: the CLI exits, a test stops its site).
        self.close_port: Callable[[], Awaitable[None]] | None = None
        self._closing: asyncio.Task[None] | None = None
        self._close_at = math.inf

    @property
    def running(self) -> int:
        return len(self.engine.running)

    @property
    def waiting(self) -> int:
        return len(self.engine.waiting)

    @property
    def full(self) -> bool:
        """vLLM's admission control: in flight (running and waiting) at --max-num-queued-reqs."""
        limit = self.config.max_queued
        return limit is not None and self.engine.in_flight >= limit

    def die(self) -> None:
        """The engine is gone: /health 503, requests 500, live streams end with an error
        event, and the port closes after `death_close_s` or at the first request that meets the
        dead engine (vLLM's API server shuts down from its error handler)."""
        self.dead = True
        self.healthy = False
        self.close_soon(self.config.death_close_s)

    def close_soon(self, delay_s: float) -> None:
        """Close the port in `delay_s` (or sooner, if a close is already due sooner)."""
        loop = asyncio.get_running_loop()
        at = loop.time() + delay_s
        if self._closing is not None:
            if self._closing.done() or self._close_at <= at:
                return
            self._closing.cancel()
        self._close_at = at
        self._closing = loop.create_task(self._close(delay_s))

    async def _close(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if self.close_port is not None:
            await self.close_port()

    def reset(self) -> None:
        self.records.clear()
        self.total = self.cancelled = 0


STATE = web.AppKey("sim_state", SimState)


class HttpError(Exception):
    """Answered with the server's own JSON error envelope (`code`: OpenAI's string code)."""

    def __init__(self, status: int, message: str, error_type: str | None = None,
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.error_type = status, message, error_type
        self.param, self.code = param, code


# A route's own error envelope; routes without one get their kind's (faults.error_response).
ErrorStyle = Callable[[HttpError], web.Response]


def _simulated(status: int) -> HttpError:
    """The error an `x-sim-status` asks for, worded as faults.error_response words it."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return HttpError(status, f"simulated {status} {phrase}".rstrip())


class BadRequest(Exception):
    """Invalid request. `level`: unparsable JSON, wrong JSON types, or bad values.

    TGI rejects the first two in axum with plain text (400 / 422) and bad values with a
    JSON 422 `validation` error; vLLM answers 400 `BadRequestError` for all three.
    """

    def __init__(self, message: str, level: Literal["syntax", "type", "value"],
                 param: str | None = None, value: object = None) -> None:
        super().__init__(message)
        self.message, self.level = message, level
        self.param, self.value = param, value


def bad_request_response(kind: str, exc: BadRequest) -> web.Response:
    if kind != "tgi":
        if exc.param is None:
            return error_response(kind, 400, exc.message)
        # vLLM's VLLMValidationError names the parameter and its value.
        return error_response(kind, 400, f"{exc.message} (parameter={exc.param}, "
                              f"value={exc.value})", param=exc.param)
    if exc.level == "syntax":
        return web.Response(status=400, text=f"Failed to parse the request body as JSON: {exc}")
    if exc.level == "type":
        text = f"Failed to deserialize the JSON body into the target type: {exc}"
        return web.Response(status=422, text=text)
    return error_response(kind, 422, f"Input validation error: {exc}", "validation")


async def read_form(request: web.Request) -> list[FormField]:
    """The body's form fields in order: multipart parts or urlencoded pairs; none otherwise.

    Multipart parts are read into memory under the app's `client_max_size`, as
    `request.post()` would cap them, but without its temporary files.
    """
    limit = request.client_max_size
    if request.content_type == "application/x-www-form-urlencoded":
        text = (await request.read()).decode("utf-8", "replace")
        return [FormField(k, v) for k, v in urllib.parse.parse_qsl(text, keep_blank_values=True)]
    if request.content_type != "multipart/form-data":
        await request.read()  # e.g. a JSON body: no form fields, but drain it
        return []
    try:
        return await _read_multipart(request, limit)
    except (ValueError, KeyError, HttpProcessingError):
        # Starlette's words for a body its multipart parser rejects.
        raise HttpError(400, "There was an error parsing the body") from None


async def _read_multipart(request: web.Request, limit: int) -> list[FormField]:
    fields: list[FormField] = []
    total = 0
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):
            continue  # a nested multipart: no server we imitate reads those
        chunks = []
        while chunk := await part.read_chunk():
            total += len(chunk)
            if total > limit:
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=total)
            chunks.append(chunk)
        data = b"".join(chunks)
        ctype = part.headers.get(hdrs.CONTENT_TYPE)
        value: str | bytes = data
        if part.filename is None and (ctype is None or ctype.startswith("text/")):
            value = data.decode(part.get_charset("utf-8"), "replace")
        fields.append(FormField(part.name or "", value, part.filename, ctype))
    return fields


def json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(str(exc), "syntax") from None
    if not isinstance(body, dict):
        raise BadRequest("expected a JSON object", "type")
    return body


def opt(body: Mapping[str, Any], key: str, kind: type[T]) -> T | None:
    """`body[key]` if present and of type `kind` (null counts as absent); bools are not ints."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    raise BadRequest(f"{key}: invalid type, expected {kind.__name__}", "type")


def json_response(
    data: object, *, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=status, body=orjson.dumps(data), content_type="application/json", headers=headers
    )


class Exchange:
    """One inference request moving through a simulator."""

    def __init__(self, request: web.Request, state: SimState) -> None:
        self.request = request
        self.state = state
        self.config = state.config
        self.record = Record(request.path, request.headers)
        self.faults = NO_FAULTS
        self.outcome: str | None = None
        self.error_type: str | None = None
        self.stream: web.StreamResponse | None = None
        self.started = time.monotonic()
        self.first_token: float | None = None
        self.model = ""
        self.prompt: Sequence[str] = ()  # the prompt's tokens, for the prefix cache
        self.prompt_tokens = 0
        self.prompt_chars = 0  # TGI's x-compute-characters
        self.token_cap: int | None = None  # the request's max new tokens, if it set one
        self.cached_tokens = 0  # vLLM: prompt tokens found in the prefix cache ...
        self.created_cache_tokens = 0  # ... and written to it
        self.generations: list[Generation] = []
        self.seq: Seq | None = None  # set once the engine scheduled it
        self.scheduled: float | None = None  # time.monotonic() then
        self.fields: list[FormField] = []  # form routes: the parsed body
        self.errors: ErrorStyle | None = None  # the route's own envelope, if not the kind's

    @property
    def natural_tokens(self) -> int:
        tokens = self.faults.tokens
        return self.config.default_completion_tokens if tokens is None else tokens

    @property
    def queue_s(self) -> float:
        """Seconds it waited for the engine to schedule it."""
        return (self.scheduled or self.started) - self.started

    async def admit(self) -> bool:
        """Wait until the engine schedules this request (its generations already drawn).
        TGI refuses instead (False: overloaded) once `max_concurrency` requests are in."""
        engine = self.state.engine
        if self.state.kind != "vllm" and engine.in_flight >= engine.max_in_flight:
            return False
        seq = engine.sequence(self.prompt, [g.completion_tokens for g in self.generations],
                              self.token_cap)
        await engine.admit(seq)
        self.seq, self.scheduled = seq, time.monotonic()
        self.cached_tokens, self.created_cache_tokens = seq.cached_tokens, seq.created_tokens
        return True

    def pacer(self) -> Pacer:
        assert self.seq is not None, "tokens are paced once the engine scheduled the request"
        return Pacer(self.request, self.seq.first_token, self.seq.interval)


class Pacer:
    """Token timing: the first token when the scheduler said (queue, prefill, `ttft_ms`),
    then one every `interval` seconds."""

    def __init__(self, request: web.BaseRequest, first_token: float, interval: float) -> None:
        self._request = request
        self._loop = asyncio.get_running_loop()
        self._due = first_token
        self._interval = interval
        # The benchmark setting: no pacing at all, not even a zero sleep.
        self._instant = interval == 0 and first_token <= self._loop.time()

    async def step(self) -> None:
        """Wait until the next token is due."""
        if self._instant:
            return
        delay = self._due - self._loop.time()
        self._due += self._interval
        if delay > 0:
            await pause(self._request, delay)

    async def whole(self, tokens: int) -> None:
        """Non-stream: wait until `tokens` tokens would have been generated."""
        self._due += max(tokens - 1, 0) * self._interval
        await self.step()


ErrorEvents = Callable[[str, str], Sequence[bytes]]  # (message, error_type) -> SSE payloads


class EventWriter:
    """Writes SSE events in one dialect's framing, applying the stream faults."""

    def __init__(self, ex: Exchange, prefix: bytes, error_events: ErrorEvents) -> None:
        self._ex = ex
        self._prefix = prefix
        self._error_events = error_events
        self._response = web.StreamResponse()
        self.sent = 0

    @property
    def response(self) -> web.StreamResponse:
        return self._response

    async def open(self, headers: Mapping[str, str]) -> None:
        self._response.headers.update(headers)
        self._ex.stream = self._response
        await self._response.prepare(self._ex.request)

    async def send(self, payload: bytes) -> None:
        ex = self._ex
        if await before_event(ex.request, ex.faults, self.sent):
            await self.fail(f"simulated error after {self.sent} events", "generation")
        if ex.state.dead:
            await self.fail(ENGINE_DEAD, ENGINE_DEAD_TYPE)
        await self._response.write(self._prefix + payload + b"\n\n")
        if ex.first_token is None:
            ex.first_token = time.monotonic()
        self.sent += 1

    async def fail(self, message: str, error_type: str) -> NoReturn:
        """Emit the server's in-band error event(s) and end the stream."""
        for payload in self._error_events(message, error_type):
            await self._response.write(self._prefix + payload + b"\n\n")
        self._ex.error_type = error_type
        raise StreamEnded("error")


Handler = Callable[[Exchange], Awaitable[web.StreamResponse]]


def inference(
    handler: Handler, *, form: bool = False, errors: ErrorStyle | None = None
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Wrap an inference handler with recording, faults, error rendering and accounting.

    `form`: parse the body as a form into `Exchange.fields` (recorded as a summary);
    `errors`: render this route's errors (faults included) in its own envelope.
    """

    async def route(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        ex = Exchange(request, state)
        ex.errors = errors
        if form:
            ex.record.form = {}  # a form route never shows raw bytes, even before parsing
        state.records.append(ex.record)
        state.in_flight += 1
        state.total += 1
        state.requests += 1
        try:
            return await _run(ex, handler, form)
        except asyncio.CancelledError:
            ex.outcome = "cancelled"
            raise
        finally:
            _settle(state, ex)

    return route


async def _run(ex: Exchange, handler: Handler, form: bool) -> web.StreamResponse:
    kind = ex.state.kind
    try:
        if form:
            ex.fields = await read_form(ex.request)
            ex.record.form = form_summary(ex.fields)
        else:
            ex.record.body = await ex.request.read()
        if ex.state.dead:
            ex.state.close_soon(0)  # vLLM's error handler shuts its server down
            raise HttpError(500, ENGINE_DEAD, ENGINE_DEAD_TYPE)
        ex.faults = Faults.of(ex.request)
        forced = await before_response(ex.request, ex.faults, kind)
        if forced is not None and ex.errors is not None:
            styled = ex.errors(_simulated(forced.status))  # x-sim-status, this route's way
            if (retry := forced.headers.get(hdrs.RETRY_AFTER)) is not None:
                styled.headers[hdrs.RETRY_AFTER] = retry
            forced = styled
        response = forced or await handler(ex)
        if not response.prepared and ex.faults.hang_after == 0:
            await pause(ex.request, math.inf)
    except FaultHeaderError as exc:
        response = web.Response(status=400, text=str(exc))
    except BadRequest as exc:
        if ex.errors is None:
            response = bad_request_response(kind, exc)
        else:
            response = ex.errors(HttpError(400, exc.message, param=exc.param))
    except HttpError as exc:
        ex.error_type = exc.error_type
        if ex.errors is None:
            response = error_response(kind, exc.status, exc.message, exc.error_type, exc.param)
        else:
            response = ex.errors(exc)
    except StreamEnded as end:
        ex.outcome = end.outcome
        return ex.stream or web.Response()
    except (ClientGone, ConnectionError):
        ex.outcome = "cancelled"
        return ex.stream or web.Response()
    if ex.faults.gzip and isinstance(response, web.Response) and not response.prepared:
        assert isinstance(response.body, bytes)
        response.body = gzip.compress(response.body, compresslevel=1)
        response.headers["Content-Encoding"] = "gzip"
    if response.status >= 400:
        ex.outcome = "error"
        ex.error_type = ex.error_type or tgi_error_type(response.status)
    else:
        ex.outcome = "completed"
    return response


def _settle(state: SimState, ex: Exchange) -> None:
    outcome = ex.record.outcome = ex.outcome or "error"
    state.in_flight -= 1
    if ex.seq is not None:
        state.engine.release(ex.seq)
    if outcome == "completed":
        now = time.monotonic()
        state.latency.e2e.observe(now - ex.started)
        state.latency.ttft.observe((ex.first_token or now) - ex.started)
        state.successes += 1
        state.prompt_tokens[ex.model] += ex.prompt_tokens
        for generation in ex.generations:
            reason = "length" if generation.finish == LENGTH else "stop"
            state.finished[ex.model, reason] += 1
            state.generation_tokens[ex.model] += generation.completion_tokens
    elif outcome == "cancelled":
        state.cancelled += 1
        state.failures["dropped"] += 1
        if ex.model:
            state.finished[ex.model, "abort"] += 1
    elif outcome == "cut":
        state.failures["incomplete"] += 1
    else:
        state.failures[ex.error_type or "generation"] += 1


async def _requests(request: web.Request) -> web.Response:
    return json_response([record.as_json() for record in request.app[STATE].records])


async def _stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return json_response(
        {"in_flight": state.in_flight, "total": state.total, "cancelled": state.cancelled}
    )


async def _reset(request: web.Request) -> web.Response:
    request.app[STATE].reset()
    return web.Response(status=204)


async def _health(request: web.Request) -> web.Response:
    """`{"healthy": false}` makes /health fail (the only way to see TGI's 503 body)."""
    try:
        body = json_object(await request.read()) if request.can_read_body else {}
    except BadRequest as exc:
        return web.Response(status=400, text=str(exc))
    request.app[STATE].healthy = bool(body.get("healthy", True))
    return web.Response(status=204)


async def health_status(request: web.Request) -> web.Response:
    """Media servers' /health: 200 `{"status":"ok"}` (whisper.cpp's body; a status-only probe
    of vLLM or a FastAPI facade is as happy), 503 while unhealthy (`/_sim/health`)."""
    if request.app[STATE].healthy:
        return json_response({"status": "ok"})
    return json_response({"status": "loading model"}, status=503)


def add_sim_routes(app: web.Application) -> None:
    app.router.add_get("/_sim/requests", _requests)
    app.router.add_get("/_sim/stats", _stats)
    app.router.add_post("/_sim/reset", _reset)
    app.router.add_post("/_sim/health", _health)

"""One inference request moving through a simulator (`Exchange`), its token timing (`Pacer`)
and its SSE stream (`EventWriter`, which applies the stream faults)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

from aiohttp import web

from proxy.simulators.bodies import FormField
from proxy.simulators.errors import ENGINE_DEAD, ENGINE_DEAD_TYPE, ErrorStyle
from proxy.simulators.faults import NO_FAULTS, StreamEnded, before_event, pause
from proxy.simulators.scheduler import Seq
from proxy.simulators.state import Record, SimState
from proxy.simulators.textgen import Generation


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
        self.priority = 0  # vLLM's priority scheduling: lower runs earlier
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
        seq.priority = self.priority
        await engine.admit(seq)
        self.seq, self.scheduled = seq, time.monotonic()
        self.cached_tokens, self.created_cache_tokens = seq.cached_tokens, seq.created_tokens
        return True

    async def processing(self) -> None:
        """The media kinds' processing time (`--ttft-ms` at this replica's speed)."""
        if self.config.ttft_s > 0:
            await pause(self.request, self.config.ttft_s)

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

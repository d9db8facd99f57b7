"""What one request's path learned, for its metrics and its access-log line.

The middleware opens a `Trace` per request (`request[TRACE]`) and reads it once the answer has
gone out; the steps fill in what they learn (the tier after auth, the model once it is known to
exist, the backend that answered, the first content byte's time, the settlement). The upstream
client has no request at hand, so the trace is also the context's `CURRENT` (a ContextVar is
task-local: each request's task sees its own).

With tracing on ([telemetry], proxy.observe.tracing) a request's trace also carries `spans`:
its place in its distributed trace and the stages it went through (auth, admission, the wait
for an engine slot, each upstream exchange, settlement), timed as they happen and turned into
OpenTelemetry spans only after the answer, and only if the trace is kept. Off, `spans` is None
and `stage` returns at once: the path pays a clock read per stage, nothing more.
"""

from __future__ import annotations

import random
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

# A family's work as OpenTelemetry's GenAI conventions name it (`gen_ai.operation.name`: "chat"
# and "embeddings" are theirs; the others the gateway's own words).
OPERATIONS = {"chat": "chat", "tts": "text_to_speech", "asr": "transcription",
              "image": "image_generation", "video": "video_generation", "embed": "embeddings"}


@dataclass(slots=True)
class Stage:
    """One timed step of a request (an OpenTelemetry span once exported); times are
    `time.monotonic()` seconds."""

    name: str
    start: float
    end: float
    attrs: dict[str, Any] = field(default_factory=dict)
    span_id: int = 0  # set when the id left the gateway first (an exchange's traceparent)
    client: bool = False  # a call to another server (an engine), not work of our own
    events: list[tuple[str, float]] = field(default_factory=list)  # (name, monotonic time)


@dataclass(slots=True)
class Spans:
    """A traced request's place in its trace, and its stages so far."""

    trace_id: int
    span_id: int  # the request's own (server) span
    parent_id: int | None  # the caller's span, when a trusted caller sent one
    sampled: bool  # the head decision, passed on to the engines
    tracestate: str = ""  # a trusted caller's, passed on as it came
    stages: list[Stage] = field(default_factory=list)
    links: list[tuple[int, int]] = field(default_factory=list)  # (trace id, span id)
    kept: bool = False  # exported (proxy.observe.tracing): logs and exemplars may name it
    capture: bool = False  # the prompt and the answer's text go in (`capture_content`)

    def traceparent(self, span_id: int | None = None) -> str:
        """The W3C header naming `span_id` (one of this request's; its own by default) as the
        parent of what it is sent with."""
        return (f"00-{self.trace_id:032x}-{span_id or self.span_id:016x}-"
                f"{'01' if self.sampled else '00'}")

    def headers(self, span_id: int) -> dict[str, str]:
        """What an exchange whose span is `span_id` sends upstream (W3C trace context)."""
        sent = {"traceparent": self.traceparent(span_id)}
        if self.tracestate:
            sent["tracestate"] = self.tracestate
        return sent


def new_span_id() -> int:
    """A random non-zero 64-bit id (as the SDK's RandomIdGenerator makes them)."""
    while not (span_id := random.getrandbits(64)):
        pass
    return span_id


@dataclass(slots=True)
class Trace:
    route: str  # the route's template ("/v2/chat/completions"), or "unmatched"
    started: float = field(default_factory=time.monotonic)
    tier: str | None = None
    account: str | None = None  # keyed callers' account (the log's, never a metric label)
    model: str | None = None  # set only once the router knows it: never client text
    operation: str | None = None  # what the model is asked to do (OPERATIONS)
    family: str | None = None  # the task family, as tiers.toml names it ...
    mode: str | None = None  # ... and the mode it ran in: what a policy replay needs
    backend: str | None = None  # the last backend an exchange went to
    first_byte_s: float | None = None  # a stream's first content, from `started`
    outcome: str | None = None  # a stream's ending (proxy.outcome.Outcome)
    error: str | None = None  # the error type (DESIGN §6) of an error answer
    credits: str | None = None  # what the settlement charges, as the account API writes it
    charged: int = 0  # the same in micro-credits
    units: dict[str, int] = field(default_factory=dict)  # tokens, characters, ... settled
    # What a shadow policy judges again (proxy.policy.shadow): whether admission let the
    # request run, the completion cap it asked for, the engines' queues the budget check read.
    admitted: bool = False
    asked_tokens: int | None = None
    waiting: float | None = None
    finish_reasons: list[str] | None = None  # a chat answer's, as the engine gave them
    # With `capture_content`: the messages sent (JSON) and the answer's text, once known.
    prompt: bytes | None = None
    answer: list[str] | None = None
    spans: Spans | None = None  # tracing on: this request's trace and stages

    def first_byte(self) -> None:
        if self.first_byte_s is None:
            self.first_byte_s = time.monotonic() - self.started

    def stage(self, name: str, start: float, attrs: dict[str, Any] | None = None) -> None:
        """A step that began at `start` (monotonic) ends now."""
        if self.spans is not None:
            self.spans.stages.append(Stage(name, start, time.monotonic(), attrs or {}))


TRACE = web.RequestKey("trace", Trace)
CURRENT: ContextVar[Trace | None] = ContextVar("igw_trace", default=None)

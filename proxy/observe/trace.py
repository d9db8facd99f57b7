"""What one request's path learned, for its metrics and its access-log line.

The middleware opens a `Trace` per request (`request[TRACE]`) and reads it once the answer has
gone out; the steps fill in what they learn (the tier after auth, the model once it is known to
exist, the backend that answered, the first content byte's time, the settlement). The upstream
client has no request at hand, so the trace is also the context's `CURRENT` (a ContextVar is
task-local: each request's task sees its own).
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, field

from aiohttp import web


@dataclass(slots=True)
class Trace:
    route: str  # the route's template ("/v2/chat/completions"), or "unmatched"
    started: float = field(default_factory=time.monotonic)
    tier: str | None = None
    account: str | None = None  # keyed callers' account (the log's, never a metric label)
    model: str | None = None  # set only once the router knows it: never client text
    backend: str | None = None  # the last backend an exchange went to
    first_byte_s: float | None = None  # a stream's first content, from `started`
    outcome: str | None = None  # a stream's ending (proxy.outcome.Outcome)
    error: str | None = None  # the error type (DESIGN §6) of an error answer
    credits: str | None = None  # what the settlement charges, as the account API writes it
    units: dict[str, int] = field(default_factory=dict)  # tokens, characters, ... settled

    def first_byte(self) -> None:
        if self.first_byte_s is None:
            self.first_byte_s = time.monotonic() - self.started


TRACE = web.RequestKey("trace", Trace)
CURRENT: ContextVar[Trace | None] = ContextVar("igw_trace", default=None)


def current_backend(name: str) -> None:
    """Note the backend an upstream exchange goes to on the current request's trace."""
    trace = CURRENT.get()
    if trace is not None:
        trace.backend = name

"""Faults chosen per request by `x-sim-*` headers (after Envoy's `x-envoy-fault-*`).

Only the simulators read these headers; the gateway forwards them untouched, so one simulator
serves a whole fault matrix. Counts ("after N events") include every SSE event written, the
role chunk, usage chunk and `[DONE]` included; a stream with fewer events never trips them.

| header                | effect                                                              |
|-----------------------|---------------------------------------------------------------------|
| `x-sim-status: CODE`  | answer at once with CODE (400-599) and the server's own error body  |
| `x-sim-retry-after: S`| with `x-sim-status`: also send `Retry-After: S`                     |
| `x-sim-delay-ms: N`   | wait N ms before sending response headers                           |
| `x-sim-refuse: 1`     | drop the TCP connection without any response                        |
| `x-sim-hang-after: N` | streams: go silent after N events until the client leaves;          |
|                       | non-stream N=0: never answer                                        |
| `x-sim-cut-after: N`  | streams: after N events close the connection (no terminator)       |
| `x-sim-error-after: N`| streams: after N events send the server's in-band error event      |
| `x-sim-gzip: 1`       | non-stream responses are gzip-encoded (`Content-Encoding: gzip`)    |
| `x-sim-tokens: N`     | natural completion length (before max_tokens / stop sequences)      |
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus

import orjson
from aiohttp import web

_POLL_S = 0.05  # how often a sleeping handler checks that its client is still there
_MAX_SIM_TOKENS = 1_000_000  # x-sim-tokens: keeps a typo from allocating gigabytes


class ClientGone(Exception):
    """The client closed the connection; generation stops (outcome "cancelled")."""


class StreamEnded(Exception):
    """The response ended early on purpose; `outcome` is "cut" or "error"."""

    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


class FaultHeaderError(ValueError):
    """A malformed `x-sim-*` value: a bug in the test, answered with a plain 400."""


async def pause(request: web.BaseRequest, seconds: float) -> None:
    """Sleep, but raise ClientGone as soon as the client disconnects.

    aiohttp (>= 3.9) no longer cancels handlers on disconnect by default, and a sleeping
    handler never sees a failed write, so we poll the transport while waiting.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while True:
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ClientGone
        left = deadline - loop.time()
        if left <= 0:
            return
        await asyncio.sleep(min(left, _POLL_S))


def _int(headers: Mapping[str, str], name: str) -> int | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise FaultHeaderError(f"{name}: expected an integer, got {raw!r}") from None
    if value < 0:
        raise FaultHeaderError(f"{name}: must be >= 0, got {value}")
    return value


def _flag(headers: Mapping[str, str], name: str) -> bool:
    return headers.get(name, "").strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True, slots=True)
class Faults:
    status: int | None = None
    retry_after: str | None = None
    delay_ms: int | None = None
    refuse: bool = False
    hang_after: int | None = None
    cut_after: int | None = None
    error_after: int | None = None
    gzip: bool = False
    tokens: int | None = None

    @classmethod
    def of(cls, request: web.BaseRequest) -> Faults:
        """The request's faults; one scan of the raw header names when there are none."""
        if any(name[:6].lower() == b"x-sim-" for name, _ in request.raw_headers):
            return cls.from_headers(request.headers)
        return NO_FAULTS

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> Faults:
        tokens = _int(headers, "x-sim-tokens")
        if tokens is not None and tokens > _MAX_SIM_TOKENS:
            raise FaultHeaderError(f"x-sim-tokens: at most {_MAX_SIM_TOKENS}, got {tokens}")
        status = _int(headers, "x-sim-status")
        if status is not None and not 400 <= status <= 599:
            raise FaultHeaderError(f"x-sim-status: expected 400-599, got {status}")
        return cls(
            status=status,
            retry_after=headers.get("x-sim-retry-after"),
            delay_ms=_int(headers, "x-sim-delay-ms"),
            refuse=_flag(headers, "x-sim-refuse"),
            hang_after=_int(headers, "x-sim-hang-after"),
            cut_after=_int(headers, "x-sim-cut-after"),
            error_after=_int(headers, "x-sim-error-after"),
            gzip=_flag(headers, "x-sim-gzip"),
            tokens=tokens,
        )


NO_FAULTS = Faults()

# TGI `impl From<InferError>`: error_type → status, inverted; default messages as TGI words them.
_TGI_TYPES = {
    422: ("validation", "Input validation error: simulated by x-sim-status"),
    424: ("generation", "Request failed during generation: simulated by x-sim-status"),
    429: ("overloaded", "Model is overloaded"),
    500: ("incomplete_generation", "Incomplete generation"),
    503: ("healthcheck", "unhealthy"),
}
_VLLM_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
               503: "Service Unavailable"}


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def tgi_error_type(status: int) -> str:
    """The TGI error_type for a status; statuses TGI never sends fall back by class."""
    if status in _TGI_TYPES:
        return _TGI_TYPES[status][0]
    return "validation" if status < 500 else "generation"


def error_response(
    kind: str, status: int, message: str | None = None, error_type: str | None = None,
    param: str | None = None,
) -> web.Response:
    """The server's own JSON error envelope (protocols.md §2.5 for TGI, §3.5 for vLLM)."""
    if kind == "tgi":
        error_type = error_type or tgi_error_type(status)
        message = message or _TGI_TYPES.get(status, (error_type, f"simulated {status}"))[1]
        body: dict[str, object] = {"error": message, "error_type": error_type}
    else:
        phrase = _phrase(status)
        error_type = error_type or _VLLM_TYPES.get(status) or phrase or "Error"
        body = {
            "error": {
                "message": message or f"simulated {status} {phrase}".rstrip(),
                "type": error_type,
                "param": param,
                "code": status,
            }
        }
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


async def before_response(
    request: web.BaseRequest, faults: Faults, kind: str
) -> web.Response | None:
    """Faults acting before any response byte: delay, then refuse, then a forced status."""
    if faults.delay_ms:
        await pause(request, faults.delay_ms / 1000)
    if faults.refuse:
        if request.transport is not None:
            request.transport.abort()
        raise StreamEnded("cut")
    if faults.status is not None:
        response = error_response(kind, faults.status)
        if faults.retry_after is not None:
            response.headers["Retry-After"] = faults.retry_after
        return response
    return None


async def before_event(request: web.BaseRequest, faults: Faults, sent: int) -> bool:
    """Stream faults due before event number `sent` (0-based).

    Returns True when the in-band error event must be written now (x-sim-error-after).
    """
    if sent == faults.cut_after:
        if request.transport is not None:
            # close(), not abort(): events already written still reach the client.
            request.transport.close()
        raise StreamEnded("cut")
    if sent == faults.hang_after:
        await pause(request, math.inf)
    return sent == faults.error_after

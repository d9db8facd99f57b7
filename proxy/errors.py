"""Every error the gateway answers with, and its two renderings (JSON body, in-band stream event).

One error type, `GatewayError`, carries an `ErrorKind` (HTTP status + `error.type`), a public
message and optional headers. Nothing else reaches a client: handlers raise `GatewayError`, the
error middleware renders it, and unexpected exceptions become a bare 500 without their text.

    GatewayError
      kind: ErrorKind  -> status (400 ... 504), type ("invalid_json" ... "upstream_timeout")
      message          -> public text, never exception text, keys or tokens
      detail           -> the 422 list (FastAPI style) or None (the message is used)
      headers          -> e.g. Retry-After

Pure: imports neither aiohttp nor redis.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import orjson


class ErrorKind(enum.Enum):
    """DESIGN.md §6: status and `error.type` for each failure the gateway reports."""

    INVALID_JSON = (400, "invalid_json")
    INVALID_REQUEST = (400, "invalid_request")
    INVALID_API_KEY = (401, "invalid_api_key")
    INSUFFICIENT_CREDITS = (402, "insufficient_credits")
    BUDGET_EXCEEDED = (402, "budget_exceeded")
    FORBIDDEN = (403, "forbidden")
    NOT_FOUND = (404, "not_found")
    METHOD_NOT_ALLOWED = (405, "method_not_allowed")
    REQUEST_TIMEOUT = (408, "request_timeout")
    CONFLICT = (409, "conflict")
    PAYLOAD_TOO_LARGE = (413, "payload_too_large")
    URI_TOO_LONG = (414, "uri_too_long")
    UNSUPPORTED_MEDIA_TYPE = (415, "unsupported_media_type")
    VALIDATION_ERROR = (422, "validation_error")
    RATE_LIMITED = (429, "rate_limited")
    HEADERS_TOO_LARGE = (431, "headers_too_large")
    INTERNAL_ERROR = (500, "internal_error")
    NOT_IMPLEMENTED = (501, "not_implemented")
    UPSTREAM_ERROR = (502, "upstream_error")
    UNAVAILABLE = (503, "unavailable")
    POOL_SATURATED = (503, "pool_saturated")
    UPSTREAM_TIMEOUT = (504, "upstream_timeout")
    HTTP_VERSION_NOT_SUPPORTED = (505, "http_version_not_supported")

    @property
    def status(self) -> int:
        return self.value[0]

    @property
    def type(self) -> str:
        return self.value[1]


class GatewayError(Exception):
    """A failure with a public message; raised anywhere on the request path."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        detail: list[dict[str, Any]] | None = None,
        headers: Mapping[str, str] | None = None,
        store: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.detail = detail
        self.headers = dict(headers or {})
        self.store = store  # the part of the state store that failed (a metric label)

    @property
    def status(self) -> int:
        return self.kind.status

    def body(self) -> dict[str, Any]:
        """`detail` for FastAPI-style clients, `error` for the OpenAI and Anthropic SDKs."""
        return {
            "detail": self.detail if self.detail is not None else self.message,
            "error": {"type": self.kind.type, "message": self.message},
        }

    def json(self) -> bytes:
        return orjson.dumps(self.body())

    def sse_event(self) -> bytes:
        """The in-band error once a 200 stream has started (openai-python raises on it)."""
        event = {"error": {"type": self.kind.type, "message": self.message, "code": self.status}}
        return b"data: " + orjson.dumps(event) + b"\n\n"


def validation_failed(detail: list[dict[str, Any]]) -> GatewayError:
    count = len(detail)
    noun = "error" if count == 1 else "errors"
    first = detail[0] if detail else {"loc": [], "msg": "invalid request"}
    where = ".".join(str(part) for part in first.get("loc", []))
    message = f"{count} validation {noun}; first: {where}: {first.get('msg')}"
    return GatewayError(ErrorKind.VALIDATION_ERROR, message, detail=detail)


STORE_RETRY_AFTER_S = 5


def store_unavailable(store: str) -> GatewayError:
    """503 while a part of the state store cannot be reached: the one wording, one Retry-After."""
    return GatewayError(ErrorKind.UNAVAILABLE, f"the {store} is unreachable; try again shortly",
                        headers={"Retry-After": str(STORE_RETRY_AFTER_S)}, store=store)


def media_cap_reached(cap: int) -> GatewayError:
    """429: the account keeps as much task media as it may until older media expires."""
    return GatewayError(ErrorKind.RATE_LIMITED,
                        f"this account keeps {cap:,} bytes of task media, its cap; more is kept "
                        "once older media expires", headers={"Retry-After": "60"})

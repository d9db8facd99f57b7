"""What the OpenAPI document says of a route is made of: `Doc` (one route), its `Response`s, its
`Param`s and `Header`s, the media types, the security schemes' names and the headers many
answers share. The docs themselves are in route_docs.py; openapi.py renders them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from proxy.styles.base import ErrorFamily

JSON: Final = "application/json"
SSE: Final = "text/event-stream"
NDJSON: Final = "application/x-ndjson"
TEXT: Final = "text/plain"
API_KEY: Final = "ApiKeyHeader"
BEARER: Final = "BearerAuth"
ADMIN: Final = "AdminBearer"
JSONObject = dict[str, Any]
EXAMPLE_MODEL: Final = "acme/small-chat"  # replaced by a served model when the document is served
Family = ErrorFamily


@dataclass(frozen=True)
class Param:
    """A query, header or path parameter."""

    name: str
    schema: Mapping[str, Any]
    description: str = ""
    required: bool = False


Where = Literal["query", "header", "path"]
Params = tuple[tuple[Where, Param], ...]


@dataclass(frozen=True)
class Header:
    """A response header."""

    description: str
    schema: Mapping[str, Any] = field(default_factory=lambda: {"type": "string"})
    required: bool = False


@dataclass(frozen=True)
class Response:
    description: str
    body: object = None  # any msgspec-describable type; rendered for JSON content types only
    content: str | tuple[str, ...] = JSON
    headers: Mapping[str, Header] = field(default_factory=dict)
    links: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    event: Mapping[str, Any] | None = None  # a stream's schema: one event (SSE), as 3.1 says it
    or_body: object = None  # a second shape the same status may have (anyOf)


@dataclass(frozen=True)
class Doc:
    """What the OpenAPI document says of one route (its method and path come from the table)."""

    summary: str
    responses: Mapping[int, Response]
    request: object = None  # request body type, None for no body
    example: JSONObject | None = None  # a request body that works
    tags: tuple[str, ...] = ()
    security: tuple[str, ...] = (API_KEY, BEARER)
    auth_optional: bool = True  # spec: callers without a key are guests
    description: str = ""
    params: Params = ()
    drains: bool = True  # refused (503) while the gateway drains; health probes are not
    # A multipart/form-data body instead: its schema as written (files as binary strings).
    form: JSONObject | None = None


# ---- headers ---------------------------------------------------------------------------------

_SECONDS: Final = {"type": "integer", "minimum": 0}
REQUEST_ID: Final = Header("This request's id: the client's X-Request-Id if it was usable, "
                           "else a new one", required=True)
RETRY_AFTER: Final = Header("Seconds until a retry may succeed", _SECONDS, required=True)
RATE_LIMIT: Final[Mapping[str, Header]] = {
    "X-RateLimit-Limit": Header("Requests per minute of the caller's tier", _SECONDS),
    "X-RateLimit-Remaining": Header("Requests left in the current window", _SECONDS),
    "X-RateLimit-Reset": Header("Seconds until the window frees a slot", _SECONDS),
}
TASK_ID: Final = Header("`direct:<uuid>` or `network:<uuid>` (not on an idempotent replay)")
REPLAYED: Final = Header("`true` when this is the stored answer to an earlier request with the "
                         "same Idempotency-Key (nothing ran, nothing was charged)",
                         {"const": "true"})

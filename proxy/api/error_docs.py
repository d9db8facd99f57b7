"""Error answers as the document describes them: one body shape per family of routes, as each
style renders its errors (`error_body` in proxy/styles/): the gateway's `{detail, error}`,
Anthropic's `{type: "error", error}` on the Messages route and Ollama's `{error}` on the native
routes; and what each status means (DESIGN §6), with the headers it carries.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Final, Literal

import msgspec
from msgspec import Meta

from proxy.api.doc_types import JSON, RATE_LIMIT, RETRY_AFTER, Family, Header, Response


class _Exact(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """An error body is exactly this (additionalProperties: false): the families differ only
    in their fields."""


class ErrorInfo(_Exact):
    type: Annotated[str, Meta(description="Machine-readable error class (DESIGN §6 on gateway "
                                          "routes, Anthropic's error types on Messages)")]
    message: str


class ValidationErrorItem(_Exact):
    loc: Annotated[list[str | int], Meta(description="Path of the fault, starting at 'body' "
                                                     "(or 'header', 'path')")]
    msg: str
    type: str


class ValidationErrorBody(_Exact):
    detail: list[ValidationErrorItem]
    error: ErrorInfo


class ErrorBody(_Exact):
    detail: str
    error: ErrorInfo


class AnthropicErrorBody(_Exact):
    type: Literal["error"]
    error: ErrorInfo
    detail: Annotated[str, Meta(description="The message again, for FastAPI-style clients")]


class AnthropicValidationErrorBody(_Exact):
    type: Literal["error"]
    error: ErrorInfo
    detail: list[ValidationErrorItem]


class OllamaErrorBody(_Exact):
    error: str


class OllamaValidationErrorBody(_Exact):
    error: str
    detail: list[ValidationErrorItem]


_BODIES: Final[Mapping[Family, tuple[type, type]]] = {  # (other errors, 422 with its list)
    "gateway": (ErrorBody, ValidationErrorBody),
    "anthropic": (AnthropicErrorBody, AnthropicValidationErrorBody),
    "ollama": (OllamaErrorBody, OllamaValidationErrorBody),
}

# DESIGN §6; every route picks the statuses it can answer (a `when` may say it more exactly).
_WHEN: Final[Mapping[int, str]] = {
    400: "The body is not JSON or not a JSON object (invalid_json)",
    401: "Key or token malformed, unknown, revoked or expired (invalid_api_key)",
    402: "The worst-case cost exceeds the available balance (insufficient_credits), or would "
         "take the account or key past a spend budget before it resets (budget_exceeded)",
    403: "The tier may not use this model, mode or task family (forbidden)",
    404: "Unknown model, or network mode, which no model offers yet (not_found)",
    409: "A request with the same Idempotency-Key is still running (conflict)",
    413: "The body is over the route's cap (payload_too_large)",
    415: "The body is not sent as application/json (unsupported_media_type)",
    422: "Schema or usage-rule failure (validation_error), every fault listed",
    429: "The tier's rate is exceeded (rate_limited)",
    501: "`async: true`: async chat tasks are not available yet (not_implemented)",
    502: "The upstream failed or sent something unusable (upstream_error)",
    503: "No healthy backend, all saturated, or the state store is down (unavailable)",
    504: "The upstream did not answer in time (upstream_timeout)",
}
_TYPE_NAME: Final = re.compile(r" \([a-z_]+\)")
_HEADERS_BY_STATUS: Final[Mapping[int, Mapping[str, Header]]] = {
    429: {"Retry-After": RETRY_AFTER, **RATE_LIMIT},
    503: {"Retry-After": RETRY_AFTER},
}


def for_family(family: Family, when: str) -> str:
    """`when` as the family's routes say it: the gateway's `error.type` names (`(not_found)`)
    do not apply to the Anthropic and Ollama routes."""
    return when if family == "gateway" else _TYPE_NAME.sub("", when)


def error(family: Family, status: int, when: str | None = None, *, body: type | None = None,
          headers: Mapping[str, Header] | None = None) -> Response:
    """The answer `status` on a route of `family`: its body shape, its meaning (`when`, or the
    usual one) and its headers (by default those the status always carries)."""
    plain, listed = _BODIES[family]
    chosen = body or (listed if status == 422 else plain)
    text = for_family(family, when or _WHEN[status])
    return Response(text, chosen, JSON,
                    headers if headers is not None else _HEADERS_BY_STATUS.get(status, {}))


def errors(family: Family, *statuses: int) -> dict[int, Response]:
    """Each status with its usual meaning."""
    return {status: error(family, status) for status in statuses}

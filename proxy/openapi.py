"""The OpenAPI 3.1.0 document (spec: Versioning), generated from the Structs in `schemas.py`.

The request schemas here are the very types `validate.py` converts bodies into, so the published
bounds and the 422s the gateway sends cannot disagree. Each route family contributes a list of
`Operation`s (chat below; TTS, ASR and the other styles add theirs) and the app renders them all
with one `build_openapi` call.
"""

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from proxy.schemas import (
    AsyncAccepted,
    ChatRequest,
    ChatResponse,
    ErrorBody,
    ValidationErrorBody,
)
from proxy.schemas_anthropic import MessagesRequest
from proxy.schemas_ollama import OllamaChatRequest
from proxy.schemas_served import ServedChatRequest

__all__ = ["API_KEY", "BEARER", "CHAT_OPERATIONS", "ERROR_RESPONSES", "Operation",
           "ResponseSpec", "build_openapi"]

JSON: Final = "application/json"
SSE: Final = "text/event-stream"
API_KEY: Final = "ApiKeyHeader"
BEARER: Final = "BearerAuth"
_REF_TEMPLATE: Final = "#/components/schemas/{name}"

# (description, body type or None, content type(s)). The body type is any msgspec-describable
# type (a Struct, or e.g. list[str]); it is rendered for JSON content types only.
ResponseSpec = tuple[str, object, str | tuple[str, ...]]


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    summary: str
    request: object  # request body type, None for no body
    responses: Mapping[int, ResponseSpec]
    tags: tuple[str, ...] = ()
    security: tuple[str, ...] = (API_KEY,)
    auth_optional: bool = True  # spec: callers without a key are guests
    description: str = ""


_SECURITY_SCHEMES: Final[dict[str, Any]] = {
    API_KEY: {"type": "apiKey", "in": "header", "name": "X-API-Key",
              "description": "API key `<prefix>_sk_...`; wins over Authorization if both are sent"},
    BEARER: {"type": "http", "scheme": "bearer",
             "description": "`Authorization: Bearer <API key or JWT>`"},
}

# DESIGN §6: statuses whose responses carry Retry-After.
_RETRY_AFTER: Final = frozenset({429, 503})
_PATH_PARAM: Final = re.compile(r"\{([^}/]+)\}")


def _is_json(content_type: str) -> bool:
    return content_type == JSON or content_type.endswith("+json")


def _operation_id(op: Operation) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", f"{op.method} {op.path}").strip("_").lower()


def build_openapi(operations: Sequence[Operation], *, title: str, version: str) -> dict[str, Any]:
    """Render `operations` as an OpenAPI 3.1.0 document (a JSON-ready dict)."""
    # All types go through one schema_components call so shared Structs become one component.
    types: list[object] = []
    for op in operations:
        if op.request is not None:
            types.append(op.request)
        types.extend(body for _, body, _ in op.responses.values() if body is not None)
    unique = list(dict.fromkeys(types))
    schemas, components = msgspec.json.schema_components(unique, ref_template=_REF_TEMPLATE)
    schema_of = dict(zip(unique, schemas, strict=True))

    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        item: dict[str, Any] = {"summary": op.summary, "operationId": _operation_id(op)}
        if op.description:
            item["description"] = op.description
        if op.tags:
            item["tags"] = list(op.tags)
        params = _PATH_PARAM.findall(op.path)
        if params:
            item["parameters"] = [{"name": p, "in": "path", "required": True,
                                   "schema": {"type": "string"}} for p in params]
        if op.request is not None:
            item["requestBody"] = {"required": True,
                                   "content": {JSON: {"schema": schema_of[op.request]}}}
        item["responses"] = {str(status): _response(status, spec, schema_of)
                             for status, spec in sorted(op.responses.items())}
        security: list[dict[str, list[str]]] = [{name: []} for name in op.security]
        item["security"] = [*security, {}] if op.auth_optional else security
        paths.setdefault(op.path, {})[op.method.lower()] = item

    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": _SECURITY_SCHEMES},
    }


def _response(status: int, spec: ResponseSpec, schema_of: dict[object, Any]) -> dict[str, Any]:
    description, body, content_types = spec
    out: dict[str, Any] = {"description": description}
    content: dict[str, Any] = {}
    for ct in (content_types,) if isinstance(content_types, str) else content_types:
        if body is not None and _is_json(ct):
            content[ct] = {"schema": schema_of[body]}
        elif ct.startswith("text/"):
            content[ct] = {"schema": {"type": "string"}}
        else:  # binary (audio/wav, images): 3.1 describes raw bytes by media type alone
            content[ct] = {}
    if content:
        out["content"] = content
    if status in _RETRY_AFTER:
        out["headers"] = {"Retry-After": {"description": "Seconds until a retry may succeed",
                                          "schema": {"type": "integer"}}}
    return out


def _error(description: str) -> ResponseSpec:
    return (description, ErrorBody, JSON)


# DESIGN §6 error table; every route shares it and adds or drops statuses as it needs.
ERROR_RESPONSES: Final[Mapping[int, ResponseSpec]] = {
    400: _error("invalid_json: the body is not JSON or not an object"),
    401: _error("invalid_api_key: key or token malformed, unknown, revoked or expired"),
    402: _error("insufficient_credits: the worst-case cost exceeds the available balance"),
    403: _error("forbidden: the tier may not use this model, mode or task family"),
    404: _error("not_found: unknown model or route"),
    413: _error("payload_too_large: body over the route's cap"),
    422: ("validation_error: schema or usage-rule failure", ValidationErrorBody, JSON),
    429: _error("rate_limited: tier rate exceeded"),
    502: _error("upstream_error: the upstream failed or sent something unusable"),
    503: _error("unavailable: no healthy backend, all saturated, or the state store is down"),
    504: _error("upstream_timeout: the upstream did not answer in time"),
}

CHAT_OPERATIONS: Final[tuple[Operation, ...]] = (
    Operation(
        method="POST",
        path="/v2/compat/v1/chat/completions",
        summary="Chat completion (OpenAI-compatible)",
        description="With `stream: true` (direct mode only, not with `async`) the answer is a "
                    "Server-Sent Events stream of `data: <json chunk>` lines ending with "
                    "`data: [DONE]`. With `async: true` a task handle is returned (202).",
        request=ChatRequest,
        responses={
            200: ("Chat completion; an SSE stream when `stream` is true", ChatResponse,
                  (JSON, SSE)),
            202: ("Async task accepted (`async: true`)", AsyncAccepted, JSON),
            **ERROR_RESPONSES,
        },
        tags=("chat",),
        security=(API_KEY, BEARER),
    ),
)

NDJSON = "application/x-ndjson"

# Every route the gateway serves: the chat styles, the model list and the account routes.
GATEWAY_OPERATIONS: Final[tuple[Operation, ...]] = (
    *CHAT_OPERATIONS,
    Operation(
        method="POST", path="/v2/served/v1/chat/completions",
        summary="Chat completion, vLLM style (OpenAI fields plus vLLM's extensions)",
        description="The compat request plus vLLM's sampling, template and structured-output "
                    "fields; they reach vLLM backends only. Streams as the compat route does.",
        request=ServedChatRequest,
        responses={200: ("Chat completion, or an SSE stream", ChatResponse, (JSON, SSE)),
                   **ERROR_RESPONSES},
        tags=("chat",), security=(API_KEY, BEARER),
    ),
    Operation(
        method="POST", path="/v2/messages/v1/messages",
        summary="Chat, Anthropic Messages style",
        description="Anthropic's Messages API (`x-api-key`, `anthropic-version` accepted); "
                    "streams the full named-event sequence. Errors use Anthropic's shape.",
        request=MessagesRequest,
        responses={200: ("A message, or an SSE stream of named events", None, (JSON, SSE)),
                   **ERROR_RESPONSES},
        tags=("chat",), security=(API_KEY, BEARER),
    ),
    Operation(
        method="POST", path="/v2/native/api/chat",
        summary="Chat, Ollama style (also at /api/native/chat)",
        description="Ollama's /api/chat: NDJSON streaming on by default, the final line with "
                    "`done`, `done_reason`, counts and durations in nanoseconds.",
        request=OllamaChatRequest,
        responses={200: ("One object, or an NDJSON stream", None, (JSON, NDJSON)),
                   **ERROR_RESPONSES},
        tags=("chat",), security=(API_KEY, BEARER),
    ),
    Operation(
        method="GET", path="/v2/models", summary="List current models",
        description="What the gateway serves, OpenAI list style, with each model's modes, task "
                    "family, the tiers that may use it, its price and whether it is healthy.",
        request=None, responses={200: ("Model list", None, JSON), 401: ERROR_RESPONSES[401]},
        tags=("models",), security=(API_KEY, BEARER),
    ),
    Operation(
        method="GET", path="/v2/account", summary="Your tier, balance and rate limit left",
        request=None, responses={200: ("Account", None, JSON), 401: ERROR_RESPONSES[401]},
        tags=("account",), security=(API_KEY, BEARER), auth_optional=False,
    ),
    Operation(
        method="GET", path="/v2/account/usage",
        summary="Usage: totals, per model, per day, and the journal (paginated)",
        description="Query: `limit` (1-200), `before` (the `next_before` of the previous page).",
        request=None, responses={200: ("Usage", None, JSON), 401: ERROR_RESPONSES[401]},
        tags=("account",), security=(API_KEY, BEARER), auth_optional=False,
    ),
)

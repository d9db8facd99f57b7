"""The OpenAPI 3.1.0 document (spec: Versioning), generated from the request Structs.

The request schemas here are the very types the validator converts bodies into, so the published
bounds and the 422s the gateway sends cannot disagree. Every route in the app's route table
carries a `Doc`, and the document is rendered from that table (`proxy.app.ROUTES`), so a route
cannot exist undescribed.
"""

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec
from msgspec import Meta

from proxy.api.admin import CreateKeyBody, CreditBody
from proxy.api.ollama_discovery import ShowRequest
from proxy.styles.anthropic_schema import MessagesRequest
from proxy.styles.ollama_schema import OllamaChatRequest
from proxy.styles.openai_schema import AsyncAccepted, ChatRequest, ChatResponse
from proxy.styles.served_schema import ServedChatRequest

__all__ = ["ADMIN", "API_KEY", "BEARER", "Doc", "ResponseSpec", "build_openapi"]

JSON: Final = "application/json"
SSE: Final = "text/event-stream"
NDJSON: Final = "application/x-ndjson"
TEXT: Final = "text/plain"
API_KEY: Final = "ApiKeyHeader"
BEARER: Final = "BearerAuth"
ADMIN: Final = "AdminBearer"
_REF_TEMPLATE: Final = "#/components/schemas/{name}"

# (description, body type or None, content type(s)). The body type is any msgspec-describable
# type (a Struct, or e.g. list[str]); it is rendered for JSON content types only.
ResponseSpec = tuple[str, object, str | tuple[str, ...]]


@dataclass(frozen=True)
class Query:
    name: str
    schema: Mapping[str, Any]
    description: str = ""


@dataclass(frozen=True)
class Doc:
    """What the OpenAPI document says of one route (its method and path come from the table)."""

    summary: str
    responses: Mapping[int, ResponseSpec]
    request: object = None  # request body type, None for no body
    tags: tuple[str, ...] = ()
    security: tuple[str, ...] = (API_KEY, BEARER)
    auth_optional: bool = True  # spec: callers without a key are guests
    description: str = ""
    query: tuple[Query, ...] = ()


_SECURITY_SCHEMES: Final[dict[str, Any]] = {
    API_KEY: {"type": "apiKey", "in": "header", "name": "X-API-Key",
              "description": "API key `<prefix>_sk_...`; wins over Authorization if both are sent"},
    BEARER: {"type": "http", "scheme": "bearer",
             "description": "`Authorization: Bearer <API key or JWT>`"},
    ADMIN: {"type": "http", "scheme": "bearer",
            "description": "`Authorization: Bearer <GATEWAY_ADMIN_TOKEN>` or an admin-role JWT"},
}

# DESIGN §6: statuses whose responses carry Retry-After.
_RETRY_AFTER: Final = frozenset({429, 503})
_PATH_PARAM: Final = re.compile(r"\{([^}/]+)\}")


# ---- error bodies, one shape per family of routes ---------------------------------------------


class ErrorInfo(msgspec.Struct, kw_only=True):
    type: Annotated[str, Meta(description="Machine-readable error class, e.g. rate_limited")]
    message: str


class ValidationErrorItem(msgspec.Struct, kw_only=True):
    loc: Annotated[list[str | int], Meta(description="Path of the fault, starting at 'body'")]
    msg: str
    type: str


class ValidationErrorBody(msgspec.Struct, kw_only=True):
    detail: list[ValidationErrorItem]
    error: ErrorInfo


class ErrorBody(msgspec.Struct, kw_only=True):
    detail: str
    error: ErrorInfo


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


def _errors(*statuses: int) -> dict[int, ResponseSpec]:
    return {status: ERROR_RESPONSES[status] for status in statuses}


COMPAT_CHAT: Final = Doc(
    summary="Chat completion (OpenAI-compatible)",
    description="With `stream: true` (direct mode only, not with `async`) the answer is a "
                "Server-Sent Events stream of `data: <json chunk>` lines ending with "
                "`data: [DONE]`. With `async: true` a task handle is returned (202).",
    request=ChatRequest,
    responses={
        200: ("Chat completion; an SSE stream when `stream` is true", ChatResponse, (JSON, SSE)),
        202: ("Async task accepted (`async: true`)", AsyncAccepted, JSON),
        **ERROR_RESPONSES,
    },
    tags=("chat",),
)
SERVED_CHAT: Final = Doc(
    summary="Chat completion, vLLM style (OpenAI fields plus vLLM's extensions)",
    description="The compat request plus vLLM's sampling, template and structured-output "
                "fields; they reach vLLM backends only. Streams as the compat route does.",
    request=ServedChatRequest,
    responses={200: ("Chat completion, or an SSE stream", ChatResponse, (JSON, SSE)),
               **ERROR_RESPONSES},
    tags=("chat",),
)
MESSAGES_CHAT: Final = Doc(
    summary="Chat, Anthropic Messages style",
    description="Anthropic's Messages API (`x-api-key`, `anthropic-version` accepted); "
                "streams the full named-event sequence. Errors use Anthropic's shape.",
    request=MessagesRequest,
    responses={200: ("A message, or an SSE stream of named events", None, (JSON, SSE)),
               **ERROR_RESPONSES},
    tags=("chat",),
)
NATIVE_CHAT: Final = Doc(
    summary="Chat, Ollama style (also at /api/native/chat)",
    description="Ollama's /api/chat: NDJSON streaming on by default, the final line with "
                "`done`, `done_reason`, counts and durations in nanoseconds.",
    request=OllamaChatRequest,
    responses={200: ("One object, or an NDJSON stream", None, (JSON, NDJSON)),
               **ERROR_RESPONSES},
    tags=("chat",),
)
MODELS: Final = Doc(
    summary="List current models",
    description="What the gateway serves, OpenAI list style, with each model's modes, task "
                "family, the tiers that may use it, its price and whether it is healthy.",
    responses={200: ("Model list", None, JSON), **_errors(401)},
    tags=("models",),
)
ACCOUNT: Final = Doc(
    summary="Your tier, balance and rate limit left",
    responses={200: ("Account", None, JSON), **_errors(401, 503)},
    tags=("account",), auth_optional=False,
)
ACCOUNT_USAGE: Final = Doc(
    summary="Usage: totals, per model, per day, and the journal (paginated)",
    description="Query: `limit` (1-200), `before` (the `next_before` of the previous page).",
    responses={200: ("Usage", None, JSON), **_errors(400, 401, 503)},
    tags=("account",), auth_optional=False,
    query=(Query("limit", {"type": "integer", "minimum": 1, "maximum": 200}, "page size"),
           Query("before", {"type": "string"}, "the `next_before` of the previous page")),
)
OPENAPI: Final = Doc(
    summary="This document", responses={200: ("OpenAPI 3.1.0", None, JSON)},
    tags=("meta",), security=(),
)
HEALTHZ: Final = Doc(
    summary="Alive: the process answers", responses={200: ("Alive", None, JSON)},
    tags=("meta",), security=(),
)
READYZ: Final = Doc(
    summary="Ready: not draining, Redis answers, a backend may take traffic",
    responses={200: ("Ready", None, JSON), 503: ("Not ready", None, JSON)},
    tags=("meta",), security=(),
)


def _admin(summary: str, request: object = None, ok: int = 200, *errors: int,
           query: tuple[Query, ...] = ()) -> Doc:
    return Doc(summary=summary, request=request,
               responses={ok: ("OK", None, JSON), **_errors(401, *errors)},
               tags=("admin",), security=(ADMIN,), auth_optional=False, query=query)


ADMIN_CREATE_KEY: Final = _admin("Issue an API key (shown once)", CreateKeyBody, 201, 400, 413,
                                 422)
ADMIN_LIST_KEYS: Final = _admin("List keys (never the keys themselves)",
                                query=(Query("account", {"type": "string"}, "one account"),))
ADMIN_REVOKE_KEY: Final = _admin("Revoke a key by id, everywhere at once", None, 200, 404)
ADMIN_ACCOUNT: Final = _admin("An account and its keys", None, 200, 404)
ADMIN_CREDITS: Final = _admin("Add credits (negative: an adjustment), journaled", CreditBody,
                              201, 400, 413, 422)
ADMIN_RELOAD: Final = _admin("Reload policies/ (as SIGHUP does)", None, 200, 422)
ADMIN_BACKENDS: Final = _admin("Backends: state, health and load as this worker sees them")


def _ollama(summary: str, request: object = None, ok: tuple[str, ...] = (JSON,), *errors: int
            ) -> Doc:
    return Doc(summary=summary, request=request,
               responses={200: ("OK", None, ok if len(ok) > 1 else ok[0]), **_errors(401, *errors)},
               tags=("ollama",))


OLLAMA_TAGS: Final = _ollama("Ollama: the chat models served")
OLLAMA_SHOW: Final = _ollama("Ollama: one model's details", ShowRequest, (JSON,), 400, 404, 413,
                             422)
OLLAMA_VERSION: Final = _ollama("Ollama: the API level these answers mirror")
OLLAMA_PS: Final = _ollama("Ollama: loaded models (none: models stay loaded)")
OLLAMA_ROOT: Final = _ollama("Ollama: \"Ollama is running\"", None, (TEXT,))


def _is_json(content_type: str) -> bool:
    return content_type == JSON or content_type.endswith("+json")


def _operation_id(method: str, path: str) -> str:
    slash = "_slash" if path.endswith("/") else ""  # /v2/native and /v2/native/ are two routes
    return re.sub(r"[^A-Za-z0-9]+", "_", f"{method} {path}").strip("_").lower() + slash


def build_openapi(routes: Iterable[tuple[str, str, Doc]], *, title: str, version: str
                  ) -> dict[str, Any]:
    """Render `(method, path, doc)` routes as an OpenAPI 3.1.0 document (a JSON-ready dict)."""
    routes = list(routes)
    # All types go through one schema_components call so shared Structs become one component.
    types: list[object] = []
    for _, _, doc in routes:
        if doc.request is not None:
            types.append(doc.request)
        types.extend(body for _, body, _ in doc.responses.values() if body is not None)
    unique = list(dict.fromkeys(types))
    schemas, components = msgspec.json.schema_components(unique, ref_template=_REF_TEMPLATE)
    schema_of = dict(zip(unique, schemas, strict=True))

    paths: dict[str, dict[str, Any]] = {}
    for method, path, doc in routes:
        item: dict[str, Any] = {"summary": doc.summary,
                                "operationId": _operation_id(method, path)}
        if doc.description:
            item["description"] = doc.description
        if doc.tags:
            item["tags"] = list(doc.tags)
        params: list[dict[str, Any]] = [
            {"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
            for p in _PATH_PARAM.findall(path)
        ]
        params += [{"name": q.name, "in": "query", "required": False, "schema": dict(q.schema),
                    **({"description": q.description} if q.description else {})}
                   for q in doc.query]
        if params:
            item["parameters"] = params
        if doc.request is not None:
            item["requestBody"] = {"required": True,
                                   "content": {JSON: {"schema": schema_of[doc.request]}}}
        item["responses"] = {str(status): _response(status, spec, schema_of)
                             for status, spec in sorted(doc.responses.items())}
        security: list[dict[str, list[str]]] = [{name: []} for name in doc.security]
        item["security"] = [*security, {}] if doc.auth_optional else security
        paths.setdefault(path, {})[method.lower()] = item

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

"""What the OpenAPI document says of the gateway's own routes: the model list, async tasks and
their media, voice presets, the caller's account and usage, the admin routes, Ollama's discovery
routes, and the probes (health, readiness, metrics, this document). route_docs.py re-exports
each `Doc`, for the route table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Final

from proxy.api.account import ENTRY_ID_PATTERN, PAGE_MAX
from proxy.api.admin import AlertBody, BudgetBody, CreateKeyBody, CreditBody, WebhookBody
from proxy.api.console import TOP_DEFAULT, TOP_MAX
from proxy.api.doc_types import (
    ADMIN,
    EXAMPLE_MODEL,
    JSON,
    RATE_LIMIT,
    REPLAYED,
    TEXT,
    Doc,
    Header,
    JSONObject,
    Param,
    Params,
    Response,
    Where,
)
from proxy.api.error_docs import ErrorBody, error, errors
from proxy.api.ollama_discovery import ShowRequest
from proxy.api.response_bodies import (
    AccountKeys,
    AccountView,
    AlertList,
    AlertSet,
    BudgetsView,
    CreatedKey,
    CreatedWebhook,
    CreditsAdded,
    Health,
    KeyList,
    KeyView,
    ModelList,
    OllamaModels,
    OllamaVersion,
    Overview,
    Ready,
    Reloaded,
    TaskRecord,
    Usage,
    WebhookList,
    WebhookView,
)
from proxy.blobs.base import KEY_PATTERN
from proxy.credits.idempotency import HEADER as IDEMPOTENCY_KEY
from proxy.credits.idempotency import MAX_KEY_LENGTH
from proxy.identity.apikeys import KEY_ID_HEX, KEY_ID_PREFIX
from proxy.identity.keystore import ACCOUNT_PATTERN
from proxy.ids import TASK_ID_PATTERN

MODELS: Final = Doc(
    summary="List current models",
    description="What the gateway serves, OpenAI list style, with each model's modes, task "
                "family, the tiers that may use it, its price and whether it is healthy.",
    responses={200: Response("Model list", ModelList), **errors("gateway", 401)},
    tags=("models",),
)
COMPAT_MODELS: Final = replace(
    MODELS, summary="List current models (OpenAI client's models.list)",
    description="`GET /v2/models` where the OpenAI client looks for it with the compat base URL "
                "(`.../v2/compat/v1`): the same list.")
TASK: Final = Doc(
    summary="Poll an async task",
    description="The task's owner only (anyone else: 404). `running` until it ends: `completed` "
                "with the result, or `failed` with the error the synchronous call would have "
                "answered. Results are kept [tasks] result_ttl_s (a day by default).",
    responses={200: Response("The task", TaskRecord), **errors("gateway", 401, 404, 503)},
    tags=("tasks",),
    params=(("path", Param("task_id", {"type": "string", "pattern": TASK_ID_PATTERN},
                           "The id the 202 answer gave", required=True)),),
)
MEDIA: Final = Doc(
    summary="Fetch the audio (or video) of a finished task",
    description="The task's owner only (anyone else: 404); `Range: bytes=a-b` answers 206.",
    responses={200: Response("The media", None, ("audio/wav", "video/x-msvideo")),
               206: Response("Part of it", None, ("audio/wav", "video/x-msvideo")),
               416: Response("The range is outside the media", None, TEXT),
               **errors("gateway", 401, 404, 503)},
    tags=("tasks",),
    params=(("path", Param("media_key", {"type": "string", "pattern": KEY_PATTERN},
                           "The `media_key` of the finished task's result", required=True)),),
)
TTS_PRESETS: Final = Doc(
    summary="List voice presets",
    description="The names `preset_voice` takes; open to guests and keys alike.",
    responses={200: Response("Preset names", list[str]), **errors("gateway", 401)},
    tags=("audio",),
)
_ACCOUNT_ERRORS: Final = {401: error("gateway", 401, "No key or token, or not a valid one "
                                                     "(invalid_api_key)"),
                          429: error("gateway", 429),  # counted like any request
                          503: error("gateway", 503, "The account store is unreachable")}
ACCOUNT: Final = Doc(
    summary="Your tier, balance and rate limit left",
    responses={200: Response("Account", AccountView, JSON, RATE_LIMIT), **_ACCOUNT_ERRORS},
    tags=("account",), auth_optional=False,
)
USAGE_BEFORE: Final = f"^({ENTRY_ID_PATTERN})?$"  # a journal entry id, or empty
ACCOUNT_USAGE: Final = Doc(
    summary="Usage: totals, per model, per day, and the journal (paginated)",
    responses={200: Response("Usage", Usage),
               400: error("gateway", 400, "`limit` or `before` is not valid (invalid_request)"),
               **_ACCOUNT_ERRORS},
    tags=("account",), auth_optional=False,
    params=(("query", Param("limit", {"type": "integer", "minimum": 1, "maximum": PAGE_MAX},
                            "Page size (default 50)")),
            ("query", Param("before", {"type": "string", "pattern": USAGE_BEFORE},
                            "The `next_before` of the previous page; empty or absent: the "
                            "newest page"))),
)
OPENAPI: Final = Doc(
    summary="This document", responses={200: Response("OpenAPI 3.1.0", JSONObject)},
    tags=("meta",), security=(),
)
HEALTHZ: Final = Doc(
    summary="Alive: the process answers", responses={200: Response("Alive", Health)},
    tags=("meta",), security=(), drains=False,
)
METRICS: Final = Doc(
    summary="Prometheus metrics of every worker (text exposition format; docs/monitoring.md)",
    responses={200: Response("The metrics", None, "text/plain; version=0.0.4")},
    tags=("meta",), security=(), drains=False,
)
READYZ: Final = Doc(
    summary="Ready: not draining, Redis answers, a backend may take traffic",
    responses={200: Response("Ready", Ready), 503: Response("Not ready", Ready)},
    tags=("meta",), security=(), drains=False,
)

_ADMIN_401: Final = Response(
    "No admin token or admin-role JWT, or not a valid one (invalid_api_key)", ErrorBody, JSON,
    {"WWW-Authenticate": Header("`Bearer`", required=True)})
_ACCOUNT_PARAM: Final[tuple[Where, Param]] = (
    "path", Param("account", {"type": "string", "pattern": ACCOUNT_PATTERN}, required=True))
_KEY_ID: Final = f"^{KEY_ID_PREFIX}[0-9a-f]{{{KEY_ID_HEX}}}$"
_KEY_ID_PARAM: Final[tuple[Where, Param]] = (
    "path", Param("key_id", {"type": "string", "pattern": _KEY_ID},
                  "The key's id (never the key)", required=True))


def _admin(summary: str, ok: Response, *errors_: int, request: object = None,
           when: Mapping[int, str] | None = None, params: Params = ()) -> Doc:
    status = 201 if request is not None else 200
    when = when or {}
    return Doc(summary=summary, request=request, params=params,
               responses={status: ok, 401: _ADMIN_401,
                          **{s: error("gateway", s, when.get(s)) for s in errors_}},
               tags=("admin",), security=(ADMIN,), auth_optional=False)


_BODY_ERRORS: Final = (400, 413, 415, 422)
# Follow-ups a client (or a stateful tester) can make with what creating a key returned.
_KEY_LINKS: Final = {
    "RevokeKey": {"operationId": "delete_admin_keys_key_id",
                  "parameters": {"key_id": "$response.body#/id"}},
    "ShowAccount": {"operationId": "get_admin_accounts_account",
                    "parameters": {"account": "$response.body#/account"}},
}
ADMIN_CREATE_KEY: Final = _admin(
    "Issue an API key (shown once)",
    Response("The key and its record", CreatedKey, JSON,
             {"Cache-Control": Header("`no-store`: the key is shown once", required=True)},
             _KEY_LINKS),
    *_BODY_ERRORS, request=CreateKeyBody,
    when={422: "Schema failure, or a tier the policies do not define (validation_error)"})
ADMIN_LIST_KEYS: Final = _admin(
    "List keys (never the keys themselves)", Response("Key records", KeyList),
    params=(("query", Param("account", {"type": "string"}, "Only this account's keys")),))
ADMIN_REVOKE_KEY: Final = _admin(
    "Revoke a key by id, everywhere at once (revoking it again changes nothing)",
    Response("The revoked record", KeyView), 404,
    when={404: "No key has this id (not_found)"}, params=(_KEY_ID_PARAM,))
ADMIN_ACCOUNT: Final = _admin(
    "An account and its keys", Response("The account", AccountKeys), 404,
    when={404: "No key was ever issued to this account (not_found)"}, params=(_ACCOUNT_PARAM,))
ADMIN_CREDITS: Final = _admin(
    "Add credits (negative: an adjustment), journaled",
    Response("Added; the balance now available (a replay: as the first call left it)",
             CreditsAdded, JSON, {"Idempotent-Replayed": REPLAYED}),
    *_BODY_ERRORS, 409, 503, request=CreditBody,
    params=(_ACCOUNT_PARAM, ("header", Param(IDEMPOTENCY_KEY, {
        "type": "string", "minLength": 1, "maxLength": MAX_KEY_LENGTH},
        "Made once per key and account for 24 hours: a retry with the same body gets the "
        "first answer, nothing added again; another body under the key is refused (422)"))),
    when={409: "The adjustment would take the balance below zero, or beyond what the "
               "ledger holds (conflict)", 503: "The credit store is unreachable"})
ADMIN_BUDGETS: Final = _admin(
    "Set or remove a spend budget (per UTC day, week or month; of the account or one of its "
    "keys) and the postpaid flag",
    Response("The account's budgets now", BudgetsView), *_BODY_ERRORS, 404, 409, 503,
    request=BudgetBody, params=(_ACCOUNT_PARAM,),
    when={404: "No such key in this account (not_found)",
          409: "A key's budget would pass its account's, or the account's fall under a "
               "key's (conflict)", 503: "The credit store is unreachable"})
ADMIN_ALERT: Final = _admin(
    "Set or remove the balance under which the account is alerted (webhooks)",
    Response("The threshold now", AlertSet), *_BODY_ERRORS, 503, request=AlertBody,
    params=(_ACCOUNT_PARAM,), when={503: "The credit store is unreachable"})
ADMIN_ALERTS: Final = _admin(
    "The account's alerts, newest first, and each endpoint's delivery",
    Response("Alerts", AlertList), 422, 503,
    params=(_ACCOUNT_PARAM, ("query", Param("limit", {"type": "integer", "minimum": 1,
                                                      "maximum": 100}, "At most this many "
                                            "(20 by default)"))),
    when={503: "The credit store is unreachable"})
ADMIN_ADD_WEBHOOK: Final = _admin(
    "Register an endpoint for budget and balance alerts (its signing secret shown once)",
    Response("The endpoint and its secret", CreatedWebhook, JSON,
             {"Cache-Control": Header("`no-store`: the secret is shown once", required=True)}),
    *_BODY_ERRORS, 503, request=WebhookBody, when={503: "The credit store is unreachable"})
ADMIN_LIST_WEBHOOKS: Final = _admin(
    "The alerts' endpoints (never their secrets)", Response("Endpoints", WebhookList), 503,
    when={503: "The credit store is unreachable"})
ADMIN_REMOVE_WEBHOOK: Final = _admin(
    "Stop sending alerts to an endpoint", Response("The removed endpoint", WebhookView), 404,
    503, params=(("path", Param("endpoint_id", {"type": "string"}, required=True)),),
    when={404: "No endpoint has this id (not_found)", 503: "The credit store is unreachable"})
ADMIN_RELOAD: Final = Doc(
    summary="Reload policies/ (as SIGHUP does)", tags=("admin",), security=(ADMIN,),
    auth_optional=False,
    responses={200: Response("Reloaded", Reloaded), 401: _ADMIN_401,
               422: error("gateway", 422, "A policy file is invalid; the old policies stay "
                                          "(validation_error)", body=ErrorBody)})
ADMIN_BACKENDS: Final = _admin("Backends: state, health and load as this worker sees them",
                               Response("Backends", JSONObject))
ADMIN_OVERVIEW: Final = _admin(
    "Every worker's and gateway's tallies: the top accounts by spend and by refusals (24 h), "
    "errors by type (1 h), the last 50 errors", Response("The overview", Overview), 422, 503,
    params=(("query", Param("top", {"type": "integer", "minimum": 1, "maximum": TOP_MAX},
                            f"How many accounts each list holds ({TOP_DEFAULT} by default)")),),
    when={422: f"`top` is not an integer 1-{TOP_MAX} (validation_error)",
          503: "The state store is unreachable"})
ADMIN_SHADOW: Final = _admin(
    "The tiers as the live and the shadow policies (policies/shadow/) set them, and what the "
    "shadow decided since it was loaded (every worker and gateway)",
    Response("Live and shadow", JSONObject), 503,
    when={503: "The store holding the shadow's tallies is unreachable"})


def _ollama(summary: str, ok: Response, *statuses: int, request: object = None) -> Doc:
    return Doc(summary=summary, request=request, tags=("ollama",),
               responses={200: ok, **errors("ollama", 401, *statuses)})


OLLAMA_TAGS: Final = _ollama("Ollama: the chat models served", Response("Models", OllamaModels))
OLLAMA_SHOW: Final = Doc(
    summary="Ollama: one model's details", request=ShowRequest, example={"model": EXAMPLE_MODEL},
    tags=("ollama",), responses={200: Response("Details", JSONObject),
                                 **errors("ollama", 400, 401, 404, 413, 415, 422)})
OLLAMA_VERSION: Final = _ollama("Ollama: the API level these answers mirror",
                                Response("Version", OllamaVersion))
OLLAMA_PS: Final = _ollama("Ollama: loaded models (none: models stay loaded)",
                           Response("Loaded models", OllamaModels))
OLLAMA_ROOT: Final = _ollama("Ollama: \"Ollama is running\"", Response("Running", None, TEXT))

"""The admin HTTP API: keys, accounts, credits, policy reload, and the fleet as a worker sees it.

    POST   /admin/keys              {account, tier, label?} -> 201 {key, id, ...}; the only time
                                    the key is ever shown (sent with Cache-Control: no-store)
    GET    /admin/keys[?account=A]  -> {object: "list", data: [record...]}
    DELETE /admin/keys/{key_id}     -> the revoked record
    GET    /admin/accounts/{account} -> {account, keys: [record...]}
    POST   /admin/accounts/{account}/credits  {amount, reason} -> a journaled top-up or adjustment
                                              (once per Idempotency-Key)
    POST   /admin/accounts/{account}/budgets  {period, amount, key_id, postpaid} -> set (amount
           null: remove) a spend budget that resets; the account's budgets
    POST   /admin/accounts/{account}/alerts   {below} -> alert when the balance falls under it
    GET    /admin/accounts/{account}/alerts   -> the account's alerts, each delivery's state
    POST   /admin/webhooks          {url, account?} -> 201 {id, secret, ...}: an endpoint for
                                    alerts; the only time the secret is shown
    GET    /admin/webhooks          -> the endpoints (never their secrets)
    DELETE /admin/webhooks/{endpoint_id} -> the removed endpoint
    POST   /admin/reload            policies/ again (as SIGHUP does)
    GET    /admin/backends          every backend: health and load as this worker sees them

Records never include the key or its digest. Keys are revoked by id only: a raw key in a URL path
would end up in access logs (K3).

Every route needs `Authorization: Bearer <GATEWAY_ADMIN_TOKEN>`, or a valid JWT whose role claim is
`admin`. With the variable unset or empty the static token is off. Errors are raised as
GatewayError for the middleware to render.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import time
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import orjson
from aiohttp import web
from redis.exceptions import RedisError, ResponseError

from proxy.api.account import budget_view
from proxy.appkeys import KEYSTORE, KV_EVENTS, LEDGER, LIVE, REDIS, ROUTER, UPSTREAMS
from proxy.credits.alerts import Endpoint
from proxy.credits.budgets import budgets
from proxy.credits.idempotency import HEADER, reused, top_up_once
from proxy.credits.ledger import InsufficientCredits, MadeBefore
from proxy.credits.pricing import format_credits, parse_credits
from proxy.credits.webhooks import Webhooks
from proxy.errors import ErrorKind, GatewayError, store_unavailable, validation_failed
from proxy.http.body import read_json
from proxy.identity import apikeys
from proxy.identity.keystore import ACCOUNT_PATTERN, LABEL_MAX
from proxy.identity.principal import GUEST_TIER
from proxy.policy.live import PolicySnapshot
from proxy.upstream.fleet_state import STARTING
from proxy.upstream.pool import Backend
from proxy.validate import RequestInvalid, validate

__all__ = ["ADMIN_TOKEN_ENV", "AlertBody", "BudgetBody", "CreateKeyBody", "CreditBody",
           "WebhookBody", "admin_token_matches", "require_admin"]

ADMIN_TOKEN_ENV = "GATEWAY_ADMIN_TOKEN"
_BODY_CAP = 64 * 1024  # admin bodies are tiny
_ACCOUNT_RE = re.compile(ACCOUNT_PATTERN)
CREDITS_PATTERN = r"^-?[0-9]{1,9}(\.[0-9]{1,6})?$"
BUDGET_PATTERN = r"^[0-9]{1,9}(\.[0-9]{1,6})?$"
S = TypeVar("S", bound=msgspec.Struct)


class CreateKeyBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    account: Annotated[str, msgspec.Meta(pattern=ACCOUNT_PATTERN)]
    tier: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    label: Annotated[
        str, msgspec.Meta(max_length=LABEL_MAX, pattern="^[^\\x00-\\x1f\\x7f]*$")
    ] = ""


class CreditBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Credits as a decimal string, never a float; bounded so that the ledger's Lua arithmetic
    # (doubles) stays exact.
    amount: Annotated[str, msgspec.Meta(
        pattern=CREDITS_PATTERN,
        description="Credits, e.g. \"12.5\" (negative: an adjustment); at most 6 decimals")]
    reason: str = "top-up"  # kept to its first 200 characters


def admin_token_matches(header: str | None, token: str | None) -> bool:
    """True when `header` is `Bearer <token>` and a token is configured."""
    if not token or not header:
        return False
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return False
    # Hash both sides first so the comparison does not even reveal the token's length.
    ours = hashlib.sha256(token.encode()).digest()
    theirs = hashlib.sha256(given.strip().encode()).digest()
    return hmac.compare_digest(ours, theirs)


async def require_admin(request: web.Request) -> PolicySnapshot:
    """The one authorization rule of every /admin route: the static token (read per request,
    so it holds whatever the environment says now) or a valid admin-role JWT. The policy
    snapshot it judged by is the request's."""
    snapshot = request.app[LIVE].current
    if admin_token_matches(request.headers.get("Authorization"), os.environ.get(ADMIN_TOKEN_ENV)):
        return snapshot
    try:
        principal = await snapshot.auth.principal(request.headers, None)
    except GatewayError:
        principal = None
    if principal is not None and principal.kind == "jwt" and principal.role == "admin":
        return snapshot
    raise GatewayError(ErrorKind.INVALID_API_KEY, "admin credentials required",
                       headers={"WWW-Authenticate": "Bearer"})


async def create_key(request: web.Request) -> web.Response:
    snapshot = await require_admin(request)
    spec = _body(await read_json(request, _BODY_CAP), CreateKeyBody)
    tiers = set(snapshot.policies.tiers.tiers) - {GUEST_TIER}
    if spec.tier not in tiers:
        names = ", ".join(repr(t) for t in sorted(tiers))
        raise validation_failed([{"loc": ["body", "tier"], "msg": f"Input should be {names}",
                                  "type": "literal_error"}])
    raw, record = await request.app[KEYSTORE].create(spec.account, spec.tier, spec.label)
    return _json({"key": raw, **record.public()}, status=201,
                 headers={"Cache-Control": "no-store"})


async def list_keys(request: web.Request) -> web.Response:
    await require_admin(request)
    account = request.query.get("account") or None
    records = await request.app[KEYSTORE].list(account)
    return _json({"object": "list", "data": [r.public() for r in records]})


async def revoke_key(request: web.Request) -> web.Response:
    await require_admin(request)
    key_id = request.match_info["key_id"]
    store = request.app[KEYSTORE]
    record = await store.revoke(key_id) if apikeys.is_key_id(key_id) else None
    if record is None:
        raise GatewayError(ErrorKind.NOT_FOUND, "no such key id")
    return _json(record.public())


async def show_account(request: web.Request) -> web.Response:
    await require_admin(request)
    view = await request.app[KEYSTORE].account(request.match_info["account"])
    if view is None:
        raise GatewayError(ErrorKind.NOT_FOUND, "no such account")
    return _json(view.public())


async def add_credits(request: web.Request) -> web.Response:
    """A top-up, or a negative adjustment; journaled like any charge. With `Idempotency-Key`,
    made once per key (24 h): a retry gets the first answer, another body under it a 422."""
    await require_admin(request)
    spec = _body(await read_json(request, _BODY_CAP), CreditBody)
    try:
        micro = parse_credits(spec.amount)
    except ValueError as exc:
        raise validation_failed([{"loc": ["body", "amount"], "msg": str(exc),
                                  "type": "value_error"}]) from None
    account_id = _account_id(request)
    once = top_up_once(account_id, request.headers.get(HEADER), micro, spec.reason)
    added = {"account": account_id, "added": _money(micro)}
    try:
        available = await request.app[LEDGER].credit(
            account_id, micro, {"reason": spec.reason[:200], "actor": "admin-api",
                                "ts": int(time.time())}, once=once)
    except MadeBefore as made:
        if (left := made.args[0]) is None:
            raise reused() from None
        return _json({**added, "available": _money(left)}, status=201,
                     headers={"Idempotent-Replayed": "true"})
    except InsufficientCredits:  # the request is fine; the balance it meets is not
        raise GatewayError(ErrorKind.CONFLICT,
                           "the adjustment would take the balance below zero") from None
    except ResponseError as exc:
        if "overflow" not in str(exc):  # not the arithmetic: the store failing over under it
            raise store_unavailable("credit store") from None
        # Redis refused the arithmetic: a balance beyond what it holds
        raise GatewayError(ErrorKind.CONFLICT, "the balance cannot grow that large") from None
    except RedisError:
        raise store_unavailable("credit store") from None
    return _json({**added, "available": _money(available)}, status=201)


class BudgetBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    period: Literal["day", "week", "month"]
    amount: Annotated[str, msgspec.Meta(
        pattern=BUDGET_PATTERN,
        description="The cap in credits, e.g. \"50\" (\"0\": nothing may be spent); null "
                    "removes it")] | None
    key_id: Annotated[str | None, msgspec.Meta(
        description="A key of the account (its budget is at most the account's); null: the "
                    "account's")] = None
    postpaid: Annotated[bool | None, msgspec.Meta(
        description="true: no balance check, the account runs on its budgets alone")] = None


async def set_budget(request: web.Request) -> web.Response:
    """Set or remove one budget (and the postpaid flag); the account's budgets after."""
    await require_admin(request)
    spec = _body(await read_json(request, _BODY_CAP), BudgetBody)
    account_id = _account_id(request)
    micro = parse_credits(spec.amount) if spec.amount is not None else None
    ledger = request.app[LEDGER]
    try:
        if spec.key_id is not None:
            view = await request.app[KEYSTORE].account(account_id)
            if view is None or spec.key_id not in {k.id for k in view.keys}:
                raise GatewayError(ErrorKind.NOT_FOUND, "no such key in this account")
        try:
            await ledger.set_budget(account_id, spec.period, micro, spec.key_id)
        except ValueError as exc:
            raise GatewayError(ErrorKind.CONFLICT, str(exc)) from None
        if spec.postpaid is not None:
            await ledger.set_postpaid(account_id, spec.postpaid)
        caps, spent, held = await ledger.budgets(account_id)
    except RedisError:
        raise store_unavailable("credit store") from None
    return _json({"account": account_id, "postpaid": caps.get("postpaid") == "1",
                  "budgets": [budget_view(b) for b in budgets(caps, spent, held, time.time())]},
                 status=201)


class AlertBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    below: Annotated[str, msgspec.Meta(
        pattern=BUDGET_PATTERN,
        description="Alert when the balance falls under this many credits; null: never")] | None


class WebhookBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    url: Annotated[str, msgspec.Meta(pattern=r"^https?://[^\x00-\x20\x7f/?#]+([/?#][^\x00-\x20\x7f]*)?$",
                                     max_length=2048,
                                     description="Where alerts are POSTed")]
    account: Annotated[str, msgspec.Meta(
        pattern=ACCOUNT_PATTERN, description="Only this account's alerts; null: every "
                                             "account's")] | None = None


def _endpoint(endpoint: Endpoint) -> dict[str, Any]:
    return {"id": endpoint.id, "url": endpoint.url,
            "account": None if endpoint.account == "*" else endpoint.account,
            "created": endpoint.created}


async def set_alert(request: web.Request) -> web.Response:
    """Set (or, with null, remove) the balance under which the account is alerted."""
    await require_admin(request)
    spec = _body(await read_json(request, _BODY_CAP), AlertBody)
    account_id = _account_id(request)
    micro = parse_credits(spec.below) if spec.below is not None else None
    try:
        await request.app[LEDGER].set_alert_below(account_id, micro)
    except RedisError:
        raise store_unavailable("credit store") from None
    return _json({"account": account_id, "below": _money(micro) if micro is not None else None},
                 status=201)


async def list_alerts(request: web.Request) -> web.Response:
    """The account's newest alerts (`?limit=`, at most 100) and each endpoint's delivery."""
    await require_admin(request)
    account_id = _account_id(request)
    limit = query_count(request, "limit", 20, 100)
    try:
        alerts = await Webhooks(request.app[REDIS]).alerts(account_id, limit)
    except RedisError:
        raise store_unavailable("credit store") from None
    return _json({"object": "list", "data": [
        {**a.body, "due": a.due, "deliveries": {
            endpoint: {"state": d.state, "attempts": d.attempts, "last": d.last or None}
            for endpoint, d in sorted(a.deliveries.items())}} for a in alerts]})


async def add_webhook(request: web.Request) -> web.Response:
    await require_admin(request)
    spec = _body(await read_json(request, _BODY_CAP), WebhookBody)
    try:
        endpoint = await Webhooks(request.app[REDIS]).add(spec.url, spec.account)
    except RedisError:
        raise store_unavailable("credit store") from None
    return _json({**_endpoint(endpoint), "secret": endpoint.secret}, status=201,
                 headers={"Cache-Control": "no-store"})


async def list_webhooks(request: web.Request) -> web.Response:
    await require_admin(request)
    try:
        endpoints = await Webhooks(request.app[REDIS]).endpoints()
    except RedisError:
        raise store_unavailable("credit store") from None
    return _json({"object": "list", "data": [_endpoint(e) for e in endpoints]})


async def remove_webhook(request: web.Request) -> web.Response:
    await require_admin(request)
    try:
        removed = await Webhooks(request.app[REDIS]).remove(request.match_info["endpoint_id"])
    except RedisError:
        raise store_unavailable("credit store") from None
    if removed is None:
        raise GatewayError(ErrorKind.NOT_FOUND, "no such webhook endpoint")
    return _json(_endpoint(removed))


_COUNT = re.compile(r"[0-9]{1,3}")  # ASCII digits only, and few: int() of them is safe


def query_count(request: web.Request, name: str, default: int, most: int) -> int:
    """A `?name=N` count, 1 to `most` (`default` when absent); 422 otherwise."""
    text = request.query.get(name)
    if text is None:
        return default
    if not (_COUNT.fullmatch(text) and 1 <= int(text) <= most):
        raise validation_failed([{"loc": ["query", name], "msg": f"an integer 1-{most}",
                                  "type": "int_parsing"}])
    return int(text)


def _account_id(request: web.Request) -> str:
    account_id = request.match_info["account"]
    if not _ACCOUNT_RE.fullmatch(account_id):  # as keys create requires
        raise validation_failed([{"loc": ["path", "account"],
                                  "msg": f"String should match pattern '{ACCOUNT_PATTERN}'",
                                  "type": "string_pattern_mismatch"}])
    return account_id


async def reload_policies(request: web.Request) -> web.Response:
    """Reload policies/ (as SIGHUP does) here, then in every other worker and gateway sharing
    the Redis; a bad file is refused and the old policy stays."""
    await require_admin(request)
    live = request.app[LIVE]
    problems = live.reload()
    if problems:
        raise GatewayError(ErrorKind.VALIDATION_ERROR,
                           "policy reload refused: " + "; ".join(problems))
    try:
        await live.announce(request.app[REDIS])
    except RedisError:
        raise store_unavailable("policy channel") from None
    return _json({"status": "reloaded", "version": live.current.version})


async def list_backends(request: web.Request) -> web.Response:
    """Every backend as this worker sees it (health and load are per worker; the supervisor's
    state, pid and restarts are the master's)."""
    await require_admin(request)
    backends = request.app[ROUTER].backends
    dispatcher = request.app[UPSTREAMS].dispatcher
    in_use = await dispatcher.in_flight()
    followers = request.app[KV_EVENTS].followers  # what each engine said of its KV cache
    # The gateway's queue: requests waiting for a slot in this worker, by pool and tier.
    # The "prefix" pools' picture of their replicas' caches, in this worker.
    prefix = {pool.key: pool.index.view() for pool in request.app[ROUTER].prefix_pools
              if pool.index is not None}
    return _json({"object": "list", "worker_pid": os.getpid(), "queues": dispatcher.waiting(),
                  "prefix_index": prefix,
                  "data": [{**backend_view(b), "slots": {
                      "max": b.slots, "batch": b.batch,
                      "in_use": None if in_use is None else in_use.get(b.name, 0),
                      "spare": dispatcher.spares.kept(b.name)},
                      **({"kv_events": events.view()}
                         if (events := followers.get(b.name)) is not None else {})}
                      for b in backends]})


def backend_view(backend: Backend) -> dict[str, Any]:
    health = backend.health
    now = time.monotonic()
    ejected_until = None
    if health.ejected_until is not None:  # monotonic -> unix time, for people
        ejected_until = round(time.time() + (health.ejected_until - now), 3)
    record = backend.record
    if backend.supervised:
        state = record.state if record is not None else STARTING
    else:
        state = "unhealthy" if health.probe_down else "ready"
    last = health.last_probe
    load = backend.load(time.time())
    return {
        "name": backend.name,
        "kind": backend.spec.kind,
        "family": backend.spec.serves,
        "url": backend.base_url,
        "models": list(backend.spec.models),
        "supervised": backend.supervised,
        "state": state,
        "healthy": backend.healthy,
        "ejected_until": ejected_until,
        "half_open": health.half_open(now),
        "consecutive_failures": health.consecutive_failures,
        "outstanding": backend.outstanding,
        "restarts": record.restarts if record is not None else 0,
        "pid": record.pid if record is not None else None,
        "last_probe": {"kind": last[0].value, "ok": last[1]} if last is not None else None,
        "max_model_len": dict(backend.max_model_len),  # as the engine reports it (vLLM, TEI)
        "batch_inputs": backend.batch_inputs,  # TEI: the inputs one request may carry
        # The engine's own load as the master last read it (null: not vLLM/TGI, or stale).
        "engine": None if load is None else {
            "waiting": load.waiting, "running": load.running, "kv_cache_usage": load.kv,
            "age_s": round(time.time() - load.at, 3)},
        # Its prefill price, fitted from its engine's figures (null: none yet; vLLM only).
        "prefill": None if (fit := backend.prefill).per_token_s is None else {
            "ms_per_1k_tokens": round(fit.per_token_s * 1e6, 1),
            "fixed_ms": round((fit.fixed_s or 0.0) * 1e3, 1)},
    }


def _body(body: dict[str, Any], schema: type[S]) -> S:
    try:
        return validate(body, schema)
    except RequestInvalid as exc:
        raise validation_failed(exc.detail) from None


def _money(micro: int) -> dict[str, Any]:
    return {"credits": format_credits(micro), "micro_credits": micro}


def _json(body: dict[str, Any], *, status: int = 200,
          headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, headers=headers,
                        content_type="application/json")

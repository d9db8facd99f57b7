"""The admin HTTP API: issue, list and revoke API keys, and look at accounts.

    POST   /admin/keys              {account, tier, label?} -> 201 {key, id, ...}; the only time
                                    the key is ever shown (sent with Cache-Control: no-store)
    GET    /admin/keys[?account=A]  -> {object: "list", data: [record...]}
    DELETE /admin/keys/{key_id}     -> the revoked record
    GET    /admin/accounts/{account} -> {account, keys: [record...]}

Records never include the key or its digest. Keys are revoked by id only: a raw key in a URL path
would end up in access logs (K3).

Every route needs `Authorization: Bearer <GATEWAY_ADMIN_TOKEN>`. With the variable unset or empty
the static token is off, so every request is refused unless `extra_check` (the hook for admin-role
JWTs) admits it. Errors are raised as GatewayError for the gateway's middleware to render.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, Set
from typing import Annotated, Any

import msgspec
import orjson
from aiohttp import web

from proxy import apikeys
from proxy.admin_cli import DEFAULT_TIERS, known_tiers
from proxy.appkeys import CONFIG, LIVE
from proxy.errors import ErrorKind, GatewayError, validation_failed
from proxy.keystore import ACCOUNT_PATTERN, LABEL_MAX, KeyStore
from proxy.request_body import parse_json_object, read_capped
from proxy.validate import RequestInvalid, validate

__all__ = ["ADMIN_TOKEN_ENV", "CreateKeyBody", "add_admin_routes", "admin_token_matches"]

ADMIN_TOKEN_ENV = "GATEWAY_ADMIN_TOKEN"

ExtraCheck = Callable[[web.Request], Awaitable[bool]]
TierSource = Callable[[web.Request], Set[str]]


class CreateKeyBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    account: Annotated[str, msgspec.Meta(pattern=ACCOUNT_PATTERN)]
    tier: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    label: Annotated[
        str, msgspec.Meta(max_length=LABEL_MAX, pattern="^[^\\x00-\\x1f\\x7f]*$")
    ] = ""


_BODY_CAP = 64 * 1024  # admin bodies are tiny


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


def _config_tiers(request: web.Request) -> Set[str]:
    config = request.app.get(CONFIG)
    return known_tiers(config) if config is not None else DEFAULT_TIERS


async def require_admin(request: web.Request) -> None:
    """The one authorization rule of every /admin route (static token or admin-role JWT)."""
    await request.app[ADMIN].authorize(request)


class _AdminRoutes:
    def __init__(self, store_key: web.AppKey[KeyStore], extra_check: ExtraCheck | None,
                 tiers: TierSource) -> None:
        self.store_key = store_key
        self.extra_check = extra_check
        self.tiers = tiers

    async def authorize(self, request: web.Request) -> None:
        # Read per request (a dict lookup), so it holds whatever the environment says now.
        header = request.headers.get("Authorization")
        if admin_token_matches(header, os.environ.get(ADMIN_TOKEN_ENV)):
            return
        if self.extra_check is not None and await self.extra_check(request):
            return
        raise GatewayError(ErrorKind.INVALID_API_KEY, "admin credentials required",
                           headers={"WWW-Authenticate": "Bearer"})

    def store(self, request: web.Request) -> KeyStore:
        return request.app[self.store_key]

    async def create_key(self, request: web.Request) -> web.Response:
        await self.authorize(request)
        body = await _json_object(request)
        try:
            spec = validate(body, CreateKeyBody)
        except RequestInvalid as exc:
            raise validation_failed(exc.detail) from None
        tiers = self.tiers(request)
        if spec.tier not in tiers:
            names = ", ".join(repr(t) for t in sorted(tiers))
            raise validation_failed([{"loc": ["body", "tier"], "msg": f"Input should be {names}",
                                      "type": "literal_error"}])
        raw, record = await self.store(request).create(spec.account, spec.tier, spec.label)
        return _json({"key": raw, **record.public()}, status=201,
                     headers={"Cache-Control": "no-store"})

    async def list_keys(self, request: web.Request) -> web.Response:
        await self.authorize(request)
        account = request.query.get("account") or None
        records = await self.store(request).list(account)
        return _json({"object": "list", "data": [r.public() for r in records]})

    async def revoke_key(self, request: web.Request) -> web.Response:
        await self.authorize(request)
        key_id = request.match_info["key_id"]
        record = await self.store(request).revoke(key_id) if apikeys.is_key_id(key_id) else None
        if record is None:
            raise GatewayError(ErrorKind.NOT_FOUND, "no such key id")
        return _json(record.public())

    async def reload_policies(self, request: web.Request) -> web.Response:
        """Reload policies/ (as SIGHUP does); a bad file is refused and the old policy stays."""
        await self.authorize(request)
        live = request.app[LIVE]
        problems = live.reload()
        if problems:
            raise GatewayError(ErrorKind.VALIDATION_ERROR,
                               "policy reload refused: " + "; ".join(problems))
        return _json({"status": "reloaded", "version": live.current.version})

    async def show_account(self, request: web.Request) -> web.Response:
        await self.authorize(request)
        view = await self.store(request).account(request.match_info["account"])
        if view is None:
            raise GatewayError(ErrorKind.NOT_FOUND, "no such account")
        return _json(view.public())


ADMIN = web.AppKey("admin", _AdminRoutes)


def add_admin_routes(
    app: web.Application,
    keystore_key: web.AppKey[KeyStore],
    extra_check: ExtraCheck | None = None,
    *,
    tiers: TierSource = _config_tiers,
) -> None:
    """Mount the admin routes on `app`; the KeyStore is read from `app[keystore_key]`.

    `extra_check` may admit a request the static token does not (admin-role JWTs); `tiers`
    names the tiers a key may be issued for (default: `known_tiers` of the app's Config).
    """
    routes = _AdminRoutes(keystore_key, extra_check, tiers)
    app[ADMIN] = routes
    app.router.add_post("/admin/keys", routes.create_key)
    app.router.add_get("/admin/keys", routes.list_keys)
    app.router.add_delete("/admin/keys/{key_id}", routes.revoke_key)
    app.router.add_get("/admin/accounts/{account}", routes.show_account)
    app.router.add_post("/admin/reload", routes.reload_policies)


async def _json_object(request: web.Request) -> Any:
    return parse_json_object(await read_capped(request, _BODY_CAP))


def _json(body: dict[str, Any], *, status: int = 200,
          headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, headers=headers,
                        content_type="application/json")

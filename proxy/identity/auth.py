"""Who is calling: an API key, a signed JWT, or a guest known by client address.

- `X-API-Key: <key>` wins when both it and `Authorization` are sent (spec, Authentication 2).
- `Authorization: Bearer <token>` is accepted on every route: an API key (it has `_sk_`) or a
  JWT. (The spec leaves non-chat routes open; one rule everywhere is simpler for clients.)
- No credential at all: a guest, keyed by client address; `X-Forwarded-For` is believed only
  from trusted proxies. A credential that is present but invalid is 401, never a silent guest.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence

from redis.exceptions import RedisError

from proxy.config import AuthPolicy
from proxy.errors import ErrorKind, GatewayError, store_unavailable
from proxy.identity.apikeys import well_formed
from proxy.identity.jwt import InvalidToken, JwtVerifier, looks_like_jwt
from proxy.identity.keystore import KeyStore
from proxy.identity.principal import Principal

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

GUEST_TIER = "guest"


class Authenticator:
    def __init__(self, policy: AuthPolicy, keystore: KeyStore, jwt: JwtVerifier | None) -> None:
        self._prefix = policy.keys.prefix
        self._keystore = keystore
        self._jwt = jwt
        self._trusted: tuple[Network, ...] = tuple(
            ipaddress.ip_network(cidr, strict=False) for cidr in policy.clients.trusted_proxies
        )

    async def principal(self, headers: Mapping[str, str], peer: str | None) -> Principal:
        api_key = headers.get("X-API-Key")
        if api_key is not None:
            return await self._from_key(api_key.strip())
        authorization = headers.get("Authorization", "").strip()
        if authorization:
            scheme, _, token = authorization.partition(" ")
            token = token.strip()
            if scheme.lower() != "bearer":
                raise _unauthorized("unsupported Authorization scheme; use Bearer")
            if token:
                if "_sk_" in token:
                    return await self._from_key(token)
                return self._from_jwt(token)
        address = client_address(peer, headers.get("X-Forwarded-For"), self._trusted)
        return Principal(kind="guest", account=f"guest:{address}", tier=GUEST_TIER)

    async def _from_key(self, key: str) -> Principal:
        if not well_formed(key, self._prefix):
            raise _unauthorized("invalid API key")
        try:
            record = await self._keystore.lookup(key)
        except RedisError:
            # Not cached and the store is unreachable: we cannot tell who this is.
            raise store_unavailable("key store") from None
        if record is None:
            raise _unauthorized("invalid API key")
        if record.status != "active":
            raise _unauthorized("this API key has been revoked")
        return Principal(kind="key", account=record.account, tier=record.tier, key_id=record.id)

    def _from_jwt(self, token: str) -> Principal:
        if self._jwt is None or not self._jwt.enabled or not looks_like_jwt(token):
            raise _unauthorized("invalid bearer token")
        try:
            claims = self._jwt.verify(token)
        except InvalidToken as exc:
            raise _unauthorized(f"invalid bearer token: {exc.reason}") from None
        if not claims.tier:
            raise _unauthorized("invalid bearer token: it names no tier")
        return Principal(kind="jwt", account=claims.account, tier=claims.tier,
                         role=claims.role or "user")


def client_address(peer: str | None, forwarded_for: str | None,
                   trusted: Sequence[Network]) -> str:
    """The caller's address: the connection's peer, or, behind trusted proxies, the rightmost
    X-Forwarded-For entry that is not itself a trusted proxy (entries further left are
    client-supplied and could be forged)."""
    address = _parse(peer)
    if address is None:
        return peer or "unknown"
    if not forwarded_for or not _within(address, trusted):
        return str(address)
    for entry in reversed(forwarded_for.split(",")):
        hop = _parse(entry.strip())
        if hop is None:
            break
        address = hop
        if not _within(hop, trusted):
            break
    return str(address)


def _parse(value: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    if not value:
        return None
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return address.ipv4_mapped
    return address


def _within(address: ipaddress.IPv4Address | ipaddress.IPv6Address,
            networks: Sequence[Network]) -> bool:
    return any(address in network for network in networks)


def _unauthorized(message: str) -> GatewayError:
    return GatewayError(ErrorKind.INVALID_API_KEY, message)

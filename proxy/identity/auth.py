"""Who is calling: an API key, a signed JWT, or a guest known by client address.

- `X-API-Key: <key>` wins when both it and `Authorization` are sent (spec, Authentication 2).
- `Authorization: Bearer <token>` is accepted on every route: an API key (it has `_sk_`) or a
  JWT. (The spec leaves non-chat routes open; one rule everywhere is simpler for clients.)
- No credential at all: a guest, keyed by client address (IPv6 by its /64, configurable);
  `X-Forwarded-For` is believed only from trusted proxies. A credential that is present but
  invalid or empty is 401, never a silent guest.
- A key the worker has not cached costs a Redis read. A key this gateway made carries a seal
  (proxy.identity.apikeys) and is always looked up: a key that exists is served whatever else
  its address sent. Any other key (a stranger's guess, or a key made before seals) spends its
  client address's budget of unknown keys per minute (`key_lookups_per_minute`), past which it
  gets 429 without a read, so minted keys cannot flood Redis. Unknown keys are cached like
  known ones.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from limits import RateLimitItemPerMinute
from limits.aio.strategies import MovingWindowRateLimiter
from redis.exceptions import RedisError

from proxy.config import AuthPolicy
from proxy.errors import ErrorKind, GatewayError, store_unavailable
from proxy.identity.keystore import KeyRecord, KeyStore

if TYPE_CHECKING:  # PyJWT and cryptography load only where JWTs are configured (~10 MB)
    from proxy.identity.jwt import JwtVerifier
from proxy.identity.principal import GUEST_TIER, Principal

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class Authenticator:
    def __init__(self, policy: AuthPolicy, keystore: KeyStore, jwt: JwtVerifier | None,
                 lookups: MovingWindowRateLimiter) -> None:
        self._keystore = keystore
        self._jwt = jwt
        self._trusted: tuple[Network, ...] = tuple(
            ipaddress.ip_network(cidr, strict=False) for cidr in policy.clients.trusted_proxies
        )
        self._ipv6_prefix = policy.clients.ipv6_guest_prefix
        self._lookup_rate = RateLimitItemPerMinute(policy.clients.key_lookups_per_minute)
        self._lookups = lookups

    async def principal(self, headers: Mapping[str, str], peer: str | None) -> Principal:
        api_key = headers.get("X-API-Key")
        if api_key is not None:
            return await self._from_key(api_key.strip(), headers, peer)
        authorization = headers.get("Authorization")
        if authorization is not None:
            scheme, _, token = authorization.strip().partition(" ")
            token = token.strip()
            if scheme.lower() != "bearer":
                raise _unauthorized("unsupported Authorization scheme; use Bearer")
            if not token:  # a credential that is present but empty is not a guest
                raise _unauthorized("empty bearer token")
            if "_sk_" in token:
                return await self._from_key(token, headers, peer)
            return self._from_jwt(token)
        return Principal(kind="guest", account=f"guest:{self._guest_bucket(headers, peer)}",
                         tier=GUEST_TIER)

    def _guest_bucket(self, headers: Mapping[str, str], peer: str | None) -> str:
        address = client_address(peer, headers.get("X-Forwarded-For"), self._trusted)
        parsed = _parse(address)
        if isinstance(parsed, ipaddress.IPv6Address) and self._ipv6_prefix < 128:
            return str(ipaddress.IPv6Network((parsed, self._ipv6_prefix), strict=False))
        return address

    async def _from_key(self, key: str, headers: Mapping[str, str], peer: str | None
                        ) -> Principal:
        found, record = self._keystore.cached(key)  # a malformed key: found, no record
        try:
            if not found:
                record = await self._read_key(key, headers, peer)
        except RedisError:
            # Not cached and the store is unreachable: we cannot tell who this is.
            raise store_unavailable("key store") from None
        if record is None:
            raise _unauthorized("invalid API key")
        if record.status != "active":
            raise _unauthorized("this API key has been revoked")
        return Principal(kind="key", account=record.account, tier=record.tier, key_id=record.id)

    async def _read_key(self, key: str, headers: Mapping[str, str], peer: str | None
                        ) -> KeyRecord | None:
        """Ask the store: at once for a sealed key; else within the address's budget of unknown
        keys, past which there are no more reads (429) until the window frees up. Known keys
        never spend the budget."""
        if await self._keystore.vouches_for(key):
            return await self._keystore.lookup(key)
        bucket = self._guest_bucket(headers, peer)
        if not await self._lookups.test(self._lookup_rate, "unknown-keys", bucket):
            raise GatewayError(ErrorKind.RATE_LIMITED, "too many unknown API keys from this "
                               "address; retry in 60 s", headers={"Retry-After": "60"})
        record = await self._keystore.lookup(key)
        if record is None:
            await self._lookups.hit(self._lookup_rate, "unknown-keys", bucket)
        return record

    def _from_jwt(self, token: str) -> Principal:
        if self._jwt is None or not self._jwt.enabled:
            raise _unauthorized("invalid bearer token")
        from proxy.identity.jwt import InvalidToken, looks_like_jwt

        if not looks_like_jwt(token):
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

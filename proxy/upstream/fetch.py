"""Fetching the audio a client names by URL (ASR `audio_url`, TTS `custom_voice.url`) under SSRF
rules (reliability.md §B.2.6, F1-F6).

A URL from a client must never make the gateway reach what the client cannot: loopback, the
private network, the cloud metadata address. Three places check, since each alone has a gap:

* `check_url`, before any I/O (F1, F3): scheme, userinfo, port, and hosts that are IP literals,
  in every form a resolver accepts (`127.1`, `0x7f.1`, `2130706433`, `[::ffff:127.0.0.1]`):
  aiohttp dials a literal without asking the resolver.
* `GuardResolver`, inside the connector (F2): every address a name resolves to must be allowed,
  or the whole answer is refused, so the address checked is the address dialled (no DNS
  rebinding between a check and the connect); no DNS cache, no pooled connection to skip it.
* `MediaFetcher.fetch` follows redirects by hand, each hop checked again (F4).

The session ignores proxy variables (F5: a proxy would resolve the name beyond our check) and
cookies. Every failure is one `FetchRefused` whose public text never varies (F6), so the gateway
cannot be used to probe which hosts exist; `reason` is for logs and never holds a query string.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import hdrs
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver
from yarl import URL

from proxy.config import FetchPolicy

PUBLIC_MESSAGE = "the audio could not be fetched from this URL"
USER_AGENT = "inference-gateway"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_PER_HOST = 4  # concurrent connections to one host
# Refused whatever this Python's `is_global` tables say (they changed across 3.11 patches).
_REFUSED = tuple(ipaddress.ip_network(net) for net in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.168.0.0/16", "224.0.0.0/4", "240.0.0.0/4", "::/128", "::1/128", "fc00::/7",
    "fe80::/10", "ff00::/8",
))
_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*\.?")
_NUMBER = re.compile(r"0x[0-9a-f]+|[0-9]+")
# Besides audio/*: containers that carry audio, and what servers say when they do not know.
_AUDIO_TYPES = frozenset({
    "video/webm", "video/mp4", "video/ogg", "application/ogg", "application/octet-stream",
    "binary/octet-stream",
})


@dataclass(frozen=True, slots=True)
class FetchRules:
    max_bytes: int = 25 * 1024 * 1024
    connect_timeout_s: float = 3.0
    total_timeout_s: float = 20.0  # all hops and the body
    max_redirects: int = 3
    ports: frozenset[int] = frozenset({80, 443})  # allowed, explicit or implied by the scheme
    allow_networks: tuple[str, ...] = ()  # CIDRs allowed although not global, "10.1.2.0/24"

    def __post_init__(self) -> None:
        _networks(self.allow_networks)  # a bad CIDR fails at configuration time, not per fetch


def rules_from(policy: FetchPolicy) -> FetchRules:
    return FetchRules(max_bytes=policy.max_bytes, connect_timeout_s=policy.connect_timeout_s,
                      total_timeout_s=policy.timeout_s, max_redirects=policy.max_redirects,
                      ports=frozenset(policy.ports), allow_networks=tuple(policy.allow_networks))


class FetchRefused(Exception):
    """Any failure to get the media. `str(exc)` is always PUBLIC_MESSAGE, for blocked,
    unreachable, too big, too slow, wrong type or bad status alike (F6); `reason` is for logs
    only: it may name the host, never the query string."""

    def __init__(self, reason: str) -> None:
        super().__init__(PUBLIC_MESSAGE)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Fetched:
    data: bytes
    content_type: str  # media type as sent: lowercased, without parameters
    url: str  # final URL after redirects, without its query (for logs)


def is_audio_media_type(content_type: str) -> bool:
    """The default `accept`: audio/*, audio-carrying containers, or untyped bytes."""
    return (content_type.startswith("audio/") and len(content_type) > 6) \
        or content_type in _AUDIO_TYPES


@functools.lru_cache(maxsize=32)
def _networks(cidrs: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(cidr, strict=False) for cidr in cidrs)


def _is_public(addr: IPAddress) -> bool:
    return addr.is_global and not (
        addr.is_private or addr.is_loopback or addr.is_link_local or addr.is_multicast
        or addr.is_reserved or addr.is_unspecified or any(addr in net for net in _REFUSED)
    )


def address_allowed(ip: str, rules: FetchRules) -> bool:
    """Global, or inside one of `rules.allow_networks`. An IPv6 address that carries an IPv4
    one (mapped ::ffff:a.b.c.d, 6to4 2002::/16, Teredo) is judged by that too, since that is
    where a packet may end up: ::ffff:127.0.0.1 is loopback, 2002:7f00:1:: is "global"."""
    try:
        addr: IPAddress = ipaddress.ip_address(ip)
    except ValueError:
        return False
    judged: list[IPAddress] = [addr]
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            judged = [addr.ipv4_mapped]
        elif addr.sixtofour is not None:
            judged.append(addr.sixtofour)
        elif addr.teredo is not None:
            judged.append(addr.teredo[1])
    allowed = _networks(rules.allow_networks)
    return all(_is_public(a) or any(a in net for net in allowed) for a in judged)


def _literal_address(host: str) -> IPAddress | None:
    """The address an IP-literal host names, None for a name; ValueError for neither.

    A host whose last label is a number is an IPv4 literal in some form (WHATWG URL "ends in a
    number"): inet_aton, which getaddrinfo uses, reads 127.1, 0x7f.1, 0177.0.0.1 and 2130706433
    as 127.0.0.1, and yarl passes them through unchanged. Read them the same way here.
    """
    if ":" in host:
        return ipaddress.ip_address(host)  # yarl has removed the brackets
    if not _NAME.fullmatch(host):
        raise ValueError("not a host name")
    labels = host.removesuffix(".").split(".")
    if not _NUMBER.fullmatch(labels[-1]):
        return None
    if len(labels) > 4 or not all(_NUMBER.fullmatch(label) for label in labels):
        raise ValueError("a numeric host that is no IPv4 address")
    numbers = [int(p, 16) if p.startswith("0x") else int(p, 8) if p[0] == "0" else int(p)
               for p in labels]
    *head, last = numbers
    if any(n > 255 for n in head) or last >= 256 ** (5 - len(numbers)):
        raise ValueError("an IPv4 part out of range")
    return ipaddress.IPv4Address(sum(n << 8 * (3 - i) for i, n in enumerate(head)) + last)


def _check(url: URL, rules: FetchRules) -> URL:
    if url.scheme not in ("http", "https"):
        raise FetchRefused(f"scheme {url.scheme!r} is not allowed")
    host = (url.raw_host or "").lower()
    if not url.is_absolute() or not host:
        raise FetchRefused("the URL has no host")
    if url.raw_user is not None or url.raw_password is not None:
        raise FetchRefused(f"the URL for {host} carries credentials")
    if url.port not in rules.ports:
        raise FetchRefused(f"port {url.port} of {host} is not allowed")
    try:
        literal = _literal_address(host)
    except ValueError:
        raise FetchRefused(f"host {host!r} is malformed") from None
    if literal is None and host.removesuffix(".").split(".")[-1] == "localhost":
        raise FetchRefused(f"host {host!r} is local")
    if literal is not None and not address_allowed(str(literal), rules):
        raise FetchRefused(f"address {host} is not allowed")
    return url.with_fragment(None)


def check_url(url: str, rules: FetchRules) -> URL:
    """Static checks, no I/O (F1, F3); the URL to request, without its fragment."""
    try:
        parsed = URL(url)
    except (ValueError, TypeError):
        raise FetchRefused("the URL does not parse") from None
    return _check(parsed, rules)


class _Blocked(OSError):
    """Raised by the resolver: aiohttp turns an OSError from it into ClientConnectorDNSError."""


class GuardResolver(AbstractResolver):
    """Resolves with `inner`, then refuses the whole answer if any address is not allowed (F2)."""

    def __init__(self, inner: AbstractResolver, rules: FetchRules) -> None:
        self._inner = inner
        self.rules = rules

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        answer = await self._inner.resolve(host, port, family)
        if not answer:
            raise _Blocked(f"{host} resolved to no address")
        if any(not address_allowed(result["host"], self.rules) for result in answer):
            raise _Blocked(f"{host} resolved to an address that is not allowed")
        return answer

    async def close(self) -> None:
        await self._inner.close()


class MediaFetcher:
    """One session for client-named media; create it inside the running event loop."""

    def __init__(self, rules: FetchRules, resolver: AbstractResolver | None = None) -> None:
        self.rules = rules
        self._policy: FetchPolicy | None = None
        self._own_resolver = resolver is None
        self._guard = GuardResolver(resolver or DefaultResolver(), rules)
        self._session = aiohttp.ClientSession(
            # One-off fetches: no connection reuse (each fetch resolves, so is checked, again).
            connector=aiohttp.TCPConnector(resolver=self._guard, use_dns_cache=False,
                                           force_close=True, limit_per_host=_PER_HOST),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=rules.connect_timeout_s),
            headers={hdrs.USER_AGENT: USER_AGENT},
            trust_env=False,  # F5
            cookie_jar=aiohttp.DummyCookieJar(),  # nothing carried from one hop to the next
        )

    def follow(self, policy: FetchPolicy) -> None:
        """Fetch under `policy` (requests.toml [fetch]) from now on: a policy reload applies to
        the next fetch."""
        if policy is not self._policy:
            self._policy = policy
            self.rules = self._guard.rules = rules_from(policy)

    async def close(self) -> None:
        await self._session.close()
        if self._own_resolver:
            await self._guard.close()

    async def fetch(self, url: str, *, accept: Callable[[str], bool] | None = None,
                    max_bytes: int | None = None) -> Fetched:
        """GET the media at `url`, following up to `max_redirects` redirects, all within
        `total_timeout_s`; its media type must satisfy `accept` (default: is_audio_media_type);
        at most `max_bytes` when given (and never more than the rules' `max_bytes`).
        Raises FetchRefused and nothing else (cancellation apart)."""
        cap = self.rules.max_bytes if max_bytes is None else min(max_bytes, self.rules.max_bytes)
        try:
            async with asyncio.timeout(self.rules.total_timeout_s):
                return await self._follow(check_url(url, self.rules),
                                          accept or is_audio_media_type, cap)
        except FetchRefused:
            raise
        except TimeoutError:
            raise FetchRefused("no complete answer before the deadline") from None
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.os_error, _Blocked):
                raise FetchRefused(str(exc.os_error)) from None
            raise FetchRefused(f"could not connect to {exc.host}:{exc.port}") from None
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            # Exception texts may quote the URL with its query: keep only the type.
            raise FetchRefused(f"the fetch failed: {type(exc).__name__}") from None

    async def _follow(self, url: URL, accept: Callable[[str], bool], cap: int) -> Fetched:
        for _ in range(self.rules.max_redirects + 1):
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.rules.connect_timeout_s)
            async with self._session.get(url, allow_redirects=False,
                                         timeout=timeout) as response:
                try:
                    if response.status not in _REDIRECTS:
                        return await self._read(url, response, accept, cap)
                    location = response.headers.get(hdrs.LOCATION)
                    if not location:
                        raise FetchRefused(f"a redirect from {url.host} without a Location")
                    url = _check(url.join(URL(location)), self.rules)
                finally:
                    response.close()  # drops an unread body; force_close anyway
        raise FetchRefused(f"more than {self.rules.max_redirects} redirects")

    async def _read(self, url: URL, response: aiohttp.ClientResponse,
                    accept: Callable[[str], bool], cap: int) -> Fetched:
        """The body, counted as it arrives: read at most the cap plus one chunk (I1, F6).

        Both counts are capped: decoded bytes (a small gzip body may inflate to gigabytes;
        aiohttp inflates one read buffer at a time) and bytes on the wire (a compressed stream
        may also send much and yield little).
        """
        host = url.host
        if response.status != 200:
            raise FetchRefused(f"{host} answered HTTP {response.status}")
        media = response.headers.get(hdrs.CONTENT_TYPE, "").split(";")[0].strip().lower()
        if not accept(media):
            raise FetchRefused(f"{host} sent media type {media!r}")
        if response.content_length is not None and response.content_length > cap:
            raise FetchRefused(f"{host} announced {response.content_length} bytes, over {cap}")
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.content.iter_any():
            size += len(chunk)
            if size > cap or response.content.total_raw_bytes > cap:
                raise FetchRefused(f"the body from {host} passed {cap} bytes")
            chunks.append(chunk)
        if response.content.total_raw_bytes > cap:  # all of it inflated to nothing
            raise FetchRefused(f"the body from {host} passed {cap} bytes")
        return Fetched(b"".join(chunks), media, str(url.with_query(None)))

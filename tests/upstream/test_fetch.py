"""SSRF rules for client-named media (reliability.md §B.2.6 F1-F6), against real loopback servers.

127.0.0.2 plays the operator-allowed audio host (`allow_networks=("127.0.0.2/32",)`);
127.0.0.1 plays the internal network, a server that counts requests and must see none. The
internal port is in `rules.ports`, so only the address check stands between a URL and it.
Every refusal is asserted through `str(exc) == PUBLIC_MESSAGE` (F6); `exc.reason` is for logs.
"""

from __future__ import annotations

import asyncio
import gzip
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.test_utils import TestServer

from proxy.upstream.fetch import (
    PUBLIC_MESSAGE,
    FetchRefused,
    FetchRules,
    GuardResolver,
    MediaFetcher,
    address_allowed,
    check_url,
    is_audio_media_type,
)

WAV = b"RIFF\x24\x08\x00\x00WAVEfmt " + bytes(range(256)) * 3
ServerFactory = Callable[..., Awaitable[TestServer]]


@dataclass
class Seen:
    """What a test server saw."""

    requests: list[web.Request] = field(default_factory=list)
    sent: int = 0
    dropped: bool = False
    completed: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)


class StubResolver(AbstractResolver):
    """Answers from a table (a list per call, the last one repeating); counts the calls."""

    def __init__(self, answers: dict[str, list[list[str]]]) -> None:
        self.answers = answers
        self.calls: list[str] = []

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        self.calls.append(host)
        if host not in self.answers:
            raise OSError(f"no such host {host}")
        options = self.answers[host]
        ips = options[min(self.calls.count(host), len(options)) - 1]
        return [ResolveResult(hostname=host, host=ip, port=port,
                              family=socket.AF_INET6 if ":" in ip else socket.AF_INET, proto=0,
                              flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV)
                for ip in ips]

    async def close(self) -> None:
        pass


def recorder(seen: Seen) -> web.Application:
    async def any_request(request: web.Request) -> web.Response:
        seen.requests.append(request)
        return web.Response(body=WAV, content_type="audio/wav")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_request)
    return app


@pytest.fixture
async def internal(aiohttp_server: ServerFactory) -> AsyncIterator[tuple[TestServer, Seen]]:
    """The internal service on 127.0.0.1: it would answer anything, and must be asked nothing."""
    seen = Seen()
    server = await aiohttp_server(recorder(seen), host="127.0.0.1")
    yield server, seen
    assert seen.requests == []


def media_app(seen: Seen, internal_port: int) -> web.Application:
    async def audio(request: web.Request) -> web.Response:
        seen.requests.append(request)
        return web.Response(body=WAV, content_type="audio/wav")

    async def redirect(request: web.Request) -> web.Response:
        targets = {"internal": f"http://127.0.0.1:{internal_port}/secret",
                   "metadata": "http://169.254.169.254/latest/meta-data",
                   "relative": "../audio.wav?sig=1", "cookie": "/headers"}
        response = web.Response(status=302, headers={"Location": targets[request.match_info["to"]]})
        response.set_cookie("session", "s3cr3t")
        return response

    async def chain(request: web.Request) -> web.Response:
        left = int(request.match_info["n"])  # redirects still to come
        location = f"/chain/{left - 1}" if left > 1 else "/audio.wav"
        return web.Response(status=307, headers={"Location": location})

    async def headers(request: web.Request) -> web.Response:
        seen.requests.append(request)
        return web.Response(body=WAV, content_type="audio/wav")

    async def stream(request: web.Request) -> web.StreamResponse:
        """10 MiB in 64 KiB chunks without Content-Length, or `?drip=1`: a byte per 0.2 s."""
        drip = "drip" in request.query
        response = web.StreamResponse(headers={"Content-Type": "audio/wav"})
        if drip:
            response.content_length = 100
        await response.prepare(request)
        try:
            for _ in range(100 if drip else 160):
                chunk = b"\0" if drip else b"\0" * 65536
                await response.write(chunk)
                seen.sent += len(chunk)
                await asyncio.sleep(0.2 if drip else 0)
            await response.write_eof()
            seen.completed = True
        except ConnectionError:  # a write to the closed connection
            seen.dropped = True
        except asyncio.CancelledError:  # aiohttp cancels a handler whose client went away
            seen.dropped = True
            raise
        finally:
            seen.done.set()
        return response

    async def fixed(request: web.Request) -> web.Response:
        kind = request.match_info["kind"]
        if kind == "html":
            return web.Response(text="<html>login</html>", content_type="text/html")
        if kind == "missing":
            return web.Response(status=404, body=WAV, content_type="audio/wav")
        if kind == "announced":  # Content-Length says 5000: refused before reading
            return web.Response(body=b"\0" * 5000, content_type="audio/wav")
        if kind == "untyped":  # aiohttp always sends a Content-Type: send a malformed one
            return web.Response(body=WAV, headers={"Content-Type": "audio"})
        size = {"gzip-bomb": 5_000_000, "gzip-small": 20_000}[kind]
        body = gzip.compress(WAV + b"\0" * (size - len(WAV)))
        return web.Response(body=body, headers={"Content-Encoding": "gzip",
                                                "Content-Type": "audio/wav; rate=16000"})

    async def empty_members(request: web.Request) -> web.StreamResponse:
        """gzip members that inflate to nothing: bytes on the wire, none decoded."""
        response = web.StreamResponse(headers={"Content-Encoding": "gzip",
                                               "Content-Type": "audio/wav"})
        await response.prepare(request)
        await response.write(gzip.compress(b"") * 200)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/audio.wav", audio)
    app.router.add_get("/sub/audio.wav", audio)
    app.router.add_get("/redirect/{to}", redirect)
    app.router.add_get("/sub/redirect/{to}", redirect)
    app.router.add_get("/chain/{n}", chain)
    app.router.add_get("/headers", headers)
    app.router.add_get("/stream", stream)
    app.router.add_get("/fixed/{kind}", fixed)
    app.router.add_get("/empty-members", empty_members)
    return app


@dataclass
class Env:
    base: str  # http://127.0.0.2:<port>
    media_port: int
    internal_port: int
    seen: Seen
    rules: FetchRules
    fetcher: Callable[..., MediaFetcher]


@pytest.fixture
async def env(aiohttp_server: ServerFactory, internal: tuple[TestServer, Seen]
              ) -> AsyncIterator[Env]:
    seen = Seen()
    internal_port = internal[0].port
    assert internal_port is not None
    media = await aiohttp_server(media_app(seen, internal_port), host="127.0.0.2")
    assert media.port is not None
    rules = FetchRules(max_bytes=1000, total_timeout_s=1.0, allow_networks=("127.0.0.2/32",),
                       ports=frozenset({80, 443, media.port, internal_port}))
    made: list[MediaFetcher] = []

    def fetcher(resolver: AbstractResolver | None = None, **changes: Any) -> MediaFetcher:
        made.append(MediaFetcher(replace(rules, **changes), resolver))
        return made[-1]

    yield Env(f"http://127.0.0.2:{media.port}", media.port, internal_port, seen, rules, fetcher)
    for one in made:
        await one.close()


async def refused(fetcher: MediaFetcher, url: str) -> FetchRefused:
    with pytest.raises(FetchRefused) as caught:
        await fetcher.fetch(url)
    assert str(caught.value) == PUBLIC_MESSAGE and caught.value.args == (PUBLIC_MESSAGE,)
    return caught.value


# F1: only http(s), allowed ports, no userinfo.

@pytest.mark.parametrize("url", [
    "ftp://93.184.216.34/a.wav", "file:///etc/passwd", "gopher://93.184.216.34:70/_x",
    "data:audio/wav;base64,UklGRg==", "http://user:pw@example.com/a.wav",
    "http://user@example.com/a.wav", "http://:@example.com/a.wav", "http://example.com:22/",
    "https://example.com:8443/", "http://example.com:0/", "http:///a.wav", "http://",
    "/relative/a.wav", "example.com/a.wav", "not a url", "", "http://[::1/", "http://h:99999/",
    "http://exa mple.com/", "http://%31%32%37.0.0.1/", "http://localhost/",
    "http://api.localhost./", "javascript:alert(1)",
])
def test_f1_bad_urls_are_refused(url: str) -> None:
    with pytest.raises(FetchRefused) as caught:
        check_url(url, FetchRules())
    assert str(caught.value) == PUBLIC_MESSAGE


# F3: IP literals, in every form a resolver would accept, checked before any I/O.

@pytest.mark.parametrize("url", [
    "http://127.0.0.1/", "http://127.1/", "http://0x7f.1/", "http://0X7F.0.0.1/",
    "http://0177.0.0.1/", "http://2130706433/", "http://0x7f000001/", "http://017700000001/",
    "http://127.0.0.1./", "http://①②⑦.0.0.1/", "http://[::1]/", "http://[::ffff:127.0.0.1]/",
    "http://[::ffff:7f00:1]/", "http://169.254.169.254/latest/meta-data",
    "http://[::ffff:169.254.169.254]/", "http://10.0.0.1/", "http://172.16.0.1/",
    "http://192.168.1.1/", "http://100.64.0.1/", "http://0.0.0.0/", "http://0/",
    "http://[::]/", "http://[fe80::1]/", "http://[fe80::1%25eth0]/", "http://[fc00::1]/",
    "http://[fd00:ec2::254]/", "http://224.0.0.1/", "http://239.1.2.3/",
    "http://255.255.255.255/", "http://[ff02::1]/", "http://[2002:7f00:1::]/",
    "http://[64:ff9b::7f00:1]/", "http://1.2.3.4.5/", "http://256.0.0.1/", "http://08.0.0.1/",
])
def test_f3_internal_literals_are_refused(url: str) -> None:
    with pytest.raises(FetchRefused) as caught:
        check_url(url, FetchRules())
    assert str(caught.value) == PUBLIC_MESSAGE


@pytest.mark.parametrize(("url", "expected"), [
    ("http://93.184.216.34/a.wav", "http://93.184.216.34/a.wav"),
    ("HTTPS://Example.COM/a.wav?sig=x#frag", "https://example.com/a.wav?sig=x"),
    ("http://[2606:4700::1]:443/a", "http://[2606:4700::1]:443/a"),
    ("http://[::ffff:93.184.216.34]/", "http://[::ffff:5db8:d822]/"),
    ("http://1572395042/", "http://1572395042/"),  # 93.184.216.34 as one number: public
    ("https://bücher.example/a.wav", "https://xn--bcher-kva.example/a.wav"),
    ("http://audio-host_1.example./a", "http://audio-host_1.example./a"),
])
def test_public_urls_pass_check_url(url: str, expected: str) -> None:
    assert str(check_url(url, FetchRules())) == expected


@pytest.mark.parametrize(("ip", "allowed"), [
    ("93.184.216.34", True), ("2606:4700::1", True), ("::ffff:93.184.216.34", True),
    ("127.0.0.1", False), ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False),
    ("2002:7f00:1::", False), ("2002:5db8:d822::", True), ("2001:0:4136:e378:8000:63bf:f5ff:fffe",
                                                            False),
    ("239.1.2.3", False), ("100.64.0.1", False), ("0.1.2.3", False), ("::7f00:1", False),
    ("fe80::1%eth0", False), ("not an ip", False), ("", False),
])
def test_address_allowed(ip: str, allowed: bool) -> None:
    assert address_allowed(ip, FetchRules()) is allowed


def test_allow_networks_admit_what_is_not_global_and_nothing_more() -> None:
    rules = FetchRules(allow_networks=("127.0.0.2/32", "10.1.2.0/24"))
    assert address_allowed("127.0.0.2", rules) and address_allowed("::ffff:127.0.0.2", rules)
    assert address_allowed("10.1.2.77", rules)
    assert not address_allowed("127.0.0.1", rules) and not address_allowed("10.1.3.1", rules)
    assert str(check_url("http://127.0.0.2/", rules)) == "http://127.0.0.2/"
    with pytest.raises(ValueError):
        FetchRules(allow_networks=("10.1.2.0/33",))


@pytest.mark.parametrize("literal", [
    "127.0.0.1", "127.1", "2130706433", "0x7f000001", "0x7f.1", "[::ffff:127.0.0.1]",
])
async def test_f3_literal_forms_never_reach_the_internal_server(env: Env, literal: str) -> None:
    resolver = StubResolver({})
    reason = (await refused(env.fetcher(resolver),
                            f"http://{literal}:{env.internal_port}/?token=SECRET")).reason
    assert "not allowed" in reason and "SECRET" not in reason
    assert resolver.calls == []  # refused statically, before any I/O


# F2: every resolved address is checked, inside the resolver.

@pytest.mark.parametrize("answer", [
    ["93.184.216.34", "10.0.0.1"], ["10.0.0.1", "93.184.216.34"], ["127.0.0.1"],
    ["127.0.0.2", "127.0.0.1"], ["127.0.0.2", "::1"], ["::ffff:127.0.0.1"], [],
])
async def test_f2_one_bad_address_refuses_the_whole_answer(env: Env, answer: list[str]) -> None:
    resolver = StubResolver({"audio.example": [answer]})
    exc = await refused(env.fetcher(resolver), f"http://audio.example:{env.internal_port}/a.wav")
    assert "resolved to" in exc.reason and resolver.calls == ["audio.example"]


async def test_f2_dns_rebinding_after_a_good_answer_is_refused(env: Env) -> None:
    """A name that first resolves to the allowed host and then to 127.0.0.1: every fetch
    resolves again (no DNS cache, no kept-alive connection) and is checked again."""
    resolver = StubResolver({"audio.example": [["127.0.0.2"], ["127.0.0.1"]]})
    fetcher = env.fetcher(resolver, ports=frozenset({env.media_port, env.internal_port}))
    # The same port on both servers would be the real attack; here each listens on its own.
    got = await fetcher.fetch(f"http://audio.example:{env.media_port}/audio.wav")
    assert got.data == WAV
    await refused(fetcher, f"http://audio.example:{env.internal_port}/audio.wav")
    await refused(fetcher, f"http://audio.example:{env.media_port}/audio.wav")
    assert resolver.calls == ["audio.example"] * 3


async def test_f2_with_the_system_resolver(env: Env) -> None:
    """The default resolver (getaddrinfo) is guarded too: this machine's own name resolves to a
    loopback or private address, where the internal server listens."""
    name = socket.gethostname().lower()
    try:
        infos = socket.getaddrinfo(name, env.internal_port, type=socket.SOCK_STREAM)
    except OSError:
        pytest.skip(f"{name} does not resolve here")
    if any(address_allowed(str(info[4][0]), FetchRules()) for info in infos):
        pytest.skip(f"{name} resolves to a public address here")
    exc = await refused(env.fetcher(), f"http://{name}:{env.internal_port}/")
    assert "resolved to" in exc.reason


async def test_guard_resolver_checks_what_the_inner_resolver_says() -> None:
    stub = StubResolver({"a.example": [["93.184.216.34", "2606:4700::1"]],
                         "b.example": [["93.184.216.34", "fd00::1"]]})
    guard = GuardResolver(stub, FetchRules())
    assert [r["host"] for r in await guard.resolve("a.example", 443)] == \
        ["93.184.216.34", "2606:4700::1"]
    with pytest.raises(OSError, match="not allowed"):
        await guard.resolve("b.example", 443)


# The allowlist: an operator's internal audio host.

async def test_allowed_host_by_name_and_by_literal(env: Env) -> None:
    resolver = StubResolver({"audio.internal": [["127.0.0.2"]]})
    fetcher = env.fetcher(resolver)
    by_name = await fetcher.fetch(f"http://audio.internal:{env.media_port}/audio.wav?sig=abc")
    assert by_name.data == WAV and by_name.content_type == "audio/wav"
    assert by_name.url == f"http://audio.internal:{env.media_port}/audio.wav"  # no query
    by_literal = await fetcher.fetch(f"{env.base}/audio.wav")
    assert by_literal.data == WAV
    assert [r.headers["User-Agent"] for r in env.seen.requests] == ["inference-gateway"] * 2


# F4: redirects by hand, each hop checked again.

@pytest.mark.parametrize("to", ["internal", "metadata"])
async def test_f4_redirect_to_an_internal_address_is_refused(env: Env, to: str) -> None:
    exc = await refused(env.fetcher(), f"{env.base}/redirect/{to}")
    assert "not allowed" in exc.reason  # by check_url on the hop; `internal` saw nothing


async def test_f4_redirect_chains(env: Env) -> None:
    fetcher = env.fetcher()
    assert (await fetcher.fetch(f"{env.base}/chain/2")).data == WAV
    assert (await fetcher.fetch(f"{env.base}/chain/3")).url == f"{env.base}/audio.wav"
    assert "redirects" in (await refused(fetcher, f"{env.base}/chain/4")).reason
    assert "redirects" in (await refused(env.fetcher(max_redirects=0),
                                         f"{env.base}/chain/1")).reason


async def test_f4_relative_location_is_resolved_against_the_current_url(env: Env) -> None:
    got = await env.fetcher().fetch(f"{env.base}/sub/redirect/relative")  # to ../audio.wav?sig=1
    assert got.data == WAV and got.url == f"{env.base}/sub/audio.wav"
    assert env.seen.requests[0].path_qs == "/sub/audio.wav?sig=1"


async def test_f4_nothing_is_carried_across_hops(env: Env) -> None:
    """The first hop sets a cookie; the next one gets no Cookie, nor any credential."""
    await env.fetcher().fetch(f"{env.base}/redirect/cookie")
    (request,) = env.seen.requests
    assert "Cookie" not in request.headers and "Authorization" not in request.headers


# F5: no environment proxy.

async def test_f5_proxy_variables_are_ignored(
        env: Env, aiohttp_server: ServerFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    proxy_seen = Seen()
    proxy = await aiohttp_server(recorder(proxy_seen), host="127.0.0.1")
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                 "all_proxy"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{proxy.port}")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    resolver = StubResolver({"audio.internal": [["127.0.0.2"]]})
    fetcher = env.fetcher(resolver)
    assert (await fetcher.fetch(f"http://audio.internal:{env.media_port}/audio.wav")).data == WAV
    assert (await fetcher.fetch(f"{env.base}/audio.wav")).data == WAV
    assert proxy_seen.requests == [] and len(env.seen.requests) == 2
    # The control: a session that trusts the environment does go through the proxy.
    async with aiohttp.ClientSession(trust_env=True) as control, \
            control.get(f"{env.base}/audio.wav") as response:
        assert response.status == 200
    assert len(proxy_seen.requests) == 1 and len(env.seen.requests) == 2


# F6: caps, all failures alike to the client.

async def test_f6_content_length_over_the_cap_is_refused_before_reading(env: Env) -> None:
    assert "announced 5000" in (await refused(env.fetcher(), f"{env.base}/fixed/announced")).reason


async def test_f6_chunked_body_over_the_cap_is_cut(env: Env) -> None:
    exc = await refused(env.fetcher(), f"{env.base}/stream")
    assert "passed 1000 bytes" in exc.reason
    await asyncio.wait_for(env.seen.done.wait(), 10)
    assert env.seen.dropped and not env.seen.completed
    assert env.seen.sent < 160 * 65536  # the server saw the connection dropped mid-body


async def test_f6_slow_drip_is_refused_at_the_deadline(env: Env) -> None:
    start = time.monotonic()
    exc = await refused(env.fetcher(), f"{env.base}/stream?drip=1")
    elapsed = time.monotonic() - start
    assert "deadline" in exc.reason and 0.9 < elapsed < env.rules.total_timeout_s + 1
    await asyncio.wait_for(env.seen.done.wait(), 5)
    assert env.seen.dropped and env.seen.sent < 100


@pytest.mark.parametrize(("path", "reason"), [
    ("/fixed/html", "media type 'text/html'"),
    ("/fixed/untyped", "media type 'audio'"),
    ("/fixed/missing", "HTTP 404"),
])
async def test_f6_wrong_answers_are_refused(env: Env, path: str, reason: str) -> None:
    assert reason in (await refused(env.fetcher(), f"{env.base}{path}")).reason


async def test_f6_connection_refused(env: Env) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.2", 0))
        port = sock.getsockname()[1]
    fetcher = env.fetcher(ports=frozenset({port}))
    assert "could not connect" in (await refused(fetcher, f"http://127.0.0.2:{port}/")).reason


async def test_f6_blocked_and_unreachable_look_the_same(env: Env) -> None:
    """One text for every kind of failure; only the log reason tells them apart."""
    resolver = StubResolver({"rebound.example": [["127.0.0.1"]]})
    fetcher = env.fetcher(resolver)
    urls = [f"http://127.0.0.1:{env.internal_port}/", f"http://rebound.example:{env.media_port}/",
            f"http://nowhere.example:{env.media_port}/", f"{env.base}/fixed/missing",
            f"{env.base}/fixed/html", f"{env.base}/fixed/announced", "ftp://example.com/"]
    failures = [await refused(fetcher, url) for url in urls]
    assert {str(exc) for exc in failures} == {PUBLIC_MESSAGE}
    assert len({exc.reason for exc in failures}) == len(urls)


# Compressed bodies: both the decoded and the wire size are capped.

async def test_gzip_inflating_over_the_cap_is_refused(env: Env) -> None:
    """5 MB of zeros gzip to ~5 KB: the announced length passes a 50 KB cap, the decoded
    bytes do not."""
    exc = await refused(env.fetcher(max_bytes=50_000), f"{env.base}/fixed/gzip-bomb")
    assert "passed 50000 bytes" in exc.reason


async def test_gzip_under_the_cap_is_decoded(env: Env) -> None:
    got = await env.fetcher(max_bytes=50_000).fetch(f"{env.base}/fixed/gzip-small")
    assert got.data == WAV + b"\0" * (20_000 - len(WAV)) and got.content_type == "audio/wav"


async def test_compressed_bytes_that_decode_to_nothing_still_count(env: Env) -> None:
    exc = await refused(env.fetcher(), f"{env.base}/empty-members")
    assert "passed 1000 bytes" in exc.reason


def test_audio_media_types() -> None:
    for ok in ("audio/wav", "audio/mpeg", "audio/x-flac", "video/webm", "video/mp4",
               "video/ogg", "application/ogg", "application/octet-stream",
               "binary/octet-stream"):
        assert is_audio_media_type(ok), ok
    for bad in ("audio/", "text/html", "application/json", "image/png", "video/quicktime", ""):
        assert not is_audio_media_type(bad), bad


async def test_a_caller_may_accept_other_types(env: Env) -> None:
    got = await env.fetcher().fetch(f"{env.base}/fixed/html", accept=lambda ct: ct == "text/html")
    assert got.content_type == "text/html" and got.data == b"<html>login</html>"

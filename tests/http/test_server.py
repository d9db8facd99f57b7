"""The connection layer (proxy.http.server): deadlines, the connection cap, JSON refusals of what
aiohttp's parser rejects, and underscore header names (reliability.md I2, I4, I5)."""

from __future__ import annotations

import asyncio
import re
import resource
import socket
from pathlib import Path

import orjson
import pytest
from redis.asyncio import Redis

from proxy.appkeys import CONFIG
from proxy.config import load_config
from proxy.credits.ledger import Ledger
from proxy.http.server import FD_HEADROOM, REQUEST_LINE_MAX, connection_cap
from proxy.store.redis_process import RedisProcess
from tests.support.chat import CHAT, HELLO
from tests.support.config_files import MODEL, write_config
from tests.support.gateway import GatewayFactory, settled
from tests.support.raw_http import connect, error_type, parse, read_response, read_until_closed
from tests.support.upstreams import SimulatorFactory, sim_requests

SLACK_S = 1.5  # scheduling noise on a loaded CI machine; the deadlines themselves are 1 s
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n"
CANARY = b"CANARY7c1e"


async def test_an_idle_keepalive_connection_is_closed(gateway: GatewayFactory) -> None:
    gw = await gateway(server={"keepalive_timeout_s": 1.0})
    reader, writer = await connect(gw)
    loop = asyncio.get_running_loop()
    try:
        writer.write(HEALTHZ)
        status, headers, _ = await read_response(reader)
        assert status == 200 and headers.get("connection", "").lower() != "close"
        answered = loop.time()
        assert await asyncio.wait_for(reader.read(), 1.0 + SLACK_S) == b""  # closed by the server
        assert loop.time() - answered > 0.5  # for being idle, not straight after the answer
    finally:
        writer.close()


async def test_a_request_head_must_arrive_within_the_header_deadline(
    gateway: GatewayFactory
) -> None:
    gw = await gateway(server={"header_timeout_s": 1.0, "keepalive_timeout_s": 30.0})
    loop = asyncio.get_running_loop()

    async def trickle(writer: asyncio.StreamWriter, data: bytes, gap_s: float) -> None:
        for i in range(len(data)):
            writer.write(data[i:i + 1])
            await asyncio.sleep(gap_s)

    partial = b"GET /healthz HTTP/1.1\r\nHost: gw\r\nX-Pad: " + b"a" * 100
    # A head that dribbles in but is never finished: 408 in our shape, then the close.
    reader, writer = await connect(gw)
    opened = loop.time()
    dripping = asyncio.create_task(trickle(writer, partial, 0.1))
    raw = await asyncio.wait_for(read_until_closed(reader), 1.0 + SLACK_S)
    assert loop.time() - opened > 0.5
    dripping.cancel()
    writer.close()
    status, headers, body = parse(raw)
    assert status == 408 and headers["content-type"] == "application/json"
    assert re.fullmatch(r"[0-9a-f]{32}", headers["x-request-id"])
    assert error_type(body) == "request_timeout"

    # A connection that sends nothing at all is closed without a word.
    reader, writer = await connect(gw)
    assert await asyncio.wait_for(read_until_closed(reader), 1.0 + SLACK_S) == b""
    writer.close()

    # A kept-alive connection: a slow but complete head is served; the next one, never
    # finished, has the same deadline from its first byte (keep-alive alone would allow 30 s).
    reader, writer = await connect(gw)
    await trickle(writer, HEALTHZ[:-2], 0.3 / len(HEALTHZ))  # well within the deadline
    writer.write(b"\r\n")
    status, _, _ = await read_response(reader)
    assert status == 200
    dripping = asyncio.create_task(trickle(writer, partial, 0.1))
    raw = await asyncio.wait_for(read_until_closed(reader), 1.0 + SLACK_S)
    dripping.cancel()
    writer.close()
    assert parse(raw)[0] == 408


async def test_connections_beyond_the_cap_get_503_and_are_closed(gateway: GatewayFactory) -> None:
    gw = await gateway(server={"max_connections": 3})
    held = []
    for _ in range(3):
        reader, writer = await connect(gw)
        writer.write(HEALTHZ)
        assert (await read_response(reader))[0] == 200  # served, and kept open
        held.append((reader, writer))

    reader, writer = await connect(gw)
    writer.write(HEALTHZ)
    raw = await asyncio.wait_for(read_until_closed(reader), 5)
    writer.close()
    status, headers, body = parse(raw)
    assert status == 503 and headers["content-type"] == "application/json"
    assert re.fullmatch(r"[0-9a-f]{32}", headers["x-request-id"])
    assert headers["connection"] == "close" and headers["retry-after"] == "1"
    assert error_type(body) == "unavailable"

    # One held connection goes away: its slot serves the next client.
    held.pop()[1].close()
    for _ in range(50):
        reader, writer = await connect(gw)
        writer.write(HEALTHZ)
        status = (await read_response(reader))[0]
        writer.close()
        if status == 200:
            break
        await asyncio.sleep(0.05)
    assert status == 200
    for _, held_writer in held:
        held_writer.close()


def test_the_cap_leaves_room_under_the_open_file_limit(tmp_path: Path) -> None:
    backend = {"name": "b", "kind": "vllm", "url": "http://127.0.0.1:9", "models": [MODEL],
               "max_concurrency": 100_000}
    config = load_config(write_config(tmp_path, [backend], server={"max_connections": 10**6}))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = connection_cap(config)
    # Room for one upstream connection per client connection, and the worker's own descriptors.
    assert cap > 0 and 2 * cap + FD_HEADROOM <= soft


async def test_a_client_that_stops_reading_is_cut_after_the_write_deadline(
    simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    sim = await simulator("vllm", max_model_len=200_000)  # room for the long answer below
    gw = await gateway(sim, server={"write_timeout_s": 1.0})
    body = orjson.dumps({"model": MODEL, "messages": HELLO, "stream": True, "max_tokens": 100_000})
    request = (f"POST {CHAT} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
               f"X-API-Key: {gw.api_key}\r\nx-sim-tokens: 100000\r\n"  # type: ignore[attr-defined]
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a reader that holds back
    sock.setblocking(False)
    assert gw.host is not None and gw.port is not None
    await asyncio.get_running_loop().sock_connect(sock, (gw.host, gw.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(request)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200")  # the stream is on; from here on nothing is read
    # Once the buffers are full, the gateway waits write_timeout_s, then treats the client as
    # gone: the upstream generation is cancelled.
    outcome = None
    for _ in range(400):  # generous: a loaded machine fills the buffers slowly
        records = await sim_requests(sim)
        outcome = records[-1]["outcome"] if records else None
        if outcome is not None:
            break
        await asyncio.sleep(0.05)
    assert outcome == "cancelled"
    # The connection is gone too: what was buffered drains, then the socket ends.
    await asyncio.wait_for(read_until_closed(reader), 15)
    writer.close()
    # Settled as a client that went away (charged for what was sent).
    await settled(gw)
    redis = Redis.from_url(clean_redis.url)
    try:
        entries = await Ledger(redis).all_entries("acct-test")
    finally:
        await redis.aclose()
    assert [entry["status"] for entry in entries] == ["client_gone"]


# ---- refusals: aiohttp's parser errors and underscore header names, in our JSON shape --------

BAD_REQUESTS = [
    ("content-length with transfer-encoding",
     b"POST /" + CANARY + b" HTTP/1.1\r\nHost: gw\r\nContent-Length: 3\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, "invalid_request"),
    ("duplicate content-length",
     b"POST / HTTP/1.1\r\nHost: gw\r\nContent-Length: 1\r\nContent-Length: 1\r\nX-C: "
     + CANARY + b"\r\n\r\na", 400, "invalid_request"),
    ("obs-fold", b"GET / HTTP/1.1\r\nHost: gw\r\nX-A: 1\r\n  " + CANARY + b"\r\n\r\n",
     400, "invalid_request"),
    ("bare LF", b"GET /" + CANARY + b" HTTP/1.1\nHost: gw\n\n", 400, "invalid_request"),
    ("NUL in a header value", b"GET / HTTP/1.1\r\nHost: gw\r\nX-A: " + CANARY + b"\x00\r\n\r\n",
     400, "invalid_request"),
    ("a space in the target", b"GET /a " + CANARY + b" HTTP/1.1\r\nHost: gw\r\n\r\n",
     400, "invalid_request"),
    ("TLS on the HTTP port", b"\x16\x03\x01\x00\xa5\x01\x00\x00" + CANARY, 400,
     "invalid_request"),
    ("unknown method", CANARY + b" / HTTP/1.1\r\nHost: gw\r\n\r\n", 501, "not_implemented"),
    ("not a method at all", b"G\x01T /" + CANARY + b" HTTP/1.1\r\nHost: gw\r\n\r\n", 501,
     "not_implemented"),
    ("URL too long", b"GET /" + CANARY * (REQUEST_LINE_MAX // len(CANARY) + 1)
     + b" HTTP/1.1\r\nHost: gw\r\n\r\n", 414, "uri_too_long"),
    ("header too long", b"GET / HTTP/1.1\r\nHost: gw\r\nX-Big: " + CANARY * 1000 + b"\r\n\r\n",
     431, "headers_too_large"),
    ("header name too long", b"GET / HTTP/1.1\r\nHost: gw\r\nX-" + CANARY * 1000
     + b": 1\r\n\r\n", 431, "headers_too_large"),
    ("too many headers", b"GET / HTTP/1.1\r\nHost: gw\r\n"
     + b"".join(b"X-%d: " % i + CANARY + b"\r\n" for i in range(200)) + b"\r\n",
     431, "headers_too_large"),
    # Each line within its limit, ~1 MB in all: the whole head is capped too (64 KiB).
    ("a head of 120 long headers", b"GET / HTTP/1.1\r\nHost: gw\r\n"
     + b"".join(b"X-%d: " % i + CANARY * (8000 // len(CANARY)) + b"\r\n" for i in range(120))
     + b"\r\n", 431, "headers_too_large"),
    ("a head of nine long headers", b"GET / HTTP/1.1\r\nHost: gw\r\n"
     + b"".join(b"X-%d: " % i + CANARY * (8000 // len(CANARY)) + b"\r\n" for i in range(9))
     + b"\r\n", 431, "headers_too_large"),
    # Versions that parse but are not HTTP/1.x: refused, never answered "HTTP/2.0 200 OK".
    ("HTTP/2.0", b"GET /v2/models HTTP/2.0\r\nHost: gw\r\nX-C: " + CANARY + b"\r\n\r\n",
     505, "http_version_not_supported"),
    ("HTTP/0.9", b"GET /v2/models HTTP/0.9\r\nX-C: " + CANARY + b"\r\n\r\n", 505,
     "http_version_not_supported"),
]


@pytest.mark.parametrize(("raw", "status", "kind"), [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
async def test_malformed_requests_get_json_and_echo_nothing(
    gateway: GatewayFactory, raw: bytes, status: int, kind: str
) -> None:
    gw = await gateway()
    reader, writer = await connect(gw)
    writer.write(raw)
    answer = await asyncio.wait_for(read_until_closed(reader), 5)  # and the connection closes
    writer.close()
    got_status, headers, body = parse(answer)
    if status == 505:
        assert answer.startswith(b"HTTP/1.1 505 ")  # not in the version the client claimed
    assert (got_status, headers["content-type"]) == (status, "application/json")
    assert error_type(body) == kind
    assert CANARY.lower() not in answer.lower()
    # Like every answer, an id of its own (schemathesis found it missing), never the client's.
    assert re.fullmatch(r"[0-9a-f]{32}", headers["x-request-id"])


async def test_header_names_with_underscores_are_refused(gateway: GatewayFactory) -> None:
    gw = await gateway()
    reader, writer = await connect(gw)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: gw\r\nX_Api_" + CANARY + b": 1\r\n\r\n")
    status, headers, body = await read_response(reader)
    writer.write(HEALTHZ)  # the connection stays usable: the request was well-formed HTTP
    assert (await read_response(reader))[0] == 200
    writer.close()
    assert (status, headers["content-type"]) == (400, "application/json")
    assert headers["x-request-id"]
    assert error_type(body) == "invalid_request" and CANARY not in body


# ---- Expect: 100-continue after the checks, other expectations ignored ----------------------


def _post_head(path: str, length: int, key: str, expect: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\nX-API-Key: {key}\r\nExpect: {expect}\r\n\r\n"
            ).encode()


async def test_100_continue_comes_after_the_checks_that_need_no_body(
    gateway: GatewayFactory, simulator: SimulatorFactory
) -> None:
    """aiohttp alone sends 100 Continue before any check, so a client refused for its key
    uploads its body anyway. Here: a good request is told to go on, then answered; a bad key or a
    body declared over the cap is refused at once, never asked for its body, and told that the
    connection closes (the client still holds the body it announced)."""
    gw = await gateway(await simulator())
    key = gw.api_key  # type: ignore[attr-defined]
    body = orjson.dumps({"model": MODEL, "messages": HELLO, "max_tokens": 4})

    reader, writer = await connect(gw)
    writer.write(_post_head(CHAT, len(body), key, "100-continue"))
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(body)
    status, headers, answer = await read_response(reader)
    assert status == 200 and orjson.loads(answer)["choices"]
    writer.write(HEALTHZ)  # still a kept-alive connection
    assert (await read_response(reader))[0] == 200
    writer.close()

    cap = gw.app[CONFIG].policies.requests.chat.max_body_bytes
    for head, expected in [(_post_head(CHAT, len(body), "igw_sk_" + "x" * 38, "100-continue"), 401),
                           (_post_head(CHAT, cap + 1, key, "100-continue"), 413)]:
        reader, writer = await connect(gw)
        writer.write(head)
        status, headers, _ = await asyncio.wait_for(read_response(reader), 5)  # not a 100
        writer.close()
        assert (status, headers["connection"].lower()) == (expected, "close")


@pytest.mark.parametrize("path", ["/healthz", "/no/such/route"])
async def test_other_expectations_are_ignored(gateway: GatewayFactory, path: str) -> None:
    """aiohttp answered any other `Expect` with a text/plain 417 echoing it, before the
    middleware (so no id, no JSON, and a status the document does not list)."""
    gw = await gateway()
    reader, writer = await connect(gw)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: gw\r\nExpect: {CANARY.decode()}\r\n\r\n".encode())
    status, headers, body = await read_response(reader)
    writer.close()
    assert status == (200 if path == "/healthz" else 404)
    assert headers["content-type"].startswith("application/json") and headers["x-request-id"]
    assert CANARY not in body

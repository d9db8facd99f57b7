"""The backends' HTTP/1.1 client (proxy.upstream.http1) against real loopback servers that answer
byte by byte as scripted: framing (length, chunked, up to the close), keep-alive reuse, the three
timeouts, broken and foreign answers, and what it writes."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import gzip
import ipaddress
import socket
import ssl
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from proxy.upstream import http1

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class Scripted:
    """A loopback server running `script` on every connection; it keeps each request's head."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.heads: list[bytes] = []
        self.closed_by_client = asyncio.Event()
        self.server: asyncio.Server | None = None

    @classmethod
    def answering(cls, answer: bytes, *, hold: bool = False) -> Scripted:
        """A server that answers one request with `answer`, then closes the connection (or,
        with `hold`, keeps it until the client closes it)."""
        async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(answer)
            await writer.drain()
            if hold:
                await server.request(reader)

        server = cls(script)
        return server

    async def __aenter__(self) -> Scripted:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1/chat/completions"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.script(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def request(self, reader: asyncio.StreamReader) -> bytes:
        """One request read whole (head and body); b"" once the client closed."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            self.closed_by_client.set()
            return b""
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        self.heads.append(head)
        return await reader.readexactly(length)


def client(**timeouts: float) -> http1.Client:
    settings = {"connect_timeout_s": 1.0, "first_byte_timeout_s": 5.0, "idle_timeout_s": 5.0}
    return http1.Client(**{**settings, **timeouts})


@pytest.fixture
async def http() -> AsyncIterator[http1.Client]:
    made = client()
    yield made
    await made.close()


async def post(http: http1.Client, url: str, body: bytes = b"{}",
               headers: dict[str, str] | None = None) -> http1.Response:
    return await http.post(http1.Target.of(url), body,
                           headers or {"Content-Type": "application/json"})


async def test_answers_with_a_length_reuse_one_connection(http: http1.Client) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await server.request(reader):
            writer.write(OK)

    async with Scripted(script) as server:
        for _ in range(3):
            response = await post(http, server.url)
            assert (response.status, response.content_length) == (200, 2)
            assert response.headers["content-type"] == "application/json"
            assert await response.read(100) == b"{}" and response.finished
            response.release()
        assert server.connections == 1


async def test_what_it_writes(http: http1.Client) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await server.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))

    async with Scripted(script) as server:
        url = server.url.replace("/v1/", "/base/v1/") + "?a=1"
        response = await post(http, url, b'{"x": "\xc3\xa9"}',
                              {"Content-Type": "application/json", "X-Sim-Note": "caf\xe9 ok",
                               "Host": "evil", "Connection": "upgrade"})
        assert await response.read(100) == b'{"x": "\xc3\xa9"}'
        response.release()
        port = server.url.split(":")[2].split("/")[0]
    lines = server.heads[0].split(b"\r\n")
    assert lines[0] == b"POST /base/v1/chat/completions?a=1 HTTP/1.1"
    assert f"Host: 127.0.0.1:{port}".encode() in lines
    assert b"Content-Length: 11" in lines
    assert "X-Sim-Note: café ok".encode() in lines  # as the client sent it (UTF-8)
    assert b"Accept: */*" in lines  # none given: any
    assert not any(line.lower().startswith((b"host: evil", b"connection")) for line in lines)


async def test_refuses_a_header_with_a_line_break(http: http1.Client) -> None:
    with pytest.raises(http1.BadHeader):
        await post(http, "http://127.0.0.1:9/x", headers={"X-A": "a\r\nInjected: 1"})


async def test_a_chunked_body_arrives_as_it_is_sent(http: http1.Client) -> None:
    release = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await release.wait()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        while await server.request(reader):
            writer.write(OK)

    async with Scripted(script) as server:
        response = await post(http, server.url)
        assert response.content_length is None
        assert await response.read_chunk() == b"first"  # before the rest exists
        release.set()
        assert await response.read(100) == b"second"
        assert response.finished and response.total_bytes == 11
        response.release()
        again = await post(http, server.url)  # the same connection, kept alive
        assert await again.read(10) == b"{}"
        again.release()
        assert server.connections == 1


async def test_a_body_that_runs_to_the_close(http: http1.Client) -> None:
    async with Scripted.answering(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it"
                                  ) as server:
        response = await post(http, server.url)
        assert await response.read(100) == b"all of it"
        assert response.finished
        response.release()
        assert await (await post(http, server.url)).read(100) == b"all of it"
        assert server.connections == 2  # never reused


async def test_a_broken_answer(http: http1.Client) -> None:
    async with Scripted.answering(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this"
                                  ) as server:
        response = await post(http, server.url)
        with pytest.raises(http1.Disconnected):
            await response.read(1000)
        assert isinstance(response.broken, http1.Disconnected)
        assert not response.finished


async def test_closed_before_any_answer(http: http1.Client) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.request(reader)

    async with Scripted(script) as server:
        with pytest.raises(http1.Disconnected):
            await post(http, server.url)


async def test_not_http(http: http1.Client) -> None:
    async with Scripted.answering(b"SSH-2.0-OpenSSH_9.2\r\n\r\n", hold=True) as server:
        with pytest.raises(http1.BadResponse):
            await post(http, server.url)


async def test_connect_refused(http: http1.Client) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening
        with pytest.raises(http1.ConnectFailed):
            await post(http, f"http://127.0.0.1:{port}/x")


async def test_first_byte_timeout() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.request(reader)
        await server.request(reader)  # never answers; b"" once the client gives up

    slow = client(first_byte_timeout_s=0.2)
    async with Scripted(script) as server:
        started = asyncio.get_running_loop().time()
        with pytest.raises(http1.ReadTimeout):
            await post(slow, server.url)
        assert asyncio.get_running_loop().time() - started < 2
        await asyncio.wait_for(server.closed_by_client.wait(), 2)  # the request was dropped
    await slow.close()


async def test_the_idle_gap_once_the_body_flows() -> None:
    """The first body bytes may take the first-byte timeout; a later gap only the idle one,
    even though that is the shorter (the timer must come sooner than first armed)."""
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await asyncio.sleep(0.5)  # within first_byte, past idle
        writer.write(b"2\r\nhi\r\n")
        await reader.read()  # then silence

    timed = client(first_byte_timeout_s=3.0, idle_timeout_s=0.3)
    async with Scripted(script) as server:
        response = await post(timed, server.url)
        assert await response.read_chunk() == b"hi"
        started = asyncio.get_running_loop().time()
        with pytest.raises(http1.ReadTimeout):
            await response.read_chunk()
        assert asyncio.get_running_loop().time() - started < 1.5
    await timed.close()


async def test_an_unfinished_body_closes_its_connection(http: http1.Client) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n")
        await server.request(reader)  # b"": the client closed

    async with Scripted(script) as server:
        response = await post(http, server.url)
        assert await response.read_chunk() == b"hi"
        response.release()  # the rest unread: the backend must see the client go
        await asyncio.wait_for(server.closed_by_client.wait(), 2)


async def test_close_wakes_a_reader(http: http1.Client) -> None:
    """The drain's abort: whoever waits for more of the body learns it broke off."""
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await reader.read()

    async with Scripted(script) as server:
        response = await post(http, server.url)
        reading = asyncio.ensure_future(response.read_chunk())
        await asyncio.sleep(0.05)
        response.close()
        with pytest.raises(http1.Disconnected):
            await asyncio.wait_for(reading, 2)


async def test_a_connection_the_server_closed_while_idle_is_not_reused(
        http: http1.Client) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.request(reader)
        writer.write(OK)  # kept alive by the headers, closed at once (an idle timeout)

    async with Scripted(script) as server:
        for _ in range(2):
            response = await post(http, server.url)
            assert await response.read(10) == b"{}"
            response.release()
            await asyncio.sleep(0.1)
        assert server.connections == 2


async def test_an_informational_answer_before_the_real_one(http: http1.Client) -> None:
    async with Scripted.answering(b"HTTP/1.1 100 Continue\r\n\r\n" + OK, hold=True) as server:
        response = await post(http, server.url)
        assert response.status == 200 and await response.read(10) == b"{}"
        response.release()


def test_targets() -> None:
    target = http1.Target.of("https://Example.COM/v1/x?y=1")
    assert (target.origin, target.host_header, target.path) == (
        ("https", "example.com", 443), b"example.com", b"/v1/x?y=1")
    assert http1.Target.of("http://[::1]:8080").host_header == b"[::1]:8080"
    assert http1.Target.of("http://[::1]:8080").path == b"/"
    with pytest.raises(ValueError):
        http1.Target.of("ftp://host/x")


async def test_a_slow_reader_slows_the_server() -> None:
    """Backpressure: past the read-ahead the socket is not read, the server's writes wait, and
    a paused read is not taken for a silent server."""
    sent = 0
    chunk = b"x" * 16384

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await server.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(2000):  # 32 MB, far more than every buffer on the way
            writer.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            await writer.drain()
            sent += len(chunk)
        writer.write(b"0\r\n\r\n")

    slow = client(idle_timeout_s=0.3)
    async with Scripted(script) as server:
        response = await post(slow, server.url)
        await asyncio.sleep(1.0)  # reading nothing, longer than the idle timeout
        assert sent < 8 * 1024 * 1024  # the server was held back
        total = 0
        while data := await response.read_chunk():
            total += len(data)
        assert total == sent == 2000 * len(chunk)
        response.release()
    await slow.close()


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_compressed_body_is_read_decoded(http: http1.Client, encoding: str) -> None:
    text = b'{"answer": "' + b"la " * 200_000 + b'"}'
    packed = gzip.compress(text) if encoding == "gzip" else zlib.compress(text)

    answer = (b"HTTP/1.1 200 OK\r\nContent-Encoding: %b\r\nContent-Length: %d\r\n\r\n%b"
              % (encoding.encode(), len(packed), packed))
    async with Scripted.answering(answer, hold=True) as server:
        response = await post(http, server.url)
        pieces = [piece async for piece in response.chunks()]
        assert b"".join(pieces) == text and response.total_bytes == len(text)
        assert max(map(len, pieces)) <= http1.INFLATE_STEP  # never all of it at once
        response.release()


async def test_a_body_that_does_not_decompress(http: http1.Client) -> None:
    async with Scripted.answering(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\n"
                                  b"Content-Length: 5\r\n\r\nplain", hold=True) as server:
        response = await post(http, server.url)
        with pytest.raises(http1.BadResponse):
            await response.read(100)


def _self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 that is its own CA, and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test backend")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


async def test_https_backends_are_verified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    """TLS to an https:// backend, its certificate checked against the trusted CAs (here, by
    SSL_CERT_FILE, as an operator would add theirs); an untrusted one is refused."""
    cert_file, key_file = _self_signed(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(OK)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)
    url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
    try:
        untrusting = client()
        with pytest.raises(http1.ConnectFailed):
            await post(untrusting, url)
        await untrusting.close()
        monkeypatch.setenv("SSL_CERT_FILE", str(cert_file))
        trusting = client()
        response = await post(trusting, url)
        assert response.status == 200 and await response.read(10) == b"{}"
        response.release()
        await trusting.close()
    finally:
        server.close()

"""An answer from a backend as the keep-alive client hands it over: status and headers, then the
body read as it arrives (decoded when gzip or deflate), and the connection given back (or
closed) when the reader is done.
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator
from typing import Protocol

from multidict import CIMultiDictProxy

from proxy.upstream.http1_errors import BadResponse

INFLATE_STEP = 256 * 1024  # decoded bytes handed out at once from a compressed body
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS,
          "deflate": 32 + zlib.MAX_WBITS}  # deflate: zlib-wrapped (or gzip), as servers send it


class BodySource(Protocol):
    """The connection an answer's body comes from (proxy.upstream.http1_connection)."""

    async def body_chunk(self) -> bytes: ...

    @property
    def finished(self) -> bool: ...

    def close(self) -> None: ...

    def release(self) -> None: ...


class Response:
    """An answer whose status and headers have arrived; its body is read with `read_chunk`,
    `chunks` or `read`, then `release` (or `close`) gives the connection back. A gzip or deflate
    body (a server may compress when the request names no encoding) is read decoded."""

    __slots__ = ("_conn", "_inflate", "broken", "connect_s", "content_length", "headers",
                 "status", "total_bytes")

    def __init__(self, conn: BodySource, status: int, headers: CIMultiDictProxy[str]) -> None:
        self._conn = conn
        self.status = status
        self.headers = headers
        length = headers.get("Content-Length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        self.total_bytes = 0  # body bytes read so far (decoded)
        self.broken: BaseException | None = None  # what ended the body early, if anything
        self.connect_s: float | None = None  # a new connection's setup time (None: reused)
        encoding = headers.get("Content-Encoding", "identity").strip().lower()
        self._inflate = zlib.decompressobj(_WBITS[encoding]) if encoding in _WBITS else None

    async def read_chunk(self) -> bytes:
        """The body's next bytes as they came; b"" at its end. Raises `ReadTimeout`,
        `Disconnected` or `BadResponse` when it breaks off."""
        try:
            data = await (self._conn.body_chunk() if self._inflate is None else self._inflated())
        except Exception as exc:
            self.broken = exc
            raise
        self.total_bytes += len(data)
        return data

    async def _inflated(self) -> bytes:
        """The next decoded bytes, at most `INFLATE_STEP` at a time (a small chunk may inflate
        to a great deal: whoever reads counts it against their cap as it comes)."""
        inflate = self._inflate
        assert inflate is not None
        try:
            while True:
                if inflate.unconsumed_tail:
                    data = inflate.decompress(inflate.unconsumed_tail, INFLATE_STEP)
                elif raw := await self._conn.body_chunk():
                    data = inflate.decompress(raw, INFLATE_STEP)
                else:
                    return inflate.flush()
                if data:
                    return data
        except zlib.error:
            raise BadResponse("a compressed body that does not decompress") from None

    async def chunks(self) -> AsyncIterator[bytes]:
        while data := await self.read_chunk():
            yield data

    async def read(self, limit: int) -> bytes:
        """The rest of the body, at most `limit` bytes (more is left unread)."""
        parts: list[bytes] = []
        size = 0
        while size < limit and (data := await self.read_chunk()):
            parts.append(data)
            size += len(data)
        return b"".join(parts)[:limit]

    def mark_broken(self, reason: BaseException) -> None:
        """Whoever reads the body found it unusable: the backend failed, the connection goes."""
        self.broken = reason

    @property
    def finished(self) -> bool:
        """The whole body has been read."""
        return self._conn.finished

    def close(self) -> None:
        """Drop the connection: a backend stops generating an answer nobody reads."""
        self._conn.close()

    def release(self) -> None:
        """Back to the pool when the body was read to its end; otherwise closed."""
        self._conn.release()

"""Incremental Server-Sent Events parsing and framing (WHATWG rules). Pure.

Upstreams differ in framing (`data: x` vs TGI's `data:x`, `:` keep-alive comments, CRLF or LF),
so the relay parses every upstream byte stream into whole events and re-frames them itself: a
client never sees a half event, a comment or another server's dialect.
"""

from __future__ import annotations

from dataclasses import dataclass

DONE = b"[DONE]"


@dataclass(slots=True)
class Event:
    data: bytes
    event: str | None = None


class SSEDecoder:
    """Feed arbitrary byte chunks, get complete events back.

    Lines end in LF, CRLF or CR; a line starting with ':' is a comment; one space after the colon
    is stripped; several `data:` lines join with LF; a blank line dispatches; an event with no data
    is not dispatched; bytes after the last blank line at end of stream are discarded.
    """

    __slots__ = ("_buffer", "_data", "_event", "_started")

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[bytes] = []
        self._event: str | None = None
        self._started = False

    def feed(self, chunk: bytes) -> list[Event]:
        buffer = self._buffer + chunk if self._buffer else chunk
        if not self._started and buffer:
            self._started = True
            if buffer.startswith(b"\xef\xbb\xbf"):
                buffer = buffer[3:]
        if b"\r" in buffer:
            # A CR at the very end may be the first half of a CRLF: keep it for the next chunk.
            held = buffer.endswith(b"\r")
            if held:
                buffer = buffer[:-1]
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            if held:
                buffer += b"\r"
        lines = buffer.split(b"\n")
        self._buffer = lines.pop()
        events: list[Event] = []
        for line in lines:
            if not line:
                if self._data:
                    events.append(Event(b"\n".join(self._data), self._event))
                self._data = []
                self._event = None
                continue
            if line[0] == 0x3A:  # ':' comment / keep-alive
                continue
            name, sep, value = line.partition(b":")
            if sep and value[:1] == b" ":
                value = value[1:]
            if name == b"data":
                self._data.append(value)
            elif name == b"event":
                self._event = value.decode("utf-8", "replace")
            # `id`, `retry` and unknown fields: no inference server uses them; ignored.
        return events

    def finish(self) -> list[Event]:
        """At end of stream: a CR held back as a possible CRLF half was a line ending after all."""
        if self._buffer.endswith(b"\r"):
            return self.feed(b"\n")
        return []


def frame(data: bytes, event: str | None = None) -> bytes:
    """One event in the canonical `data: ...` framing (`event:` line first when named)."""
    if b"\n" in data:
        body = b"".join(b"data: " + line + b"\n" for line in data.split(b"\n"))
    else:
        body = b"data: " + data + b"\n"
    if event is not None:
        return b"event: " + event.encode() + b"\n" + body + b"\n"
    return body + b"\n"


DONE_FRAME = frame(DONE)

"""What counts as a good answer, shared by the benchmark driver and the locust scenarios.

Pure (no I/O, no aiohttp). A non-streaming answer must be a JSON completion with choices; a
stream must hold at least one event with generated text, no error event, and end with
`data: [DONE]` on an event boundary. Anything else is an error with a short reason.
"""

from __future__ import annotations

from typing import Any

import orjson

_TOKEN_FIELDS = ("content", "reasoning_content", "tool_calls")


def completion_problem(status: int, payload: bytes) -> str | None:
    if status != 200:
        return f"HTTP {status}"
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return "body not JSON"
    if not isinstance(doc, dict) or not doc.get("choices"):
        return "no choices in body"
    return None


class StreamCheck:
    """Feed an SSE body chunk by chunk; counts whole events and notes the first token."""

    def __init__(self) -> None:
        self.events = 0
        self.saw_token = False
        self._problem: str | None = None
        self._rest = b""
        self._last = b""

    def feed(self, chunk: bytes) -> bool:
        """True when this chunk completed the first event that carries generated text."""
        # Whole events only; a partial one waits in `_rest` for the next chunk.
        parts = (self._rest + chunk).replace(b"\r\n", b"\n").split(b"\n\n")
        self._rest = parts.pop()
        if not parts:
            return False
        self.events += len(parts)
        self._last = parts[-1]
        first = False
        for event in parts:
            if not self.saw_token and _carries_token(event):
                self.saw_token = first = True
            # The substring test keeps JSON parsing off the path of ordinary token events.
            if self._problem is None and b'"error"' in event and _is_error(event):
                self._problem = "error event"
        return first

    def finish(self) -> str | None:
        """The reason the stream is not a complete, successful one, or None."""
        if self._problem:
            return self._problem
        if self._rest.strip():
            return "stream ended mid-event"
        if sse_data(self._last) != b"[DONE]":
            return "no [DONE]"
        if not self.saw_token:
            return "no token"
        return None


def sse_data(event: bytes) -> bytes | None:
    """The payload of an event's `data:` line (OpenAI-style streams send one per event)."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            return line[5:].lstrip(b" ")
    return None


def _event_json(event: bytes) -> dict[str, Any] | None:
    data = sse_data(event)
    if not data or not data.startswith(b"{"):
        return None
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


def _carries_token(event: bytes) -> bool:
    doc = _event_json(event)
    if doc is None:
        return False
    for choice in doc.get("choices") or ():
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if isinstance(delta, dict) and any(delta.get(key) for key in _TOKEN_FIELDS):
            return True
    return False


def _is_error(event: bytes) -> bool:
    doc = _event_json(event)
    return doc is not None and "error" in doc

"""How the fidelity tests compare a simulator with a real vLLM, as a client sees them: the
shape of a JSON value (keys and JSON types, not values) and an SSE body's events, its framing
checked on the way."""

from __future__ import annotations

from typing import Any


def shape(value: Any) -> Any:
    """The structure a client parses: keys, and each value's JSON type (lists: the shapes
    of their items, deduplicated, since lengths depend on sampled text)."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        shapes: list[Any] = []
        for item in value:
            if shape(item) not in shapes:
                shapes.append(shape(item))
        return shapes
    return "number" if isinstance(value, int | float) and not isinstance(value, bool) \
        else type(value).__name__


def events(raw: bytes) -> list[bytes]:
    """SSE `data:` payloads, checking the framing on the way: `data: ` lines, blank-line ends."""
    assert raw.endswith(b"\n\n")
    frames = raw[:-2].split(b"\n\n")
    assert all(f.startswith(b"data: ") and b"\n" not in f for f in frames), raw[:300]
    return [f[6:] for f in frames]

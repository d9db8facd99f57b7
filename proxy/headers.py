"""Which headers cross the gateway, in each direction. Pure.

Upstream requests carry only what the gateway builds (content type, request id, the backend's own
key) plus the client headers an operator named in a backend's `forward_headers`. Credentials,
cookies and framing (hop-by-hop headers and any header nominated by `Connection`, RFC 9110
§7.6.1) never cross, whatever the configuration says. Responses to clients are always built by the
gateway; upstream response headers are never copied (their framing and encoding are not ours).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

# RFC 9110 §7.6.1 hop-by-hop headers plus the framing headers a proxy must rebuild itself.
HOP_BY_HOP = frozenset(
    {
        "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
        "upgrade", "proxy-authenticate", "proxy-authorization", "content-length", "host",
        "content-encoding", "expect",
    }
)

# Secrets and identity: never forwarded, even when a pattern in forward_headers would match.
SECRET = frozenset({"authorization", "x-api-key", "cookie", "set-cookie", "x-goog-api-key"})

NEVER_FORWARDED = HOP_BY_HOP | SECRET

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


class HeaderRule:
    """A backend's `forward_headers` list compiled once: exact names and `prefix*` patterns."""

    __slots__ = ("exact", "prefixes")

    def __init__(self, patterns: Iterable[str]) -> None:
        exact: set[str] = set()
        prefixes: list[str] = []
        for pattern in patterns:
            name = pattern.strip().lower()
            if name.endswith("*"):
                prefixes.append(name[:-1])
            elif name:
                exact.add(name)
        self.exact = frozenset(exact)
        self.prefixes = tuple(prefixes)

    def __bool__(self) -> bool:
        return bool(self.exact or self.prefixes)

    def select(self, client_headers: Mapping[str, str]) -> dict[str, str]:
        """The client headers this rule lets through (never secrets, framing or nominated ones)."""
        if not self:
            return {}
        nominated = _nominated_by_connection(client_headers.get("Connection", ""))
        out: dict[str, str] = {}
        for name, value in client_headers.items():
            lower = name.lower()
            if lower in NEVER_FORWARDED or lower in nominated:
                continue
            if lower in self.exact or lower.startswith(self.prefixes):
                out[lower] = value
        return out


def _nominated_by_connection(value: str) -> frozenset[str]:
    return frozenset(token.strip().lower() for token in value.split(",") if token.strip())


def request_id_from(client_value: str | None, fresh: str) -> str:
    """Keep a caller's well-formed X-Request-Id (for tracing), otherwise use a fresh one."""
    if client_value and _REQUEST_ID.fullmatch(client_value):
        return client_value
    return fresh

"""What the keep-alive client writes: where a request goes (`Target`, parsed once per backend
and path) and the request head (a POST with its length; the caller's headers checked, the
client's own framing headers its alone).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from yarl import URL

from proxy.upstream.http1_errors import BadHeader


@dataclass(frozen=True, slots=True)
class Target:
    """Where a request goes: the connection's origin and the request line's target, parsed
    once per backend and path."""

    origin: tuple[str, str, int]  # scheme, host, port
    host_header: bytes
    path: bytes  # the request target: path and query, as the URL spells them

    @classmethod
    def of(cls, url: str) -> Target:
        parsed = URL(url, encoded=True)
        if parsed.scheme not in ("http", "https") or not parsed.host or parsed.port is None:
            raise ValueError(f"not an http(s) URL: {url!r}")
        host = (parsed.raw_host or parsed.host).lower()
        shown = f"[{host}]" if ":" in host else host  # an IPv6 literal
        host_header = shown if parsed.is_default_port() else f"{shown}:{parsed.port}"
        return cls((parsed.scheme, host, parsed.port), host_header.encode("ascii"),
                   (parsed.raw_path_qs or "/").encode())


def request_head(target: Target, headers: Mapping[str, str], length: int) -> bytes:
    lines = [b"POST %b HTTP/1.1\r\nHost: %b\r\nContent-Length: %d\r\n"
             % (target.path, target.host_header, length)]
    accept = False
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\0" in value:
            raise BadHeader(f"the {name} header has a line break")
        lower = name.lower()
        if lower in ("host", "content-length", "transfer-encoding", "connection"):
            continue  # this client's own framing
        accept = accept or lower == "accept"
        lines.append(b"%b: %b\r\n" % (name.encode("ascii"),
                                      value.encode("utf-8", "surrogateescape")))
    if not accept:
        lines.append(b"Accept: */*\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)

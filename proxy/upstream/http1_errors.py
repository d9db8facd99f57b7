"""How an exchange with a backend fails, as the keep-alive client (proxy.upstream.http1) raises it
and its callers (proxy.upstream.client, the relay) catch it:

    ConnectionError
      ConnectFailed    no connection (refused, unreachable, unresolvable, TLS handshake)
      Disconnected     the server closed or reset the connection before the answer ended
    TimeoutError
      ConnectTimeout   no connection within the connect timeout
      ReadTimeout      no answer within the first-byte timeout, or too long a gap in the body
    BadResponse        bytes that are not an HTTP/1.x answer (or a body that does not decompress)
    ValueError
      BadHeader        a request header value with a line break or NUL (never sent)
"""

from __future__ import annotations


class ConnectFailed(ConnectionError):
    """No connection could be made (refused, unreachable, unresolvable, TLS handshake)."""


class ConnectTimeout(TimeoutError):
    """The connection was not made within the connect timeout."""


class Disconnected(ConnectionError):
    """The server closed or reset the connection before the answer ended."""


class ReadTimeout(TimeoutError):
    """No answer within the first-byte timeout, or a gap in the body longer than the idle one."""


class BadResponse(Exception):
    """Bytes that are not an HTTP/1.x answer."""


class BadHeader(ValueError):
    """A header value with a line break or NUL: never written to a backend."""

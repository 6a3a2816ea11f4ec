"""What a Wire exchange can fail with (the contracts are in :mod:`fleetroll._internal.wire`)."""

from __future__ import annotations

__all__ = [
    "BadResponse",
    "BodyTooLarge",
    "ConnectFailed",
    "ConnectionLost",
    "ProxyError",
    "WireError",
]


class WireError(Exception):
    """An HTTP exchange that did not produce an answer."""


class ConnectFailed(WireError):
    """No connection could be opened: the request never left."""


class ConnectionLost(WireError):
    """The connection broke after the request may have left."""


class BodyTooLarge(WireError):
    """The answer's body passed the cap; reading stopped and the connection was closed."""

    def __init__(self, message: str, *, limit: int) -> None:
        super().__init__(message)
        self.limit = limit


class BadResponse(WireError):
    """The server's bytes are not HTTP/1.1 as the parser knows it."""


class ProxyError(WireError):
    """The proxy answered a ``CONNECT`` with something other than 2xx: the request never left.

    ``transient`` (a 5xx: the proxy could not reach the target) is read by
    :func:`fleetroll._internal.retrying.decide`.
    """

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status
        self.transient = status >= 500

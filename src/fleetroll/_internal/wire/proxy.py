"""Proxies: a proxy URL read for the Wire, and ``CONNECT`` tunnels through one.

Which proxy a URL goes through is :class:`fleetroll._internal.proxies.Proxies`'
(httpx's rules); this module turns the proxy's URL into where to connect and
what to send it (:func:`parse_proxy`), and opens a tunnel to an ``https://``
target with TLS to the target itself (:func:`open_tunnel`).
"""

from __future__ import annotations

import asyncio
import base64
import ssl
from dataclasses import dataclass
from typing import cast
from urllib.parse import unquote, urlsplit

from fleetroll._internal.wire.connection import HEAD_CAP, Connection
from fleetroll._internal.wire.errors import ProxyError

__all__ = ["Proxy", "basic_auth", "bracketed", "open_tunnel", "parse_proxy"]

_DEFAULT_PORTS = {"http": 80, "https": 443}


class _Tunnel(asyncio.Protocol):
    """A proxy's answer to ``CONNECT``: bytes up to the end of its head."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.head: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.head.done():
            return
        self._buffer += data
        end = self._buffer.find(b"\r\n\r\n")
        if end >= 0:
            # All of it: a refusal may come with a body; a 2xx may not (the
            # target speaks only after TLS), which open_tunnel checks.
            self.head.set_result(self._buffer)
        elif len(self._buffer) > HEAD_CAP:
            self.head.set_result(b"")

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.head.done():
            self.head.set_exception(ConnectionResetError("the proxy closed the connection"))


def basic_auth(user: str, password: str) -> str:
    token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
    return f"Basic {token}"


def bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True, slots=True)
class Proxy:
    """A proxy as the Wire reaches it."""

    host: str
    port: int
    tls: bool
    url: str  # without credentials: for messages
    authorization: str | None  # Proxy-Authorization


def parse_proxy(url: str) -> Proxy:
    """Raises ValueError: not an http(s) proxy URL (a SOCKS one is named)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("socks5", "socks5h"):
        raise ValueError("a SOCKS proxy is not supported by fleetroll's client; use an http proxy")
    if scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("not an http(s) proxy URL")  # the URL may hold a password: not shown
    port = parts.port or _DEFAULT_PORTS[scheme]
    authorization = None
    if parts.username is not None or parts.password is not None:
        user, password = unquote(parts.username or ""), unquote(parts.password or "")
        if user or password:
            authorization = basic_auth(user, password)
    shown = f"{scheme}://{bracketed(parts.hostname)}:{port}"
    return Proxy(parts.hostname, port, scheme == "https", shown, authorization)


async def open_tunnel(
    proxy: Proxy,
    host: str,
    port: int,
    *,
    to_proxy: ssl.SSLContext | None,
    to_target: ssl.SSLContext,
) -> Connection:
    """A connection to ``host:port`` inside the proxy's ``CONNECT`` tunnel, TLS to the target.

    ``to_proxy``: the TLS context to an https proxy itself (None for an http one).
    """
    loop = asyncio.get_running_loop()
    transport, tunnel = await loop.create_connection(
        _Tunnel,
        proxy.host,
        proxy.port,
        ssl=to_proxy,
        server_hostname=proxy.host if to_proxy is not None else None,
    )
    try:
        authority = f"{bracketed(host)}:{port}"
        lines = [f"CONNECT {authority} HTTP/1.1\r\nhost: {authority}\r\n"]
        if proxy.authorization is not None:
            lines.append(f"proxy-authorization: {proxy.authorization}\r\n")
        lines.append("\r\n")
        transport.write("".join(lines).encode("latin-1"))
        answer = await tunnel.head
        head, _, rest = answer.partition(b"\r\n\r\n")
        status, reason = _status_line(head)
        if not 200 <= status < 300 or rest:
            what = f"{status} {reason}".strip() if status else "a malformed answer"
            if 200 <= status < 300:
                what = f"{what}, followed by bytes before TLS"
            raise ProxyError(
                f"the proxy {proxy.url} refused the tunnel to {authority}: {what}",
                status=status,
            )
        conn = Connection()
        tls = await loop.start_tls(transport, conn, to_target, server_hostname=host)
        if tls is None:  # pragma: no cover - the loop closed the transport
            raise ConnectionResetError("the tunnel closed during TLS set-up")
        conn.connection_made(tls)
        return conn
    except BaseException:
        transport.close()
        raise


def _status_line(head: bytes) -> tuple[int, str]:
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        return 0, ""
    return int(parts[1]), parts[2] if len(parts) > 2 else ""

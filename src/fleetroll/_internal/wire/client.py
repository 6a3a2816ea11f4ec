"""The Wire: keep-alive connections pooled per route, and the one loop that sends a request.

A URL is split once (:meth:`Wire._split`: its route, the start of its
request head, its proxy); each request is encoded into bytes, sent on an
idle connection of its route or a new one, and sent again on a new one only
as the module :mod:`fleetroll._internal.wire` says (:meth:`Wire._send`, the
one retry loop of :meth:`Wire.request` and :meth:`Wire.stream`). A stream's
context (:class:`Stream`) lives here too: it uses the pool on entry and exit.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from fleetroll._internal.deadlines import fail_after
from fleetroll._internal.proxies import Proxies
from fleetroll._internal.wire.connection import Connection, Response
from fleetroll._internal.wire.errors import ConnectFailed, ConnectionLost
from fleetroll._internal.wire.proxy import Proxy, basic_auth, bracketed, open_tunnel, parse_proxy
from fleetroll._internal.wire.stream import StreamResponse

__all__ = ["Route", "Stream", "Target", "Wire"]

#: Methods that may be sent twice (RFC 9110's idempotent ones).
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})


@dataclass(frozen=True, slots=True)
class Route:
    """Where a connection goes, and the key of its idle list."""

    host: str  # the host connected to (the target's, or the proxy's when forwarding)
    port: int
    tls: bool  # TLS on the connection itself (to the target, or to an https proxy)
    proxy: Proxy | None
    tunnel: bool  # CONNECT through ``proxy``, then TLS to host:port


@dataclass(frozen=True, slots=True)
class Target:
    route: Route
    head: str  # "{target} HTTP/1.1\r\nhost: ...\r\n" plus the headers the URL brings
    authorization: bool  # the URL's user info sets Authorization
    shown: str  # the origin for messages, without credentials


class Wire:
    """Keep-alive HTTP/1.1 connections, one idle list per route.

    Args:
        keepalive_s: how long an idle connection may be reused (keep it
            under the servers' own keep-alive time).
        connect_timeout_s: bound of opening a connection (TLS and a proxy's
            tunnel included).
        verify: the TLS context for ``https://`` (default: verified).
        max_idle: idle connections kept per route; more are closed.
        proxy: the proxy for every URL (``http://[user:pw@]host:port``),
            instead of the environment's.
        trust_env: read the proxies from the environment (see the module),
            once, here.

    Raises:
        ValueError: a proxy URL (given or from the environment) that is not
            an http(s) one.
    """

    def __init__(
        self,
        *,
        keepalive_s: float = 5.0,
        connect_timeout_s: float = 10.0,
        verify: ssl.SSLContext | None = None,
        max_idle: int = 1024,
        proxy: str | None = None,
        trust_env: bool = True,
    ) -> None:
        self._keepalive_s = keepalive_s
        self._connect_timeout_s = connect_timeout_s
        self._verify = verify
        self._system_tls: ssl.SSLContext | None = None  # made once, on first use
        self._max_idle = max_idle
        if proxy is not None:
            parse_proxy(proxy)  # refused here, not at the first request
            self._proxies = Proxies.through(proxy)
        else:
            self._proxies = Proxies.from_environment() if trust_env else Proxies()
        self._parsed: dict[str, Proxy] = {}
        self._idle: dict[Route, deque[Connection]] = {}
        #: Split URLs (a rollout sends many requests to the same few).
        self._targets: dict[str, Target] = {}
        self._closed = False

    async def __aenter__(self) -> Wire:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every idle connection; requests under way close theirs."""
        self._closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
        self._idle.clear()

    def _proxy_for(self, scheme: str, host: str, port: int | None) -> Proxy | None:
        if not self._proxies.rules:
            return None
        origin = f"{scheme}://{bracketed(host)}" + ("" if port is None else f":{port}")
        url = self._proxies.for_url(origin)
        if url is None:
            return None
        found = self._parsed.get(url)
        if found is None:
            found = self._parsed[url] = parse_proxy(url)
        return found

    def _split(self, url: str) -> Target:
        """How a URL is reached and the start of its request head."""
        found = self._targets.get(url)
        if found is not None:
            return found
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        host = parts.hostname
        if scheme not in ("http", "https") or not host:
            raise ValueError(f"not an http(s) URL: {_without_userinfo(url)!r}")
        tls = scheme == "https"
        explicit = parts.port
        default = 443 if tls else 80
        port = explicit or default
        authority = bracketed(host) if explicit in (None, default) else f"{bracketed(host)}:{port}"
        path = parts.path or "/"
        if parts.query:
            path = f"{path}?{parts.query}"
        proxy = self._proxy_for(scheme, host, None if port == default else port)
        extra = ""
        if proxy is None:
            route = Route(host, port, tls, None, False)
            target = path
        elif tls:
            route = Route(host, port, True, proxy, True)
            target = path
        else:  # forwarded: the proxy reads the absolute URL
            route = Route(proxy.host, proxy.port, proxy.tls, proxy, False)
            target = f"http://{authority}{path}"
            if proxy.authorization is not None:
                extra = f"proxy-authorization: {proxy.authorization}\r\n"
        user, password = parts.username, parts.password
        authorization = False
        if user is not None or password is not None:
            user, password = unquote(user or ""), unquote(password or "")
            if user or password:
                extra += f"authorization: {basic_auth(user, password)}\r\n"
                authorization = True
        head = f"{target} HTTP/1.1\r\nhost: {authority}\r\n{extra}"
        shown = f"{scheme}://{authority}"
        found = Target(route, head, authorization, shown)
        if len(self._targets) >= 4096:
            self._targets.clear()
        self._targets[url] = found
        return found

    def _encode(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str] | None,
    ) -> tuple[Target, bytes]:
        if self._closed:
            raise RuntimeError("the Wire is closed")
        target = self._split(url)
        head = [method, " ", target.head]
        encoding = False
        if headers:
            for name, value in headers.items():
                if "\r" in value or "\n" in value:
                    raise ValueError(f"the header {name!r} holds a line break")
                size = len(name)  # lower-cased only when it could be one of the two
                if size == 15 and name.lower() == "accept-encoding":
                    encoding = True
                elif size == 13 and target.authorization and name.lower() == "authorization":
                    continue  # the URL's user info wins, as in httpx
                head.append(f"{name}: {value}\r\n")
        if not encoding:
            head.append("accept-encoding: identity\r\n")
        if body is not None or method in ("POST", "PUT", "PATCH"):
            head.append(f"content-length: {len(body or b'')}\r\n")
        head.append("\r\n")
        data = "".join(head).encode("latin-1") + (body or b"")
        return target, data

    async def request(
        self,
        method: str,
        url: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        max_bytes: int = 64 * 2**20,
        idempotent: bool = False,
    ) -> Response:
        """Send a request; its answer, read to its end.

        ``idempotent``: sending it twice is harmless (a create with its
        idempotency key), so it may be sent again as an idempotent method is.

        Raises:
            ConnectFailed, ConnectionLost, BodyTooLarge, BadResponse, ProxyError:
                see the module.
            ValueError: ``url`` is not an http(s) URL.
        """
        target, data = self._encode(method, url, body, headers)
        conn = await self._send(target, data, method, max_bytes, idempotent, False)
        response = conn.response()
        if not conn.closed:
            self._put_back(target.route, conn)
        return response

    def stream(
        self,
        method: str,
        url: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        max_bytes: int = 64 * 2**20,
    ) -> Stream:
        """Send a request; its answer as it arrives.

        ``async with wire.stream("GET", url) as response:`` gives the status
        and headers; ``async for chunk in response.aiter_bytes():`` the body
        (decoded, ``max_bytes`` applied). The connection is reused only when
        the whole answer arrived; leaving early or a cancel closes it.

        Raises:
            ConnectFailed, ConnectionLost, BadResponse, ProxyError: on entering
                (see the module); while reading also BodyTooLarge.
            ValueError: ``url`` is not an http(s) URL.
        """
        return Stream(self, method, url, body, headers, max_bytes)

    async def _send(
        self,
        target: Target,
        data: bytes,
        method: str,
        max_bytes: int,
        idempotent: bool,
        streaming: bool,
    ) -> Connection:
        """Send a request's bytes; the connection its answer (its head, for a
        stream) arrived on. The one retry loop: a reused idle connection the
        server closed before reading the request is replaced by a new one, when
        sending twice is harmless (see the module).

        Raises:
            ConnectFailed, ConnectionLost, BodyTooLarge, BadResponse, ProxyError.
        """
        route = target.route
        while True:
            conn, reused = self._idle_connection(route), True
            if conn is None:
                conn, reused = await self._open(target), False
            try:
                # start() hands over the connection's own future: no coroutine
                # of its own between this loop and the answer.
                await conn.start(data, max_bytes, method == "HEAD", streaming)
            except BaseException:
                conn.close()  # in an unknown state: never reused
                raise
            failed = conn.settle()
            if failed is None:
                return conn
            if (
                isinstance(failed, ConnectionLost)
                and reused
                and not conn.received
                and (idempotent or method in _IDEMPOTENT)
            ):
                continue  # closed by the server while idle: it never read this
            raise failed

    def _idle_connection(self, route: Route) -> Connection | None:
        idle = self._idle.get(route)
        if not idle:
            return None
        oldest_usable = time.monotonic() - self._keepalive_s
        while idle:
            conn = idle.pop()  # the most recently used first: the likeliest alive
            if conn.idle_since < oldest_usable or conn.stale():
                conn.close()
                continue
            return conn
        return None

    def _put_back(self, route: Route, conn: Connection) -> None:
        if self._closed:
            conn.close()
            return
        idle = self._idle.get(route)
        if idle is None:
            idle = self._idle[route] = deque()
        if len(idle) >= self._max_idle:
            idle.popleft().close()  # the longest idle goes
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def _open(self, target: Target) -> Connection:
        route = target.route
        proxy = route.proxy
        if route.tunnel:
            assert proxy is not None
            where = f"{target.shown} through the proxy {proxy.url}"
        elif proxy is not None:
            where = f"the proxy {proxy.url}"
        else:
            where = target.shown
        try:
            with fail_after(self._connect_timeout_s):
                if route.tunnel:
                    assert proxy is not None
                    conn = await open_tunnel(
                        proxy,
                        route.host,
                        route.port,
                        to_proxy=self._system_trust() if proxy.tls else None,
                        to_target=self._verify or self._system_trust(),
                    )
                else:
                    loop = asyncio.get_running_loop()
                    context = self._context(route.tls, proxy)
                    _, conn = await loop.create_connection(
                        Connection,
                        route.host,
                        route.port,
                        ssl=context,
                        server_hostname=route.host if context is not None else None,
                    )
        except TimeoutError as exc:
            raise ConnectFailed(
                f"no connection to {where} within {self._connect_timeout_s:g} s"
            ) from exc
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {where}: {exc}") from exc
        return conn

    def _system_trust(self) -> ssl.SSLContext:
        """The system's TLS context, built once: loading the CA bundle is ~30 ms of
        blocking work, which every new connection would otherwise pay on the loop."""
        if self._system_tls is None:
            self._system_tls = ssl.create_default_context()
        return self._system_tls

    def _context(self, tls: bool, proxy: Proxy | None) -> ssl.SSLContext | None:
        if not tls:
            return None
        if proxy is not None and proxy.tls:
            return self._system_trust()  # to the proxy itself: the system's trust
        return self._verify or self._system_trust()


class Stream:
    """``Wire.stream``'s context: the exchange's head on entry, its connection settled on exit."""

    __slots__ = (
        "_body",
        "_conn",
        "_headers",
        "_max_bytes",
        "_method",
        "_response",
        "_route",
        "_url",
        "_wire",
    )

    def __init__(
        self,
        wire: Wire,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str] | None,
        max_bytes: int,
    ) -> None:
        self._wire = wire
        self._method = method
        self._url = url
        self._body = body
        self._headers = headers
        self._max_bytes = max_bytes
        self._conn: Connection | None = None
        self._route: Route | None = None
        self._response: StreamResponse | None = None

    async def __aenter__(self) -> StreamResponse:
        wire = self._wire
        target, data = wire._encode(self._method, self._url, self._body, self._headers)
        self._route = target.route
        conn = await wire._send(target, data, self._method, self._max_bytes, False, True)
        self._conn = conn
        self._response = StreamResponse(conn, conn._status, conn._headers)
        return self._response

    async def __aexit__(self, *exc_info: object) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._response is not None:
            self._response._conn = None
        if conn.reusable():
            assert self._route is not None
            self._wire._put_back(self._route, conn)
        else:
            conn.close()


def _without_userinfo(url: str) -> str:
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()

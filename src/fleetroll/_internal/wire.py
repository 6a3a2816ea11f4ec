"""A small HTTP/1.1 keep-alive client for the hot path.

A rollout's requests (create, reset, MCP calls, verification, release) are
small JSON exchanges; through httpx (or httpx2) and their transports each
cost several times the bytes' own work. :class:`Wire` sends them on
asyncio protocol connections and parses answers with httptools' compiled
parser: one idle-connection list per origin, no request or response models.

Contracts:

* Deadlines are the caller's (``anyio.fail_after``, cancel scopes); a
  request cancelled or failed mid-way closes its connection, which is never
  reused. A connection is reused only after an answer read to its end that
  allows it, and for at most ``keepalive_s`` of idleness.
* :class:`ConnectFailed`: no connection could be opened, the request
  provably never left (safe to send again, a POST too).
  :class:`ConnectionLost`: the connection broke after the request may have
  left. :class:`BodyTooLarge`: the answer passed ``max_bytes`` (reading
  stopped there, the connection was closed). :class:`BadResponse`: the
  bytes are not HTTP/1.1 as the parser knows it.
* A reused idle connection that the server closed before answering a byte
  is the one case sent again on a new connection (the server closed it
  while idle; it never read the request), for every method.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

from fleetroll._internal.deadlines import fail_after

__all__ = [
    "BadResponse",
    "BodyTooLarge",
    "ConnectFailed",
    "ConnectionLost",
    "Response",
    "Wire",
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


@dataclass(frozen=True, slots=True)
class Response:
    """An answer read to its end."""

    status: int
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: a request, then its answer, in turn."""

    __slots__ = (
        "_body",
        "_cap",
        "_headers",
        "_keep_alive",
        "_parser",
        "_size",
        "_status",
        "_waiter",
        "closed",
        "idle_since",
        "received",
        "transport",
    )

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.received = False  # any byte of the current answer
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._status = 0
        self._headers: dict[str, str] = {}
        self._keep_alive = False
        self._body: list[bytes] = []
        self._size = 0
        self._cap = 0

    # -- asyncio.Protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (create_connection's), though not always a subclass
        # of asyncio.Transport: uvloop's is not (an isinstance check hung every
        # request on uvloop, the loop Ray's async actors and many trainers run).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(BadResponse("the server switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(BadResponse(f"a malformed HTTP answer ({exc})"))

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            # An answer delimited by the connection's close ends here.
            if self._status and not self._framed():
                waiter.set_result(None)
                return
            why = f" ({exc})" if exc else ""
            lost = ConnectionLost(f"the connection closed before the answer ended{why}")
            waiter.set_exception(lost)

    # -- httptools callbacks -------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self._cap:
            self._fail(
                BodyTooLarge(f"the answer is over {self._cap} bytes", limit=self._cap),
            )
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._keep_alive = self._parser.should_keep_alive()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- use -----------------------------------------------------------------------

    def _framed(self) -> bool:
        h = self._headers
        return "content-length" in h or "chunked" in h.get("transfer-encoding", "").lower()

    def _fail(self, exc: WireError) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def exchange(self, data: bytes, cap: int) -> Response:
        """Send one request's bytes and read its answer to its end."""
        assert self.transport is not None
        self._status = 0
        self._headers = {}
        self._body = []
        self._size = 0
        self._cap = cap
        self._keep_alive = False
        self.received = False
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            self.transport.write(data)
            await waiter
        except BaseException:
            self.close()  # in an unknown state: never reused
            raise
        finally:
            self._waiter = None
        body = b"".join(self._body)
        self._body = []
        if not self._keep_alive:
            self.close()
        return Response(self._status, self._headers, body)


@dataclass(frozen=True, slots=True)
class _Origin:
    host: str
    port: int
    tls: bool
    authority: str


class Wire:
    """Keep-alive HTTP/1.1 connections, one idle list per origin.

    Args:
        keepalive_s: how long an idle connection may be reused (keep it
            under the servers' own keep-alive time).
        connect_timeout_s: bound of opening a connection (TLS included).
        verify: the TLS context for ``https://`` (default: verified).
        max_idle: idle connections kept per origin; more are closed.
    """

    def __init__(
        self,
        *,
        keepalive_s: float = 5.0,
        connect_timeout_s: float = 10.0,
        verify: ssl.SSLContext | None = None,
        max_idle: int = 1024,
    ) -> None:
        self._keepalive_s = keepalive_s
        self._connect_timeout_s = connect_timeout_s
        self._verify = verify
        self._max_idle = max_idle
        self._idle: dict[_Origin, deque[_Connection]] = {}
        #: Split URLs (a rollout sends many requests to the same few).
        self._targets: dict[str, tuple[_Origin, str]] = {}
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

    def _split(self, url: str) -> tuple[_Origin, str]:
        """The origin of a URL and its request target (path and query)."""
        found = self._targets.get(url)
        if found is not None:
            return found
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        tls = scheme == "https"
        port = parts.port or (443 if tls else 80)
        origin = _Origin(parts.hostname, port, tls, parts.netloc)  # equal per origin
        target = parts.path or "/"
        if parts.query:
            target = f"{target}?{parts.query}"
        if len(self._targets) >= 4096:
            self._targets.clear()
        self._targets[url] = (origin, target)
        return origin, target

    async def request(
        self,
        method: str,
        url: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        max_bytes: int = 64 * 2**20,
    ) -> Response:
        """Send a request; its answer, read to its end.

        Raises:
            ConnectFailed, ConnectionLost, BodyTooLarge, BadResponse: see the module.
            ValueError: ``url`` is not an http(s) URL.
        """
        if self._closed:
            raise RuntimeError("the Wire is closed")
        origin, target = self._split(url)
        head = [f"{method} {target} HTTP/1.1\r\nhost: {origin.authority}\r\n"]
        if headers:
            for name, value in headers.items():
                if "\r" in value or "\n" in value:
                    raise ValueError(f"the header {name!r} holds a line break")
                head.append(f"{name}: {value}\r\n")
        if body is not None or method in ("POST", "PUT", "PATCH"):
            head.append(f"content-length: {len(body or b'')}\r\n")
        head.append("\r\n")
        data = "".join(head).encode("latin-1") + (body or b"")
        while True:
            conn, reused = self._idle_connection(origin), True
            if conn is None:
                conn, reused = await self._open(origin), False
            try:
                response = await conn.exchange(data, max_bytes)
            except ConnectionLost:
                if reused and not conn.received:
                    continue  # closed by the server while idle: it never read this
                raise
            if not conn.closed:
                self._put_back(origin, conn)
            return response

    def _idle_connection(self, origin: _Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        oldest_usable = time.monotonic() - self._keepalive_s
        while idle:
            conn = idle.pop()  # the most recently used first: the likeliest alive
            if conn.closed or conn.idle_since < oldest_usable:
                conn.close()
                continue
            return conn
        return None

    def _put_back(self, origin: _Origin, conn: _Connection) -> None:
        if self._closed:
            conn.close()
            return
        idle = self._idle.get(origin)
        if idle is None:
            idle = self._idle[origin] = deque()
        if len(idle) >= self._max_idle:
            idle.popleft().close()  # the longest idle goes
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def _open(self, origin: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        context: ssl.SSLContext | None = None
        if origin.tls:
            context = self._verify or ssl.create_default_context()
        try:
            with fail_after(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    _Connection,
                    origin.host,
                    origin.port,
                    ssl=context,
                    server_hostname=origin.host if context is not None else None,
                )
        except TimeoutError as exc:
            raise ConnectFailed(
                f"no connection to {origin.authority} within {self._connect_timeout_s:g} s"
            ) from exc
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {origin.authority}: {exc}") from exc
        return conn

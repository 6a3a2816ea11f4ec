"""A small HTTP/1.1 keep-alive client for the hot path.

A rollout's requests (create, reset, MCP calls, verification, release) are
small JSON exchanges; through httpx (or httpx2) and their transports each
cost several times the bytes' own work. :class:`Wire` sends them on
asyncio protocol connections and parses answers with httptools' compiled
parser: one idle-connection list per route, no request or response models.
It behaves as httpx does wherever the two could differ on the wire; every
such rule is resolved when the Wire is built or the first time a URL is
seen, never per request.

Contracts:

* Deadlines are the caller's (``anyio.fail_after``, cancel scopes); a
  request cancelled or failed mid-way closes its connection, which is never
  reused. A connection is reused only after an answer read to its end that
  allows it, and for at most ``keepalive_s`` of idleness; an idle connection
  the server already closed (its socket readable, as httpcore checks) is
  dropped before it is used.
* Answers are read as httpx reads them: interim ones (``100 Continue``,
  ``103 Early Hints``) are skipped; the answer to a ``HEAD`` ends at its
  head whatever its length says (its connection is then closed).
* :class:`ConnectFailed`: no connection could be opened, the request
  provably never left (safe to send again, a POST too).
  :class:`ConnectionLost`: the connection broke after the request may have
  left. :class:`BodyTooLarge`: the answer passed ``max_bytes`` (reading
  stopped there, the connection was closed). :class:`BadResponse`: the
  bytes are not HTTP/1.1 as the parser knows it, the header block is over
  100 KiB (httpcore's limit; reading stops there), or the body is in an
  encoding the Wire cannot decode. :class:`ProxyError`: the proxy refused
  to open a tunnel.
* Sent again: a request on a reused idle connection that the server closed
  before answering a byte, on a new connection, only when sending it twice
  is harmless: an idempotent method (GET, HEAD, OPTIONS, PUT, DELETE,
  TRACE), or a request its caller marks ``idempotent=True`` (the control
  plane's create, whose ``X-Request-ID`` Fleet answers idempotently). Any
  other POST is never sent twice.
* Encodings: every request says ``Accept-Encoding: identity`` unless the
  caller set one; an answer in ``gzip`` or ``deflate`` anyway is decoded as
  it arrives, with ``max_bytes`` applied to the decoded size (a zip bomb is
  :class:`BodyTooLarge`); any other encoding (``br``, ``zstd``) is a
  :class:`BadResponse` naming it (httpx would hand back the raw bytes).
* Proxies as httpx's ``trust_env`` reads them when the Wire is built:
  ``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY`` and ``NO_PROXY`` (either
  case, through :func:`urllib.request.getproxies`), with httpx's matching
  rules (``*`` turns proxies off; a name matches itself and its subdomains,
  a leading dot only subdomains; an IP address or ``localhost`` itself; a
  ``host:port`` entry that port only; a range such as ``10.0.0.0/8`` only
  its first address, as in httpx). ``proxy=`` overrides the environment for
  every URL, ``trust_env=False`` ignores it. ``http://`` targets go to the
  proxy in absolute form, ``https://`` ones through a ``CONNECT`` tunnel and
  TLS to the target itself; the proxy URL's user info becomes
  ``Proxy-Authorization: Basic``. Tunnelled, proxied and direct connections
  never share an idle list.
* A URL's user info (``http://user:pw@host/``) becomes ``Authorization:
  Basic`` (percent-decoded, as httpx does, and in its place: it wins over an
  ``Authorization`` the caller set) and appears in no ``Host`` header and
  no error message; nor does a proxy's.
* :meth:`Wire.stream` hands over status and headers as soon as they arrive
  and the body chunk by chunk (decoded, capped); its connection is reused
  only when the whole answer arrived, closed otherwise (the caller left
  early, was cancelled, or the answer failed).
"""

from __future__ import annotations

import asyncio
import base64
import json
import select
import ssl
import time
import zlib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import unquote, urlsplit

import httptools

from fleetroll._internal.deadlines import fail_after
from fleetroll._internal.proxies import Proxies

__all__ = [
    "BadResponse",
    "BodyTooLarge",
    "ConnectFailed",
    "ConnectionLost",
    "ProxyError",
    "Response",
    "StreamResponse",
    "Wire",
    "WireError",
]

#: The largest response header block read (httpcore's h11 limit).
HEAD_CAP = 100 * 1024
#: Unread body a stream buffers before it stops reading the socket.
_STREAM_BUFFER = 256 * 1024
#: Methods that may be sent twice (RFC 9110's idempotent ones).
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_HAS_POLL = hasattr(select, "poll")  # not on Windows: no idle check there


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


class _Extra(Exception):
    """Bytes after a complete answer: the connection cannot be reused."""


class _Inflate:
    """One ``gzip`` or ``deflate`` layer, decoded as httpx's decoders do."""

    __slots__ = ("_retry_raw", "_z", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        # deflate: zlib-wrapped as the RFC says, or raw as some servers send it.
        self._retry_raw = name == "deflate"
        self._z = zlib.decompressobj(zlib.MAX_WBITS | 16 if name == "gzip" else zlib.MAX_WBITS)

    def decompress(self, data: bytes, limit: int) -> bytes:
        try:
            out = self._z.decompress(data, limit)
        except zlib.error as exc:
            if self._retry_raw:
                self._retry_raw = False
                self._z = zlib.decompressobj(-zlib.MAX_WBITS)
                return self.decompress(data, limit)
            raise BadResponse(
                f"the answer's {self.name} encoding does not decode ({exc})"
            ) from None
        self._retry_raw = False
        return out

    def flush(self) -> bytes:
        try:
            return self._z.flush()
        except zlib.error as exc:  # pragma: no cover - flush rarely fails
            raise BadResponse(
                f"the answer's {self.name} encoding does not decode ({exc})"
            ) from None


def _undecodable(name: str, exc: zlib.error) -> BadResponse:
    return BadResponse(f"the answer's {name} encoding does not decode ({exc})")


def _decoders(encoding: str) -> list[_Inflate] | None:
    """The layers to undo for a ``Content-Encoding``, the last applied first."""
    layers: list[_Inflate] = []
    for value in reversed(encoding.split(",")):
        name = value.strip().lower()
        if name in ("gzip", "deflate"):
            layers.append(_Inflate(name))
        elif name not in ("", "identity"):
            raise BadResponse(
                f"the answer is in the content encoding {name!r}, which the client "
                "cannot decode (it asked for identity; gzip and deflate are decoded)"
            )
    return layers or None


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: a request, then its answer, in turn.

    The reader waits on ``_waiter``, which is only ever resolved with None:
    the state (``_error``, ``_complete``, ``_body``) says what happened. An
    exchange (``exchange``) is woken once, at the answer's end or failure; a
    stream also at its head and at each piece of body.
    """

    __slots__ = (
        "_active",
        "_body",
        "_buffered",
        "_cap",
        "_complete",
        "_decoders",
        "_error",
        "_head_bytes",
        "_headers",
        "_in_head",
        "_interim",
        "_keep_alive",
        "_no_body",
        "_parser",
        "_paused",
        "_size",
        "_status",
        "_streaming",
        "_waiter",
        "closed",
        "idle_since",
        "poller",
        "received",
        "transport",
    )

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.poller: select.poll | None = None
        self.closed = False
        self.idle_since = 0.0
        self.received = False  # any byte of the current answer
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._active = False  # an answer is expected
        self._status = 0
        self._headers: dict[str, str] = {}
        self._keep_alive = False
        self._no_body = False
        self._body: list[bytes] = []
        self._size = 0
        self._cap = 0
        self._in_head = True
        self._interim = False
        self._head_bytes = 0
        self._decoders: list[_Inflate] | None = None
        self._streaming = False
        self._complete = False
        self._error: WireError | None = None
        self._buffered = 0
        self._paused = False

    # -- asyncio.Protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (create_connection's), though not always a subclass
        # of asyncio.Transport: uvloop's is not (an isinstance check hung every
        # request on uvloop, the loop Ray's async actors and many trainers run).
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and _HAS_POLL:
            # For the idle check (stale): a poll object of its own costs a quarter
            # of a select call per reuse.
            self.poller = select.poll()
            self.poller.register(sock.fileno(), select.POLLIN)

    def data_received(self, data: bytes) -> None:
        if not self._active:  # bytes nobody asked for: the connection is spoiled
            self.close()
            return
        self.received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _Extra):
                self.close()
            elif isinstance(cause, WireError):
                self._fail(cause)
            else:
                self._fail(BadResponse(f"a malformed HTTP answer ({cause or exc})"))
            return
        except httptools.HttpParserUpgrade:
            self._fail(BadResponse("the server switched protocols"))
            return
        except httptools.HttpParserError as exc:
            self._fail(BadResponse(f"a malformed HTTP answer ({exc})"))
            return
        if self._in_head:
            # Checked after each read (at most the loop's read size past the cap),
            # before the parser buffers more: an endless header costs nothing.
            self._head_bytes += len(data)
            if self._head_bytes > HEAD_CAP:
                self._fail(BadResponse(f"the answer's header block is over {HEAD_CAP} bytes"))

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self._active or self._complete or self._error is not None:
            return
        if self._status and not self._framed():
            # An answer delimited by the connection's close ends here.
            try:
                self._flush()
            except WireError as failed:
                self._error = failed
            self._complete = True
        else:
            why = f" ({exc})" if exc else ""
            self._error = ConnectionLost(f"the connection closed before the answer ended{why}")
        self._wake()

    # -- httptools callbacks -------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._complete:
            raise _Extra  # a second answer to one request: stop parsing

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:
            # An interim answer (100 Continue, 103 Early Hints): skipped, as
            # httpx does; the answer follows on the same connection.
            self._interim = True
            self._headers = {}
            return
        self._in_head = False
        if self._no_body:
            # The answer to a HEAD: its length describes a body never sent, and
            # httptools cannot be told so: the answer ends here, and the parser
            # (expecting that body) goes with its connection.
            self._status = status
            self._complete = True
            self._wake()
            raise _Extra
        encoding = self._headers.get("content-encoding")
        if encoding is not None:
            self._decoders = _decoders(encoding)  # refused before the head is handed over
        self._status = status
        if self._streaming:
            self._wake()

    def on_body(self, body: bytes) -> None:
        if self._decoders is not None:
            body = self._decode(body)
            if not body:
                return
        self._add(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._keep_alive = self._parser.should_keep_alive()
        if self._decoders is not None:
            self._flush()
        self._complete = True
        self._wake()

    # -- body ----------------------------------------------------------------------

    def _add(self, body: bytes) -> None:
        size = self._size + len(body)
        if size > self._cap:
            raise BodyTooLarge(f"the answer is over {self._cap} bytes", limit=self._cap)
        self._size = size
        self._body.append(body)
        if self._streaming:
            self._buffered += len(body)
            if self._buffered > _STREAM_BUFFER and not self._paused and self.transport:
                self._paused = True
                self.transport.pause_reading()
            self._wake()

    def _decode(self, data: bytes) -> bytes:
        assert self._decoders is not None
        # One byte over what is left: enough to know the cap is passed, never
        # more (a few KiB that inflate to gigabytes stop at the cap).
        limit = self._cap - self._size + 1
        for layer in self._decoders:
            data = layer.decompress(data, limit)
            if len(data) >= limit:
                raise BodyTooLarge(
                    f"the answer is over {self._cap} bytes (decoded)", limit=self._cap
                )
        return data

    def _flush(self) -> None:
        if self._decoders is None:
            return
        data = b""
        limit = self._cap - self._size + 1
        for layer in self._decoders:
            if data:
                data = layer.decompress(data, limit)
            data += layer.flush()
        if data:
            self._add(data)

    # -- use -----------------------------------------------------------------------

    def _framed(self) -> bool:
        h = self._headers
        return "content-length" in h or "chunked" in h.get("transfer-encoding", "").lower()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, exc: WireError) -> None:
        if self._error is None:
            self._error = exc
        self._wake()
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def stale(self) -> bool:
        """Whether an idle connection was closed by its server (or sent bytes unasked)."""
        if self.closed:
            return True
        if self.poller is None:
            return False
        try:
            return bool(self.poller.poll(0))  # readable: the close (or bytes nobody asked for)
        except (OSError, ValueError):
            return True

    def _begin(self, cap: int, streaming: bool, no_body: bool) -> asyncio.Future[None]:
        self._status = 0
        self._headers = {}
        self._body = []
        self._size = 0
        self._cap = cap
        self._keep_alive = False
        self.received = False
        self._in_head = True
        self._head_bytes = 0
        self._decoders = None
        self._streaming = streaming
        self._no_body = no_body
        self._complete = False
        self._error = None
        self._active = True
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        return waiter

    async def exchange(self, data: bytes, cap: int, no_body: bool) -> Response:
        """Send one request's bytes and read its answer to its end."""
        assert self.transport is not None
        waiter = self._begin(cap, False, no_body)
        try:
            self.transport.write(data)
            await waiter
        except BaseException:
            self.close()  # in an unknown state: never reused
            raise
        finally:
            self._waiter = None
        self._active = False
        if self._error is not None:
            self.close()
            raise self._error
        body = b"".join(self._body)
        self._body = []
        if not self._keep_alive:
            self.close()
        return Response(self._status, self._headers, body)

    async def open_stream(self, data: bytes, cap: int, no_body: bool) -> None:
        """Send one request's bytes and wait for its answer's head."""
        assert self.transport is not None
        waiter = self._begin(cap, True, no_body)
        self._buffered = 0
        self._paused = False
        try:
            self.transport.write(data)
            await waiter
        except BaseException:
            self.close()
            raise
        finally:
            self._waiter = None
        if self._error is not None and not self._status:
            self.close()
            raise self._error

    async def next_chunk(self) -> bytes | None:
        """The body that arrived since the last call (waiting for some), or None at its end."""
        while True:
            body = self._body
            if body:
                chunk = body[0] if len(body) == 1 else b"".join(body)
                self._body = []
                self._buffered = 0
                if self._paused:
                    self._paused = False
                    if not self.closed and self.transport is not None:
                        self.transport.resume_reading()
                return chunk
            if self._error is not None:
                self.close()
                raise self._error
            if self._complete:
                return None
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    def reusable(self) -> bool:
        """After a stream: whether the whole answer arrived on a connection that stays open."""
        self._active = False
        return self._complete and self._error is None and self._keep_alive and not self.closed


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
            # target speaks only after TLS), which _open_tunnel checks.
            self.head.set_result(self._buffer)
        elif len(self._buffer) > HEAD_CAP:
            self.head.set_result(b"")

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.head.done():
            self.head.set_exception(ConnectionResetError("the proxy closed the connection"))


def _basic(user: str, password: str) -> str:
    token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
    return f"Basic {token}"


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True, slots=True)
class _Proxy:
    host: str
    port: int
    tls: bool
    url: str  # without credentials: for messages
    authorization: str | None  # Proxy-Authorization


def _parse_proxy(url: str) -> _Proxy:
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
            authorization = _basic(user, password)
    shown = f"{scheme}://{_bracketed(parts.hostname)}:{port}"
    return _Proxy(parts.hostname, port, scheme == "https", shown, authorization)


@dataclass(frozen=True, slots=True)
class _Route:
    """Where a connection goes, and the key of its idle list."""

    host: str  # the host connected to (the target's, or the proxy's when forwarding)
    port: int
    tls: bool  # TLS on the connection itself (to the target, or to an https proxy)
    proxy: _Proxy | None
    tunnel: bool  # CONNECT through ``proxy``, then TLS to host:port


@dataclass(frozen=True, slots=True)
class _Target:
    route: _Route
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
            _parse_proxy(proxy)  # refused here, not at the first request
            self._proxies = Proxies.through(proxy)
        else:
            self._proxies = Proxies.from_environment() if trust_env else Proxies()
        self._parsed: dict[str, _Proxy] = {}
        self._idle: dict[_Route, deque[_Connection]] = {}
        #: Split URLs (a rollout sends many requests to the same few).
        self._targets: dict[str, _Target] = {}
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

    def _proxy_for(self, scheme: str, host: str, port: int | None) -> _Proxy | None:
        if not self._proxies.rules:
            return None
        origin = f"{scheme}://{_bracketed(host)}" + ("" if port is None else f":{port}")
        url = self._proxies.for_url(origin)
        if url is None:
            return None
        found = self._parsed.get(url)
        if found is None:
            found = self._parsed[url] = _parse_proxy(url)
        return found

    def _split(self, url: str) -> _Target:
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
        authority = (
            _bracketed(host) if explicit in (None, default) else f"{_bracketed(host)}:{port}"
        )
        path = parts.path or "/"
        if parts.query:
            path = f"{path}?{parts.query}"
        proxy = self._proxy_for(scheme, host, None if port == default else port)
        extra = ""
        if proxy is None:
            route = _Route(host, port, tls, None, False)
            target = path
        elif tls:
            route = _Route(host, port, True, proxy, True)
            target = path
        else:  # forwarded: the proxy reads the absolute URL
            route = _Route(proxy.host, proxy.port, proxy.tls, proxy, False)
            target = f"http://{authority}{path}"
            if proxy.authorization is not None:
                extra = f"proxy-authorization: {proxy.authorization}\r\n"
        user, password = parts.username, parts.password
        authorization = False
        if user is not None or password is not None:
            user, password = unquote(user or ""), unquote(password or "")
            if user or password:
                extra += f"authorization: {_basic(user, password)}\r\n"
                authorization = True
        head = f"{target} HTTP/1.1\r\nhost: {authority}\r\n{extra}"
        shown = f"{scheme}://{authority}"
        found = _Target(route, head, authorization, shown)
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
    ) -> tuple[_Target, bytes]:
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
        route = target.route
        while True:
            conn, reused = self._idle_connection(route), True
            if conn is None:
                conn, reused = await self._open(target), False
            try:
                response = await conn.exchange(data, max_bytes, method == "HEAD")
            except ConnectionLost:
                if reused and not conn.received and (idempotent or method in _IDEMPOTENT):
                    continue  # closed by the server while idle: it never read this
                raise
            if not conn.closed:
                self._put_back(route, conn)
            return response

    def stream(
        self,
        method: str,
        url: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        max_bytes: int = 64 * 2**20,
    ) -> _Stream:
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
        return _Stream(self, method, url, body, headers, max_bytes)

    def _idle_connection(self, route: _Route) -> _Connection | None:
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

    def _put_back(self, route: _Route, conn: _Connection) -> None:
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

    async def _open(self, target: _Target) -> _Connection:
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
                    conn = await self._open_tunnel(route)
                else:
                    loop = asyncio.get_running_loop()
                    context = self._context(route.tls, proxy)
                    _, conn = await loop.create_connection(
                        _Connection,
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

    def _context(self, tls: bool, proxy: _Proxy | None) -> ssl.SSLContext | None:
        if not tls:
            return None
        if proxy is not None and proxy.tls:
            return self._system_trust()  # to the proxy itself: the system's trust
        return self._verify or self._system_trust()

    async def _open_tunnel(self, route: _Route) -> _Connection:
        """A connection to ``route`` inside a proxy's ``CONNECT`` tunnel, TLS to the target."""
        proxy = route.proxy
        assert proxy is not None
        loop = asyncio.get_running_loop()
        to_proxy = self._system_trust() if proxy.tls else None
        transport, tunnel = await loop.create_connection(
            _Tunnel,
            proxy.host,
            proxy.port,
            ssl=to_proxy,
            server_hostname=proxy.host if to_proxy is not None else None,
        )
        try:
            authority = f"{_bracketed(route.host)}:{route.port}"
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
            conn = _Connection()
            tls = await loop.start_tls(
                transport,
                conn,
                self._verify or self._system_trust(),
                server_hostname=route.host,
            )
            if tls is None:  # pragma: no cover - the loop closed the transport
                raise ConnectionResetError("the tunnel closed during TLS set-up")
            conn.connection_made(tls)
            return conn
        except BaseException:
            transport.close()
            raise


class StreamResponse:
    """An answer whose body is read as it arrives (see :meth:`Wire.stream`)."""

    __slots__ = ("_conn", "headers", "status")

    def __init__(self, conn: _Connection, status: int, headers: dict[str, str]) -> None:
        self._conn: _Connection | None = conn  # None once its context has ended
        self.status = status
        self.headers = headers  # lower-case names; a repeated header keeps its last value

    def aiter_bytes(self) -> StreamResponse:
        """The body, piece by piece as it arrives (decoded; ``max_bytes`` applied).

        Raises:
            BodyTooLarge, BadResponse, ConnectionLost: see the module.
        """
        return self

    def __aiter__(self) -> StreamResponse:
        return self

    async def __anext__(self) -> bytes:
        if self._conn is None:  # its connection may carry another answer by now
            raise RuntimeError("the stream was read after its `async with` ended")
        chunk = await self._conn.next_chunk()
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def aread(self) -> bytes:
        """The rest of the body.

        Raises:
            BodyTooLarge, BadResponse, ConnectionLost: see the module.
        """
        pieces = [chunk async for chunk in self]
        return b"".join(pieces)


class _Stream:
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
        self._conn: _Connection | None = None
        self._route: _Route | None = None
        self._response: StreamResponse | None = None

    async def __aenter__(self) -> StreamResponse:
        wire = self._wire
        target, data = wire._encode(self._method, self._url, self._body, self._headers)
        route = self._route = target.route
        while True:
            conn, reused = wire._idle_connection(route), True
            if conn is None:
                conn, reused = await wire._open(target), False
            try:
                await conn.open_stream(data, self._max_bytes, self._method == "HEAD")
            except ConnectionLost:
                if reused and not conn.received and self._method in _IDEMPOTENT:
                    continue
                raise
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


def _status_line(head: bytes) -> tuple[int, str]:
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        return 0, ""
    return int(parts[1]), parts[2] if len(parts) > 2 else ""


def _without_userinfo(url: str) -> str:
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()

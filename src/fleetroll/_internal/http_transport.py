"""httpx and httpx2 transports on aiohttp's connection pool and compiled HTTP parser.

The mcp client takes an ``httpx2.AsyncClient`` and the Fleet SDK an
``httpx.AsyncClient``; their default transports (httpcore over h11, pure
Python) were most of fleetroll's CPU per request. :class:`AiohttpTransport`
(httpx2) and :class:`SdkAiohttpTransport` (httpx) keep the clients'
interfaces (callers see httpx requests, responses and exceptions) and send
the bytes with aiohttp, whose response parser is compiled and whose pool
finds an idle connection per host without scanning the others.

Contracts kept from httpcore:

* Idle connections are reused for at most ``keepalive_s``
  (``timeouts.http_keepalive_s``), inside the time servers keep them.
* The request's own timeouts (``extensions["timeout"]``: pool, connect,
  read) bound getting a connection and each read. Only a connection that
  could not be had raises ``ConnectError`` / ``ConnectTimeout`` (the request
  never left: the one case :class:`fleetroll.tools.session.RetryRefusedConnections`
  sends again); a failure after that is ``ReadError``, ``ReadTimeout`` or
  ``RemoteProtocolError``.
* A response not read to its end is closed with its connection, never reused.
* Proxies as httpx would choose them from the environment (``HTTP_PROXY``,
  ``HTTPS_PROXY``, ``ALL_PROXY``, ``NO_PROXY``: :class:`fleetroll._internal.proxies.Proxies`),
  CONNECT for https: a client given a transport of its own no longer reads them itself.
  A proxy that refuses the tunnel is ``ProxyError``.
* User info in a URL is the Basic ``Authorization`` the httpx client already made
  of it, never sent again by aiohttp (which refuses both at once).
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import httpx2

from fleetroll._internal.proxies import Proxies

__all__ = ["AiohttpTransport", "SdkAiohttpTransport"]


@dataclass(frozen=True, slots=True)
class _Errors:
    """One httpx flavour's exception types."""

    connect: type[Exception]
    connect_timeout: type[Exception]
    read_timeout: type[Exception]
    protocol: type[Exception]
    read: type[Exception]
    proxy: type[Exception]


_HTTPX2 = _Errors(
    httpx2.ConnectError,
    httpx2.ConnectTimeout,
    httpx2.ReadTimeout,
    httpx2.RemoteProtocolError,
    httpx2.ReadError,
    httpx2.ProxyError,
)
_HTTPX = _Errors(
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.ReadTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.ProxyError,
)


@contextmanager
def _translated(errors: _Errors) -> Iterator[None]:
    """aiohttp's exceptions as httpx's: "never sent" only when no connection was had."""
    try:
        yield
    except aiohttp.ClientHttpProxyError as exc:  # the proxy refused the tunnel
        raise errors.proxy(f"the proxy answered {exc.status} to CONNECT") from exc
    except aiohttp.ClientConnectorError as exc:  # DNS, refused, TLS: never sent
        raise errors.connect(str(exc) or type(exc).__name__) from exc
    except aiohttp.ConnectionTimeoutError as exc:  # no connection in time: never sent
        raise errors.connect_timeout(str(exc) or "connect timed out") from exc
    except TimeoutError as exc:  # aiohttp's read timeout (sock_read), and any other
        raise errors.read_timeout(str(exc) or "read timed out") from exc
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
        raise errors.protocol(str(exc) or type(exc).__name__) from exc
    except aiohttp.ClientResponseError as exc:  # a malformed answer
        raise errors.protocol(str(exc) or type(exc).__name__) from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise errors.read(str(exc) or type(exc).__name__) from exc


class _Body(httpx.AsyncByteStream, httpx2.AsyncByteStream):
    """An aiohttp response's body, as either httpx reads it."""

    def __init__(self, response: aiohttp.ClientResponse, errors: _Errors) -> None:
        self._response = response
        self._errors = errors

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _translated(self._errors):
            async for chunk in self._response.content.iter_any():
                yield chunk

    async def aclose(self) -> None:
        # Read to the end: the connection goes back to the pool; else it is closed.
        self._response.release()


_VERSIONS = {aiohttp.HttpVersion10: b"HTTP/1.0", aiohttp.HttpVersion11: b"HTTP/1.1"}


class _Pool:
    """One aiohttp session, made on first use (inside the event loop)."""

    def __init__(
        self,
        *,
        verify: ssl.SSLContext | bool,
        keepalive_s: float,
        max_connections: int,
        proxies: Proxies | None,
    ) -> None:
        self._verify = verify
        self._keepalive_s = keepalive_s
        self._max_connections = max_connections
        self._proxies = Proxies.from_environment() if proxies is None else proxies
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            ssl=self._verify,
            limit=self._max_connections,
            limit_per_host=0,
            keepalive_timeout=self._keepalive_s,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),  # the httpx client keeps the cookies
            auto_decompress=False,  # the httpx client decodes by the response's headers
            timeout=aiohttp.ClientTimeout(total=None),
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
        )
        return self._session

    async def send(
        self,
        method: str,
        url: Any,
        headers: list[tuple[str, str]],
        data: Any,
        timeouts: Mapping[str, float | None],
        errors: _Errors,
    ) -> tuple[aiohttp.ClientResponse, dict[str, Any]]:
        session = self._session or self._open()
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=timeouts.get("pool"),
            sock_connect=timeouts.get("connect"),
            sock_read=timeouts.get("read"),
        )
        proxy = self._proxies.for_url(url)
        if url.userinfo:  # already the request's Authorization header (httpx made it)
            url = url.copy_with(username=None, password=None)
        with _translated(errors):
            response = await session.request(
                method,
                str(url),
                headers=headers,
                data=data,
                allow_redirects=False,
                timeout=timeout,
                proxy=proxy,
            )
        extensions = {
            "http_version": _VERSIONS.get(response.version or aiohttp.HttpVersion11, b"HTTP/1.1"),
            "reason_phrase": (response.reason or "").encode("ascii", "replace"),
        }
        return response, extensions

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()


async def _chunks(stream: Any) -> AsyncIterator[bytes]:
    async for chunk in stream:
        yield chunk


async def _forward(pool: _Pool, request: Any, library: Any, errors: _Errors) -> Any:
    """Send an httpx or httpx2 ``request`` (``library`` is its module) over ``pool``."""
    try:
        data: Any = request.content
    except library.RequestNotRead:
        data = _chunks(request.stream)  # a streamed upload
    response, extensions = await pool.send(
        request.method,
        request.url,
        request.headers.multi_items(),
        data,
        request.extensions.get("timeout", {}),
        errors,
    )
    return library.Response(
        status_code=response.status,
        headers=response.raw_headers,
        stream=_Body(response, errors),
        extensions=extensions,
    )


class AiohttpTransport(httpx2.AsyncBaseTransport):
    """httpx2 requests over one aiohttp session (the mcp client's).

    Args:
        verify: the TLS context for https (one per process: building one is costly).
        keepalive_s: how long an idle connection may be reused.
        max_connections: connections open at once (0: no limit).
        proxies: which proxy each URL goes through (default: the environment's, read now).

    Raises:
        ValueError: the environment names a proxy of a scheme other than http(s).
    """

    def __init__(
        self,
        *,
        verify: ssl.SSLContext | bool,
        keepalive_s: float,
        max_connections: int,
        proxies: Proxies | None = None,
    ) -> None:
        self._pool = _Pool(
            verify=verify,
            keepalive_s=keepalive_s,
            max_connections=max_connections,
            proxies=proxies,
        )

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response: httpx2.Response = await _forward(self._pool, request, httpx2, _HTTPX2)
        return response

    async def aclose(self) -> None:
        await self._pool.aclose()


class SdkAiohttpTransport(httpx.AsyncBaseTransport):
    """httpx requests over one aiohttp session (the Fleet SDK's); as :class:`AiohttpTransport`."""

    def __init__(
        self,
        *,
        verify: ssl.SSLContext | bool,
        keepalive_s: float,
        max_connections: int,
        proxies: Proxies | None = None,
    ) -> None:
        self._pool = _Pool(
            verify=verify,
            keepalive_s=keepalive_s,
            max_connections=max_connections,
            proxies=proxies,
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response: httpx.Response = await _forward(self._pool, request, httpx, _HTTPX)
        return response

    async def aclose(self) -> None:
        await self._pool.aclose()

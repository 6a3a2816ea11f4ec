"""HTTP servers on loopback for the client tests (the Wire's, the aiohttp transports').

Raw sockets, so each test decides how it answers: :func:`serving` (plain, or
TLS with :func:`serving_tls`) reads each request head and body, counts
connections and requests, and hands the head to the test's :data:`Handler`;
:func:`proxying` is a forward proxy (absolute-form requests and ``CONNECT``
tunnels) that records the first request head of every connection.
"""

from __future__ import annotations

import base64
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import anyio
import trustme
from anyio.abc import SocketStream
from anyio.streams.tls import TLSListener

BIG = 1_000_000


class Server:
    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[bytes] = []
        self.port = 0


Handler = Callable[[Server, SocketStream, bytes], Awaitable[bool]]


async def answer_ok(server: Server, stream: SocketStream, head: bytes) -> bool:
    await stream.send(b'HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{"ok":true}')
    return True


async def answer_big(server: Server, stream: SocketStream, head: bytes) -> bool:
    await stream.send(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % BIG)
    await stream.send(b"x" * BIG)
    return True


async def never_answer(server: Server, stream: SocketStream, head: bytes) -> bool:
    await anyio.sleep_forever()
    return False


async def _read_head(stream: Any, buffer: bytes) -> tuple[bytes, bytes] | None:
    """A request head (without its blank line) and the bytes after it, or None if
    the peer left first."""
    while b"\r\n\r\n" not in buffer:
        try:
            buffer += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            return None
    head, _, rest = buffer.partition(b"\r\n\r\n")
    return head, rest


@asynccontextmanager
async def serving(handler: Handler, *, tls: ssl.SSLContext | None = None) -> AsyncIterator[Server]:
    """A server answering each request with ``handler`` (over TLS with ``tls``)."""
    server = Server()

    async def serve(stream: Any) -> None:
        server.connections += 1
        buffer = b""
        async with stream:
            while True:
                read = await _read_head(stream, buffer)
                if read is None:
                    return
                head, buffer = read
                length = next(
                    (
                        int(line.split(b":", 1)[1])
                        for line in head.lower().split(b"\r\n")
                        if line.startswith(b"content-length:")
                    ),
                    0,
                )
                while len(buffer) < length:
                    buffer += await stream.receive()
                buffer = buffer[length:]
                server.requests.append(head)
                try:
                    if not await handler(server, stream, head):
                        return
                except (anyio.BrokenResourceError, OSError):
                    return

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    server.port = listener.extra(anyio.abc.SocketAttribute.local_port)
    served = listener if tls is None else TLSListener(listener, tls, standard_compatible=False)
    async with served, anyio.create_task_group() as tg:
        tg.start_soon(served.serve, serve)
        yield server
        tg.cancel_scope.cancel()


@asynccontextmanager
async def serving_tls(handler: Handler, ca: trustme.CA) -> AsyncIterator[Server]:
    """:func:`serving` behind TLS, with a certificate of ``ca`` for 127.0.0.1."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    async with serving(handler, tls=context) as server:
        yield server


def trusting(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


class Proxy:
    def __init__(self) -> None:
        self.heads: list[str] = []  # the first request head of every connection
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@asynccontextmanager
async def proxying(*, credentials: tuple[str, str] | None = None) -> AsyncIterator[Proxy]:
    """A forward proxy on loopback: absolute-form requests and CONNECT tunnels."""
    proxy = Proxy()
    wanted = None
    if credentials is not None:
        token = base64.b64encode(":".join(credentials).encode()).decode()
        wanted = f"proxy-authorization: basic {token}".lower()

    async def handle(client: SocketStream) -> None:
        async with client:
            read = await _read_head(client, b"")
            if read is None:
                return
            head, rest = read
            text = head.decode("latin-1")
            proxy.heads.append(text)
            method, target, _ = text.split("\r\n", 1)[0].split(" ", 2)
            if wanted is not None and wanted not in text.lower():
                await client.send(  # with a page, as squid's
                    b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 6\r\n"
                    b"Proxy-Authenticate: Basic realm=x\r\n\r\ndenied"
                )
                return
            if method == "CONNECT":
                host, _, port = target.rpartition(":")
                upstream = await anyio.connect_tcp(host.strip("[]"), int(port))
                await client.send(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                parts = urlsplit(target)
                assert parts.hostname is not None, "not an absolute-form request"
                upstream = await anyio.connect_tcp(parts.hostname, parts.port or 80)
                await upstream.send(head + b"\r\n\r\n" + rest)
            async with upstream, anyio.create_task_group() as tg:

                async def copy(source: SocketStream, sink: SocketStream) -> None:
                    try:
                        async for data in source:
                            await sink.send(data)
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(copy, client, upstream)
                tg.start_soon(copy, upstream, client)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    proxy.port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        yield proxy
        tg.cancel_scope.cancel()

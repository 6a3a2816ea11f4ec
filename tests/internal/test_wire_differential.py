"""The hand-written client against httpx, case by case (issue 37's wire cases).

Each case sends the same requests through three clients and holds each to the
same observable outcome (the status and body, or an error of the same kind),
with the server's own view of what arrived:

* ``wire``: :class:`fleetroll._internal.wire.Wire`, the direct control client's
  and the thin MCP client's (the default modes);
* ``httpx``: a plain ``httpx.AsyncClient``, the reference;
* ``sdk``: an ``httpx.AsyncClient`` over
  :class:`fleetroll._internal.http_transport.SdkAiohttpTransport`, the SDK
  modes' (``provisioning.control_client = "sdk"``; ``pool.mcp_client = "sdk"``
  uses its httpx2 twin over the same pool).

The server is a raw HTTP/1.1 server on loopback (each case answers as the case
needs, by the request's path); proxies are real ones (:mod:`wire_infra`):
squid as the forward proxy, nginx terminating TLS with a test CA.
"""

from __future__ import annotations

import base64
import gzip
import json
import ssl
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx
import pytest
from anyio.abc import SocketAttribute, SocketStream

from fleetroll._internal.http_transport import SdkAiohttpTransport
from fleetroll._internal.wire import ConnectFailed, Wire, WireError
from fleetroll.pool.assembly import mcp_provider
from fleetroll.settings import load_settings
from fleetroll.telemetry import Events
from wire_infra import (
    PROXY_SOURCE,
    ForwardProxy,
    LoopbackCA,
    TlsFrontEnd,
    forward_proxy,
    make_ca,
    tls_front_end,
)

pytestmark = pytest.mark.slow

CLIENTS = ("wire", "httpx", "sdk")
#: Bound of one request; a client that hangs past it has the outcome "timeout".
REQUEST_S = 30.0
#: The header block of case 6: bounded so that the test stays quick.
HUGE_HEADERS = 16 * 2**20
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")


# -- the server ---------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    """A request as the server read it."""

    connection: int  # the connection's serial number
    index: int  # its place on that connection (0: the first)
    peer: str  # the address it came from
    method: str
    target: str
    headers: dict[str, str]  # lower-case names
    body: bytes


@dataclass
class Server:
    port: int = 0
    arrivals: list[Arrival] = field(default_factory=list)
    connections: int = 0

    def to(self, path: str) -> list[Arrival]:
        return [a for a in self.arrivals if a.target == path]


Answer = Callable[[SocketStream, Arrival], Awaitable[bool]]


def _head(status: int, headers: list[tuple[str, str]], body: bytes) -> bytes:
    lines = [f"HTTP/1.1 {status} OK", *(f"{k}: {v}" for k, v in headers)]
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _json(arrival: Arrival) -> bytes:
    return json.dumps({"path": arrival.target, "method": arrival.method}).encode()


async def answer_json(stream: SocketStream, arrival: Arrival) -> bool:
    await stream.send(_head(200, [("Content-Type", "application/json")], _json(arrival)))
    return True


async def close_a_reused_post(stream: SocketStream, arrival: Arrival) -> bool:
    """Case 4: a POST on a reused connection is read (and, say, applied), then the
    connection closes without an answer."""
    if arrival.method == "POST" and arrival.index > 0:
        return False
    return await answer_json(stream, arrival)


async def answer_gzip(stream: SocketStream, arrival: Arrival) -> bool:
    """Case 5: gzip unless the request refused it (no Accept-Encoding: any coding will do)."""
    asked = arrival.headers.get("accept-encoding")
    codings = {c.split(";")[0].strip().lower() for c in (asked or "").split(",")}
    if asked is None or "gzip" in codings or "*" in codings:
        body = gzip.compress(_json(arrival))
        headers = [("Content-Type", "application/json"), ("Content-Encoding", "gzip")]
        await stream.send(_head(200, headers, body))
    else:
        await answer_json(stream, arrival)
    return True


async def answer_huge_headers(stream: SocketStream, arrival: Arrival) -> bool:
    """Case 6: a header block of :data:`HUGE_HEADERS` bytes before a small answer."""
    await stream.send(b"HTTP/1.1 200 OK\r\n")
    line = b"X-Padding: " + b"a" * 4084 + b"\r\n"  # 4 KiB a line
    block = line * 64  # 256 KiB a send
    for _ in range(HUGE_HEADERS // len(block)):
        await stream.send(block)
    await stream.send(b"Content-Length: 2\r\n\r\n{}")
    return True


async def answer_huge_header_line(stream: SocketStream, arrival: Arrival) -> bool:
    """Case 6, in one line: a single header of :data:`HUGE_HEADERS` bytes."""
    await stream.send(b"HTTP/1.1 200 OK\r\nX-Padding: ")
    chunk = b"a" * 2**18
    for _ in range(HUGE_HEADERS // len(chunk)):
        await stream.send(chunk)
    await stream.send(b"\r\nContent-Length: 2\r\n\r\n{}")
    return True


ANSWERS: dict[str, Answer] = {
    "json": answer_json,
    "post-close": close_a_reused_post,
    "gzip": answer_gzip,
    "huge-headers": answer_huge_headers,
    "huge-header-line": answer_huge_header_line,
}


async def _read_request(
    stream: SocketStream, buffer: bytearray
) -> tuple[str, str, dict[str, str], bytes] | None:
    while b"\r\n\r\n" not in buffer:
        try:
            buffer += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            return None
    end = buffer.index(b"\r\n\r\n")
    head = bytes(buffer[:end]).decode("latin-1").split("\r\n")
    del buffer[: end + 4]
    method, target, _ = head[0].split(" ", 2)
    headers: dict[str, str] = {}
    for line in head[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(buffer) < length:
        try:
            buffer += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            return None
    body = bytes(buffer[:length])
    del buffer[:length]
    return method, target, headers, body


@asynccontextmanager
async def serving() -> AsyncIterator[Server]:
    """The raw server on a free loopback port; ``/<answer>/...`` picks the answer."""
    server = Server()

    async def serve(stream: SocketStream) -> None:
        server.connections += 1
        connection = server.connections
        peer = stream.extra(SocketAttribute.remote_address)[0]
        buffer = bytearray()
        async with stream:
            for index in range(10_000):
                read = await _read_request(stream, buffer)
                if read is None:
                    return
                method, target, headers, body = read
                arrival = Arrival(connection, index, peer, method, target, headers, body)
                server.arrivals.append(arrival)
                answer = ANSWERS[target.split("/")[1]]
                try:
                    if not await answer(stream, arrival):
                        return
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    return  # the client hung up

    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        server.port = listener.extra(SocketAttribute.local_port)
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, serve)
            yield server
            tg.cancel_scope.cancel()


# -- the clients ----------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What a client made of one request: an answer, or an error of a kind."""

    status: int | None = None
    body: bytes | None = None
    error: str | None = None  # "never sent", "failed", "timeout"


def _error_kind(exc: Exception) -> str:
    """The kind of a failure, the same for every client; anything else is a test error."""
    if isinstance(exc, ConnectFailed | httpx.ConnectError | httpx.ConnectTimeout):
        return "never sent"  # a caller may send it again, a POST too
    if isinstance(exc, WireError | httpx.RequestError):
        return "failed"
    raise exc


Send = Callable[..., Awaitable[Outcome]]


@asynccontextmanager
async def client(kind: str, tls: ssl.SSLContext) -> AsyncIterator[Send]:
    """One client of ``kind``, built as fleetroll builds it, reading the environment now."""
    if kind == "wire":
        async with Wire(verify=tls) as wire:

            async def send_wire(
                method: str,
                url: str,
                body: bytes | None = None,
                headers: dict[str, str] | None = None,
            ) -> Outcome:
                try:
                    with anyio.fail_after(REQUEST_S):
                        got = await wire.request(method, url, body=body, headers=headers)
                except TimeoutError:
                    return Outcome(error="timeout")
                except Exception as exc:
                    return Outcome(error=_error_kind(exc))
                return Outcome(got.status, got.body)

            yield send_wire
        return
    transport = (
        SdkAiohttpTransport(verify=tls, keepalive_s=5.0, max_connections=8)
        if kind == "sdk"
        else None
    )
    async with httpx.AsyncClient(verify=tls, transport=transport, timeout=REQUEST_S) as http:

        async def send_httpx(
            method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None
        ) -> Outcome:
            try:
                with anyio.fail_after(REQUEST_S):
                    got = await http.request(method, url, content=body, headers=headers)
            except TimeoutError:
                return Outcome(error="timeout")
            except Exception as exc:
                return Outcome(error=_error_kind(exc))
            return Outcome(got.status_code, got.content)

        yield send_httpx


def same_for_every_client(got: dict[str, object], expected: object) -> None:
    wrong = {kind: seen for kind, seen in got.items() if seen != expected}
    assert not wrong, f"expected {expected!r} from every client; differing: {wrong!r}"


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> LoopbackCA:
    return make_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
async def server() -> AsyncIterator[Server]:
    async with serving() as running:
        yield running


@pytest.fixture(scope="module")
async def proxy(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ForwardProxy]:
    async with forward_proxy(tmp_path_factory.mktemp("squid")) as running:
        yield running


@pytest.fixture(scope="module")
async def front(
    tmp_path_factory: pytest.TempPathFactory, server: Server, ca: LoopbackCA
) -> AsyncIterator[TlsFrontEnd]:
    folder = tmp_path_factory.mktemp("nginx")
    async with tls_front_end(folder, f"127.0.0.1:{server.port}", ca) as running:
        yield running


@pytest.fixture
def no_proxies(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No proxy variable of the machine's (either case); the test sets its own."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    yield monkeypatch


def _ok(outcome: Outcome, path: str, method: str) -> Outcome | str:
    """``"ok"`` for the JSON answer of ``answer_json`` to ``method path``, else the outcome."""
    body = json.dumps({"path": path, "method": method}).encode()
    return "ok" if outcome == Outcome(200, body) else outcome


def _path(case: str, kind: str) -> str:
    return f"/{case}/{kind}/{uuid.uuid4().hex[:8]}"


# -- case 1: proxies ----------------------------------------------------------------------


async def test_http_goes_through_the_forward_proxy_from_http_proxy(
    server: Server, proxy: ForwardProxy, ca: LoopbackCA, no_proxies: pytest.MonkeyPatch
) -> None:
    no_proxies.setenv("HTTP_PROXY", proxy.url)
    got: dict[str, object] = {}
    paths = {kind: _path("json", kind) for kind in CLIENTS}
    for kind, path in paths.items():
        async with client(kind, ca.client_context()) as send:
            outcome = await send("GET", f"http://127.0.0.1:{server.port}{path}")
        got[kind] = (_ok(outcome, path, "GET"), [a.peer for a in server.to(path)])
    same_for_every_client(got, ("ok", [PROXY_SOURCE]))
    targets = {f"http://127.0.0.1:{server.port}{path}" for path in paths.values()}
    await proxy.log.wait_for(
        lambda _: targets <= {e.target for e in proxy.entries if e.method == "GET"}
    )


async def test_https_goes_through_the_forward_proxy_by_connect_to_the_tls_front_end(
    server: Server,
    proxy: ForwardProxy,
    front: TlsFrontEnd,
    ca: LoopbackCA,
    no_proxies: pytest.MonkeyPatch,
) -> None:
    no_proxies.setenv("HTTPS_PROXY", proxy.url)
    got: dict[str, object] = {}
    for kind in CLIENTS:
        path = _path("json", kind)
        async with client(kind, ca.client_context()) as send:
            outcome = await send("POST", f"{front.url}{path}", body=b'{"x":1}')
        arrivals = server.to(path)
        got[kind] = (
            _ok(outcome, path, "POST"),
            [(a.body, a.headers.get("x-forwarded-for")) for a in arrivals],
        )
        # The front end's log: the request came from the forward proxy's address.
        await front.log.wait_for(lambda _, p=path: any(p in e.request for e in front.entries))
        assert [e.peer for e in front.entries if path in e.request] == [PROXY_SOURCE], kind
    same_for_every_client(got, ("ok", [(b'{"x":1}', PROXY_SOURCE)]))
    # One tunnel per client (logged when it closed), to the front end.
    tunnel = f"127.0.0.1:{front.port}"
    await proxy.log.wait_for(
        lambda _: (
            sum(e.method == "CONNECT" and e.target == tunnel for e in proxy.entries) >= len(CLIENTS)
        )
    )


async def test_no_proxy_sends_a_request_straight_to_its_host(
    server: Server, proxy: ForwardProxy, ca: LoopbackCA, no_proxies: pytest.MonkeyPatch
) -> None:
    no_proxies.setenv("HTTP_PROXY", proxy.url)
    no_proxies.setenv("HTTPS_PROXY", proxy.url)
    no_proxies.setenv("NO_PROXY", "localhost,127.0.0.1")
    got: dict[str, object] = {}
    paths = {kind: _path("json", kind) for kind in CLIENTS}
    for kind, path in paths.items():
        async with client(kind, ca.client_context()) as send:
            outcome = await send("GET", f"http://127.0.0.1:{server.port}{path}")
        got[kind] = (outcome.status, [a.peer for a in server.to(path)])
    same_for_every_client(got, (200, ["127.0.0.1"]))
    # A marker through the proxy, then the log: none of the requests above is in it.
    marker = _path("json", "marker")
    async with httpx.AsyncClient(proxy=proxy.url, trust_env=False) as http:
        with anyio.fail_after(REQUEST_S):
            assert (await http.get(f"http://127.0.0.1:{server.port}{marker}")).status_code == 200
    await proxy.log.wait_for(lambda _: any(e.target.endswith(marker) for e in proxy.entries))
    assert not [e for e in proxy.entries if any(e.target.endswith(p) for p in paths.values())]


async def test_the_sdk_mcp_client_of_a_url_environment_goes_through_the_forward_proxy(
    server: Server, proxy: ForwardProxy, no_proxies: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """MCP servers given by URL (``environment.url``), ``pool.mcp_client = "sdk"``: its
    HTTP client has a transport of its own, with the environment's proxies mounted."""
    no_proxies.setenv("HTTP_PROXY", proxy.url)
    settings = load_settings(pool={"mcp_client": "sdk"}, mcp={"workdir_root": str(tmp_path)})
    path = _path("json", "mcp-sdk")
    async with mcp_provider(settings, Events())._http() as http:
        with anyio.fail_after(REQUEST_S):
            got = await http.get(f"http://127.0.0.1:{server.port}{path}")
    assert got.status_code == 200
    assert [a.peer for a in server.to(path)] == [PROXY_SOURCE]


# -- case 4: no second POST -----------------------------------------------------------------


async def test_a_post_the_server_read_is_not_sent_again_when_it_closes_the_reused_connection(
    server: Server, ca: LoopbackCA, no_proxies: pytest.MonkeyPatch
) -> None:
    got: dict[str, object] = {}
    for kind in CLIENTS:
        warm, apply = _path("post-close", kind), _path("post-close", kind)
        base = f"http://127.0.0.1:{server.port}"
        async with client(kind, ca.client_context()) as send:
            first = await send("GET", base + warm)
            second = await send("POST", base + apply, body=b'{"tool":"delete_everything"}')
        got[kind] = (first.status, second, len(server.to(apply)))
    # The POST arrived once; the client says it failed (it may have been applied),
    # never that it was not sent, and never answers it from a second sending.
    same_for_every_client(got, (200, Outcome(error="failed"), 1))


# -- case 5: a gzip answer --------------------------------------------------------------------


async def test_a_gzip_answer_is_decoded_or_refused_beforehand(
    server: Server, ca: LoopbackCA, no_proxies: pytest.MonkeyPatch
) -> None:
    got: dict[str, object] = {}
    asked: dict[str, str | None] = {}
    for kind in CLIENTS:
        path = _path("gzip", kind)
        async with client(kind, ca.client_context()) as send:
            outcome = await send("POST", f"http://127.0.0.1:{server.port}{path}", body=b"{}")
        got[kind] = _ok(outcome, path, "POST")
        (arrival,) = server.to(path)
        asked[kind] = arrival.headers.get("accept-encoding")
    same_for_every_client(got, "ok")
    assert asked["httpx"] is not None  # the reference asks; the others may ask for identity


# -- case 6: a huge header block -----------------------------------------------------------------


@pytest.mark.parametrize("shape", ["huge-headers", "huge-header-line"])
async def test_a_huge_header_block_fails_the_request_within_its_bound(
    server: Server, ca: LoopbackCA, no_proxies: pytest.MonkeyPatch, shape: str
) -> None:
    """Many 4 KiB header lines, or one line, 16 MiB in all: an error, not an answer."""
    got: dict[str, object] = {}
    for kind in CLIENTS:
        path = _path(shape, kind)
        async with client(kind, ca.client_context()) as send:
            outcome = await send("GET", f"http://127.0.0.1:{server.port}{path}")
        got[kind] = (outcome, len(server.to(path)))
    same_for_every_client(got, (Outcome(error="failed"), 1))


# -- case 7: user info in the URL -----------------------------------------------------


@pytest.mark.parametrize(
    ("userinfo", "credentials"),
    [("user:pw", "user:pw"), ("us%40er:p%3Aw", "us@er:p:w")],
)
async def test_user_info_in_a_url_is_basic_auth_and_never_in_the_host_header(
    server: Server,
    ca: LoopbackCA,
    no_proxies: pytest.MonkeyPatch,
    userinfo: str,
    credentials: str,
) -> None:
    got: dict[str, object] = {}
    for kind in CLIENTS:
        path = _path("json", kind)
        async with client(kind, ca.client_context()) as send:
            outcome = await send("GET", f"http://{userinfo}@127.0.0.1:{server.port}{path}")
        (arrival,) = server.to(path)
        got[kind] = (
            outcome.status,
            arrival.headers.get("host"),
            arrival.headers.get("authorization"),
        )
    basic = "Basic " + base64.b64encode(credentials.encode()).decode()
    same_for_every_client(got, (200, f"127.0.0.1:{server.port}", basic))

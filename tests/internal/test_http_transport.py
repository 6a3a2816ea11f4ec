"""The aiohttp-backed httpx transports keep httpcore's contracts.

A small HTTP/1.1 server on loopback (tests/http_servers.py: raw sockets, so
each test decides how it answers) counts connections and requests.
"""

from __future__ import annotations

import anyio
import httpx
import httpx2
import pytest
from anyio.abc import SocketStream

import fleetroll._internal.retrying as retrying
from fleetroll._internal.http_transport import AiohttpTransport, SdkAiohttpTransport
from fleetroll.tools.session import RetryRefusedConnections
from http_servers import BIG, Server, answer_big, answer_ok, never_answer, serving


def client(**timeouts: float) -> httpx2.AsyncClient:
    transport = AiohttpTransport(verify=False, keepalive_s=15.0, max_connections=8)
    return httpx2.AsyncClient(transport=transport, timeout=httpx2.Timeout(5.0, **timeouts))


async def test_a_keep_alive_connection_carries_every_request_of_a_client() -> None:
    async with serving(answer_ok) as server, client() as http:
        with anyio.fail_after(10):
            for _ in range(3):
                response = await http.post(f"http://127.0.0.1:{server.port}/mcp", json={"a": 1})
                assert response.json() == {"ok": True}
    assert server.connections == 1 and len(server.requests) == 3
    assert b"content-type: application/json" in server.requests[0].lower()


async def test_the_sdk_transport_answers_as_httpx_does() -> None:
    transport = SdkAiohttpTransport(verify=False, keepalive_s=15.0, max_connections=8)
    async with serving(answer_ok) as server, httpx.AsyncClient(transport=transport) as http:
        with anyio.fail_after(10):
            response = await http.get(f"http://127.0.0.1:{server.port}/v1/env/")
    assert response.status_code == 200 and response.json() == {"ok": True}
    assert response.http_version == "HTTP/1.1"


async def test_a_response_left_unread_closes_its_connection_instead_of_reusing_it() -> None:
    async with serving(answer_big) as server, client() as http:
        url = f"http://127.0.0.1:{server.port}/big"
        with anyio.fail_after(10):
            async with http.stream("GET", url) as response:
                assert response.status_code == 200  # the body is never read
            again = await http.get(url)
    assert len(again.content) == BIG
    assert server.connections == 2


async def test_a_refused_connection_is_a_connect_error_and_sent_again() -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()  # nothing listens there now
    retries: list[retrying.Retry] = []
    inner = AiohttpTransport(verify=False, keepalive_s=15.0, max_connections=8)
    transport = RetryRefusedConnections(inner, retrying.Budget(3, 0.0, 0.0), retries.append)
    async with httpx2.AsyncClient(transport=transport) as http:
        with anyio.fail_after(10), pytest.raises(httpx2.ConnectError):
            await http.post(f"http://127.0.0.1:{port}/mcp", json={})
    assert len(retries) == 2


async def test_no_answer_in_time_is_a_read_timeout_and_never_sent_again() -> None:
    retries: list[retrying.Retry] = []
    inner = AiohttpTransport(verify=False, keepalive_s=15.0, max_connections=8)
    transport = RetryRefusedConnections(inner, retrying.Budget(3, 0.0, 0.0), retries.append)
    async with (
        serving(never_answer) as server,
        httpx2.AsyncClient(transport=transport, timeout=httpx2.Timeout(5.0, read=0.2)) as http,
    ):
        with anyio.fail_after(10), pytest.raises(httpx2.ReadTimeout):
            await http.post(f"http://127.0.0.1:{server.port}/mcp", json={"call": 1})
    assert len(server.requests) == 1 and retries == []


async def test_idle_connections_are_kept_only_for_the_keep_alive_setting() -> None:
    transport = AiohttpTransport(verify=False, keepalive_s=2.5, max_connections=8)
    async with serving(answer_ok) as server, httpx2.AsyncClient(transport=transport) as http:
        with anyio.fail_after(10):
            await http.get(f"http://127.0.0.1:{server.port}/")
        session = transport._pool._session
        assert session is not None
        assert session.connector is not None and session.connector._keepalive_timeout == 2.5


async def test_a_proxy_that_refuses_the_tunnel_is_a_proxy_error_and_the_request_never_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def refuse(server: Server, stream: SocketStream, head: bytes) -> bool:
        await stream.send(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
        return False

    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    async with serving(refuse) as proxy:
        monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{proxy.port}")
        transport = SdkAiohttpTransport(verify=False, keepalive_s=15.0, max_connections=8)
        async with httpx.AsyncClient(transport=transport) as http:
            with anyio.fail_after(10), pytest.raises(httpx.ProxyError, match="403"):
                await http.post("https://127.0.0.1:9/v1/env/instances", json={})
    # The proxy was asked for a tunnel, once; nothing was sent through one.
    assert [head.split(b" ")[:2] for head in proxy.requests] == [[b"CONNECT", b"127.0.0.1:9"]]

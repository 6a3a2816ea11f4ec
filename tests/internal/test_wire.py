"""The hot path's HTTP/1.1 client keeps its contracts (see fleetroll._internal.wire).

The raw-socket server of test_http_transport decides how each test is answered.
"""

from __future__ import annotations

import anyio
import pytest
from anyio.abc import SocketStream
from test_http_transport import BIG, Server, answer_big, answer_ok, never_answer, serving

from fleetroll._internal.wire import (
    BadResponse,
    BodyTooLarge,
    ConnectFailed,
    ConnectionLost,
    Wire,
)


async def test_a_keep_alive_connection_carries_every_request_and_the_body_goes_out() -> None:
    async with serving(answer_ok) as server, Wire() as wire:
        with anyio.fail_after(10):
            for _ in range(3):
                response = await wire.request(
                    "POST",
                    f"http://127.0.0.1:{server.port}/mcp?x=1",
                    body=b'{"a":1}',
                    headers={"content-type": "application/json"},
                )
                assert response.status == 200 and response.json() == {"ok": True}
                assert response.headers["content-length"] == "11"
    assert server.connections == 1 and len(server.requests) == 3
    head = server.requests[0].lower()
    assert head.startswith(b"post /mcp?x=1 http/1.1\r\n")
    assert b"host: 127.0.0.1:" in head and b"content-length: 7" in head


async def test_chunked_and_close_delimited_answers_are_read_whole() -> None:
    async def chunked(server: Server, stream: SocketStream, head: bytes) -> bool:
        await stream.send(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"4\r\nabcd\r\n3\r\nefg\r\n0\r\n\r\n"
        )
        return True

    async def until_close(server: Server, stream: SocketStream, head: bytes) -> bool:
        await stream.send(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        return False  # the server closes: that ends the body

    async with Wire() as wire:
        async with serving(chunked) as server:
            with anyio.fail_after(10):
                got = await wire.request("GET", f"http://127.0.0.1:{server.port}/")
        assert got.body == b"abcdefg"
        async with serving(until_close) as server:
            with anyio.fail_after(10):
                first = await wire.request("GET", f"http://127.0.0.1:{server.port}/")
                second = await wire.request("GET", f"http://127.0.0.1:{server.port}/")
        assert first.body == second.body == b"all of it"
        assert server.connections == 2  # a closed connection is never reused


async def test_an_answer_over_its_cap_stops_reading_and_closes_the_connection() -> None:
    async with serving(answer_big) as server, Wire() as wire:
        url = f"http://127.0.0.1:{server.port}/big"
        with anyio.fail_after(10):
            with pytest.raises(BodyTooLarge) as caught:
                await wire.request("GET", url, max_bytes=1000)
            assert caught.value.limit == 1000
            again = await wire.request("GET", url)
    assert len(again.body) == BIG
    assert server.connections == 2


async def test_a_refused_connection_is_connect_failed() -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()  # nothing listens there now
    async with Wire() as wire:
        with anyio.fail_after(10), pytest.raises(ConnectFailed, match="cannot connect"):
            await wire.request("POST", f"http://127.0.0.1:{port}/mcp", body=b"{}")


async def test_a_cancelled_request_closes_its_connection() -> None:
    async with serving(never_answer) as server, Wire() as wire:
        url = f"http://127.0.0.1:{server.port}/slow"
        with anyio.move_on_after(0.3) as scope:
            await wire.request("GET", url)
        assert scope.cancelled_caught
        assert not any(wire._idle.values())  # nothing to reuse: it was closed


async def test_a_connection_broken_mid_answer_is_connection_lost() -> None:
    async def half(server: Server, stream: SocketStream, head: bytes) -> bool:
        await stream.send(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        return False

    async with serving(half) as server, Wire() as wire:
        with anyio.fail_after(10), pytest.raises(ConnectionLost):
            await wire.request("POST", f"http://127.0.0.1:{server.port}/", body=b"{}")


async def test_an_idle_connection_the_server_closed_is_replaced_not_failed() -> None:
    async def once(server: Server, stream: SocketStream, head: bytes) -> bool:
        await answer_ok(server, stream, head)
        return False  # answers (keep-alive by its headers), then closes while idle

    async with serving(once) as server, Wire() as wire:
        url = f"http://127.0.0.1:{server.port}/"
        with anyio.fail_after(10):
            await wire.request("POST", url, body=b"{}")
            await anyio.sleep(0.1)  # the close reaches the client
            again = await wire.request("POST", url, body=b"{}")
    assert again.json() == {"ok": True}
    assert server.connections == 2


async def test_bytes_that_are_not_http_are_a_bad_response() -> None:
    async def garbage(server: Server, stream: SocketStream, head: bytes) -> bool:
        await stream.send(b"SMTP ready\r\n\r\n")
        return True

    async with serving(garbage) as server, Wire() as wire:
        with anyio.fail_after(10), pytest.raises(BadResponse):
            await wire.request("GET", f"http://127.0.0.1:{server.port}/")


async def test_a_header_value_with_a_line_break_is_refused_before_sending() -> None:
    async with Wire() as wire:
        with pytest.raises(ValueError, match="line break"):
            await wire.request("GET", "http://127.0.0.1:9/", headers={"x": "a\r\nb: c"})
        with pytest.raises(ValueError, match="not an http"):
            await wire.request("GET", "ftp://127.0.0.1/")


# -- streaming (Wire.stream) -----------------------------------------------------------


async def test_a_stream_hands_over_head_and_body_as_they_arrive_and_reuses_its_connection() -> None:
    first_read = anyio.Event()

    async def in_two_parts(server: Server, stream: SocketStream, head: bytes) -> bool:
        await stream.send(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n6\r\nevent1\r\n"
        )
        await first_read.wait()  # the rest only once the client saw the first part
        await stream.send(b"6\r\nevent2\r\n0\r\n\r\n")
        return True

    async with serving(in_two_parts) as server, Wire() as wire:
        url = f"http://127.0.0.1:{server.port}/mcp"
        with anyio.fail_after(10):
            async with wire.stream("POST", url, body=b"{}") as response:
                assert response.status == 200
                assert response.headers["content-type"] == "text/event-stream"
                chunks = []
                async for chunk in response.aiter_bytes():
                    chunks.append(chunk)
                    first_read.set()
            assert chunks == [b"event1", b"event2"]
            async with wire.stream("GET", url) as again:
                assert await again.aread() == b"event1event2"
    assert server.connections == 1  # read to its end: the connection was reused


async def test_a_stream_left_early_or_cancelled_closes_its_connection() -> None:
    async def endless(server: Server, stream: SocketStream, head: bytes) -> bool:
        await stream.send(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        while True:
            await stream.send(b"5\r\nping\n\r\n")
            await anyio.sleep(0.01)

    async with serving(endless) as server, Wire() as wire:
        url = f"http://127.0.0.1:{server.port}/mcp"
        with anyio.fail_after(10):
            async with wire.stream("GET", url) as response:
                async for chunk in response.aiter_bytes():
                    assert chunk.startswith(b"ping")
                    break  # the caller leaves with the answer still coming
            assert not any(wire._idle.values())
            with anyio.CancelScope() as scope:
                async with wire.stream("GET", url) as response:
                    async for _ in response.aiter_bytes():
                        scope.cancel()  # cancelled while reading
            assert not any(wire._idle.values())
    assert server.connections == 2


async def test_a_stream_over_its_cap_fails_while_reading_and_closes_the_connection() -> None:
    async with serving(answer_big) as server, Wire() as wire:
        url = f"http://127.0.0.1:{server.port}/big"
        with anyio.fail_after(10):
            async with wire.stream("GET", url, max_bytes=1000) as response:
                assert response.status == 200
                with pytest.raises(BodyTooLarge) as caught:
                    await response.aread()
            assert caught.value.limit == 1000
            async with wire.stream("GET", url) as response:
                assert len(await response.aread()) == BIG
    assert server.connections == 2

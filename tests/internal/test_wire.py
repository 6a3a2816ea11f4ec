"""The hot path's HTTP/1.1 client keeps its contracts (see fleetroll._internal.wire).

The raw-socket servers of tests/http_servers.py decide how each test is answered.
"""

from __future__ import annotations

import base64
import gzip
import os
import zlib
from collections.abc import Callable

import anyio
import httpx
import httpx._utils as httpx_utils
import pytest
import trustme
from anyio.abc import SocketStream

from fleetroll._internal.wire import (
    BadResponse,
    BodyTooLarge,
    ConnectFailed,
    ConnectionLost,
    ProxyError,
    Wire,
)
from http_servers import (
    BIG,
    Handler,
    Server,
    answer_big,
    answer_ok,
    never_answer,
    proxying,
    serving,
    serving_tls,
    trusting,
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
            with pytest.raises(RuntimeError, match="after its `async with` ended"):
                await response.aread()  # its connection is another answer's now
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


async def test_a_stream_left_unread_after_its_answer_arrived_leaves_a_working_connection() -> None:
    """The answer's last bytes arrive in the read that fills the stream's buffer
    (reading pauses there), and the caller leaves without reading the body: the
    connection goes back to the pool and the next request on it is answered
    (it hung until its deadline while reading stayed paused)."""
    body = b"x" * (300 * 1024)  # over the stream's 256 KiB buffer, within two reads

    async def whole_at_once(server: Server, stream: SocketStream, head: bytes) -> bool:
        await stream.send(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        return True

    async with serving(whole_at_once) as server, Wire() as wire:
        url = f"http://127.0.0.1:{server.port}/big"
        with anyio.fail_after(10):
            for _ in range(5):
                async with wire.stream("GET", url) as response:
                    assert response.status == 200
                    await anyio.sleep(0.05)  # the whole body arrives, unread
            answer = await wire.request("GET", url)
        assert answer.body == body


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


# -- what is sent again (issue 37, case 4) ---------------------------------------------


def closing_on_the_second_request() -> Handler:
    """Answers every request but the second, which it reads and then closes on."""

    async def handler(server: Server, stream: SocketStream, head: bytes) -> bool:
        if len(server.requests) == 2:
            return False  # read (the server may have applied it), then closed
        return await answer_ok(server, stream, head)

    return handler


async def test_a_post_the_server_closed_on_after_reading_it_is_not_sent_again() -> None:
    async with serving(closing_on_the_second_request()) as server, Wire() as wire:
        url = f"http://127.0.0.1:{server.port}/mcp"
        with anyio.fail_after(10):
            await wire.request("POST", url, body=b"{}")
            with pytest.raises(ConnectionLost):
                await wire.request("POST", url, body=b'{"tool":"once"}')
    assert len(server.requests) == 2  # the tool ran once


@pytest.mark.parametrize(
    ("method", "idempotent"),
    [("GET", False), ("PUT", False), ("DELETE", False), ("POST", True)],
)
async def test_an_idempotent_request_or_one_its_caller_marks_idempotent_is_sent_again(
    method: str, idempotent: bool
) -> None:
    async with serving(closing_on_the_second_request()) as server, Wire() as wire:
        url = f"http://127.0.0.1:{server.port}/v1/env"
        with anyio.fail_after(10):
            await wire.request(method, url, idempotent=idempotent)
            again = await wire.request(method, url, idempotent=idempotent)
    assert again.json() == {"ok": True}
    assert len(server.requests) == 3 and server.connections == 2


async def test_a_post_with_a_request_id_header_alone_is_not_sent_again() -> None:
    # The SDK puts a tracing X-Request-ID on every control-plane request: only
    # the caller knows which one is an idempotency key (the create's).
    async with serving(closing_on_the_second_request()) as server, Wire() as wire:
        url = f"http://127.0.0.1:{server.port}/v1/env/instances/i-1/reset"
        with anyio.fail_after(10):
            await wire.request("POST", url, body=b"{}", headers={"X-Request-ID": "r-1"})
            with pytest.raises(ConnectionLost):
                await wire.request("POST", url, body=b"{}", headers={"X-Request-ID": "r-2"})
    assert len(server.requests) == 2  # the reset ran once


async def test_an_idle_connection_the_server_closed_unseen_is_dropped_before_a_post() -> None:
    closed = anyio.Event()

    async def once(server: Server, stream: SocketStream, head: bytes) -> bool:
        await answer_ok(server, stream, head)
        await stream.aclose()
        closed.set()
        return False

    async with serving(once) as server, Wire() as wire:
        url = f"http://127.0.0.1:{server.port}/mcp"
        with anyio.fail_after(10):
            await wire.request("POST", url, body=b"{}")
            (idle,) = wire._idle.values()
            # The loop has not read the close yet (as when it arrives between two
            # requests of one task): only the socket knows.
            idle[0].transport.pause_reading()  # type: ignore[union-attr]
            await closed.wait()
            again = await wire.request("POST", url, body=b"{}")
    assert again.json() == {"ok": True}
    assert server.connections == 2 and len(server.requests) == 2


# -- encodings (issue 37, case 5) ------------------------------------------------------


def encoded(body: bytes, encoding: str, *, chunked: bool = False) -> Handler:
    async def handler(server: Server, stream: SocketStream, head: bytes) -> bool:
        if chunked:
            framed = b"".join(
                b"%x\r\n%s\r\n" % (len(body[i : i + 7]), body[i : i + 7])
                for i in range(0, len(body), 7)
            )
            await stream.send(
                b"HTTP/1.1 200 OK\r\nContent-Encoding: %s\r\nTransfer-Encoding: chunked\r\n\r\n"
                % encoding.encode()
                + framed
                + b"0\r\n\r\n"
            )
        else:
            await stream.send(
                b"HTTP/1.1 200 OK\r\nContent-Encoding: %s\r\nContent-Length: %d\r\n\r\n"
                % (encoding.encode(), len(body))
                + body
            )
        return True

    return handler


async def test_every_request_asks_for_identity_unless_the_caller_chose_an_encoding() -> None:
    async with serving(answer_ok) as server, Wire() as wire:
        url = f"http://127.0.0.1:{server.port}/"
        with anyio.fail_after(10):
            await wire.request("POST", url, body=b"{}")
            await wire.request("GET", url, headers={"Accept-Encoding": "gzip"})
    first, second = (head.lower() for head in server.requests)
    assert b"accept-encoding: identity" in first
    assert second.count(b"accept-encoding") == 1 and b"accept-encoding: gzip" in second


@pytest.mark.parametrize("chunked", [False, True], ids=["length", "chunked"])
@pytest.mark.parametrize(
    ("encoding", "compress"),
    [
        ("gzip", gzip.compress),
        ("deflate", zlib.compress),
        ("deflate", lambda data: zlib.compress(data)[2:-4]),  # raw, as some servers send it
        ("gzip, deflate", lambda data: zlib.compress(gzip.compress(data))),
    ],
    ids=["gzip", "deflate", "raw-deflate", "gzip-then-deflate"],
)
async def test_a_gzip_or_deflate_answer_is_decoded(
    encoding: str, compress: Callable[[bytes], bytes], chunked: bool
) -> None:
    answer = b'{"jsonrpc":"2.0","id":1,"result":{"content":[]}}' * 50
    handler = encoded(compress(answer), encoding, chunked=chunked)
    async with serving(handler) as server, Wire() as wire:
        url = f"http://127.0.0.1:{server.port}/mcp"
        with anyio.fail_after(10):
            response = await wire.request("POST", url, body=b"{}")
            async with wire.stream("POST", url, body=b"{}") as streamed:
                pieces = [piece async for piece in streamed.aiter_bytes()]
    assert response.body == answer and b"".join(pieces) == answer
    assert server.connections == 1


async def test_a_zip_bomb_is_body_too_large_at_its_decoded_size() -> None:
    bomb = gzip.compress(b"\0" * 50_000_000)  # 50 MB in about 50 KB
    async with serving(encoded(bomb, "gzip")) as server, Wire() as wire:
        url = f"http://127.0.0.1:{server.port}/"
        with anyio.fail_after(10):
            with pytest.raises(BodyTooLarge, match="decoded") as caught:
                await wire.request("GET", url, max_bytes=1_000_000)
            assert caught.value.limit == 1_000_000
            async with wire.stream("GET", url, max_bytes=1_000_000) as response:
                with pytest.raises(BodyTooLarge):
                    await response.aread()


@pytest.mark.parametrize(
    ("encoding", "named"), [("br", "br"), ("zstd", "zstd"), ("gzip, br", "br")]
)
async def test_an_encoding_the_client_cannot_decode_is_a_bad_response_naming_it(
    encoding: str, named: str
) -> None:
    async with serving(encoded(b"\x1b\x03\x00\xf8", encoding)) as server, Wire() as wire:
        url = f"http://127.0.0.1:{server.port}/"
        with anyio.fail_after(10):
            with pytest.raises(BadResponse, match=f"encoding '{named}'"):
                await wire.request("GET", url)
            with pytest.raises(BadResponse, match="cannot decode"):
                async with wire.stream("GET", url):
                    pass


async def test_a_corrupt_gzip_answer_is_a_bad_response() -> None:
    async with serving(encoded(b"not gzip at all", "gzip")) as server, Wire() as wire:
        with anyio.fail_after(10), pytest.raises(BadResponse, match="gzip"):
            await wire.request("GET", f"http://127.0.0.1:{server.port}/")


# -- the header cap (issue 37, case 6) -------------------------------------------------


async def test_an_endless_header_block_fails_at_the_cap_before_reading_more() -> None:
    sent = 0

    async def endless_headers(server: Server, stream: SocketStream, head: bytes) -> bool:
        nonlocal sent
        await stream.send(b"HTTP/1.1 200 OK\r\n")
        line = b"X-Filler: " + b"a" * 1000 + b"\r\n"
        while True:  # until the client hangs up
            await stream.send(line * 64)
            sent += len(line) * 64

    async with serving(endless_headers) as server, Wire() as wire:
        with anyio.fail_after(10), pytest.raises(BadResponse, match="header block is over"):
            await wire.request("GET", f"http://127.0.0.1:{server.port}/")
    assert sent < 100 * 2**20  # stopped long before 128 MiB (the socket buffers hold a few MiB)


async def test_a_large_header_block_under_the_cap_is_read() -> None:
    async def big_headers(server: Server, stream: SocketStream, head: bytes) -> bool:
        lines = b"".join(b"X-Filler-%d: %s\r\n" % (i, b"a" * 1000) for i in range(90))
        await stream.send(b"HTTP/1.1 200 OK\r\n" + lines + b"Content-Length: 2\r\n\r\nok")
        return True

    async with serving(big_headers) as server, Wire() as wire:
        with anyio.fail_after(10):
            response = await wire.request("GET", f"http://127.0.0.1:{server.port}/")
    assert response.body == b"ok" and len(response.headers) == 91


# -- user info (issue 37, case 7) ------------------------------------------------------


async def test_user_info_in_a_url_is_basic_auth_and_never_in_the_host_header() -> None:
    async with serving(answer_ok) as server, Wire() as wire:
        url = f"http://us%40er:p%3Aw%20d@127.0.0.1:{server.port}/mcp"
        with anyio.fail_after(10):
            await wire.request("GET", url, headers={"Authorization": "Bearer caller"})
    head = server.requests[0].decode("latin-1")
    token = base64.b64encode(b"us@er:p:w d").decode()
    assert f"authorization: Basic {token}" in head  # percent-decoded, and it wins (httpx's)
    assert f"host: 127.0.0.1:{server.port}\r\n" in head
    assert "Bearer" not in head and "us%40er" not in head and "@" not in head.split("\r\n")[1]


async def test_user_info_never_reaches_an_error_message() -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()
    async with Wire() as wire:
        with anyio.fail_after(10), pytest.raises(ConnectFailed) as caught:
            await wire.request("GET", f"http://user:hunter2@127.0.0.1:{port}/")
        with pytest.raises(ValueError) as refused:
            await wire.request("GET", "ftp://user:hunter2@127.0.0.1/")
    assert "hunter2" not in str(caught.value) and "user" not in str(caught.value)
    assert "hunter2" not in str(refused.value)


# -- proxies (issue 37, case 1) --------------------------------------------------------


@pytest.fixture
def proxy_env(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Sets the proxy variables given (none other, in either case) for the test."""
    for name in list(os.environ):
        if name.lower().endswith("_proxy") or name == "REQUEST_METHOD":
            monkeypatch.delenv(name)

    def set_env(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    return set_env


async def test_an_http_url_goes_to_the_environment_s_proxy_in_absolute_form(
    proxy_env: Callable[..., None],
) -> None:
    async with serving(answer_ok) as server, proxying() as proxy:
        proxy_env(HTTP_PROXY=proxy.url)
        async with Wire() as wire:
            with anyio.fail_after(10):
                for _ in range(2):
                    got = await wire.request("POST", f"http://127.0.0.1:{server.port}/mcp?a=1")
                    assert got.json() == {"ok": True}
    (head,) = proxy.heads  # one connection to the proxy carried both
    assert head.startswith(f"POST http://127.0.0.1:{server.port}/mcp?a=1 HTTP/1.1\r\n")
    assert f"host: 127.0.0.1:{server.port}" in head
    assert len(server.requests) == 2


async def test_an_https_url_goes_through_a_connect_tunnel_with_tls_to_the_target(
    proxy_env: Callable[..., None],
) -> None:
    ca = trustme.CA()
    async with serving_tls(answer_ok, ca) as server, proxying(credentials=("u", "p@ss")) as proxy:
        proxy_env(https_proxy=f"http://u:p%40ss@127.0.0.1:{proxy.port}", HTTP_PROXY="http://x:1")
        async with Wire(verify=trusting(ca)) as wire:
            url = f"https://127.0.0.1:{server.port}/v1/env"
            with anyio.fail_after(10):
                for _ in range(2):
                    assert (await wire.request("GET", url)).json() == {"ok": True}
                async with wire.stream("GET", url) as response:
                    assert await response.aread() == b'{"ok":true}'
    (connect,) = proxy.heads  # one tunnel, reused
    assert connect.startswith(f"CONNECT 127.0.0.1:{server.port} HTTP/1.1\r\n")
    token = base64.b64encode(b"u:p@ss").decode()
    assert f"proxy-authorization: Basic {token}" in connect
    assert server.connections == 1 and len(server.requests) == 3
    assert b"proxy-authorization" not in server.requests[0].lower()  # the proxy's only


async def test_a_proxy_refusing_the_tunnel_is_an_error_naming_it_without_credentials(
    proxy_env: Callable[..., None],
) -> None:
    async with proxying(credentials=("u", "right")) as proxy:
        proxy_env(HTTPS_PROXY=f"http://u:wrong-secret@127.0.0.1:{proxy.port}")
        async with Wire() as wire:
            with anyio.fail_after(10), pytest.raises(ProxyError) as caught:
                await wire.request("GET", "https://127.0.0.1:9/")
    message = str(caught.value)
    assert f"the proxy http://127.0.0.1:{proxy.port} refused" in message and "407" in message
    assert "wrong-secret" not in message and caught.value.status == 407
    assert not caught.value.transient


async def test_no_proxy_hosts_trust_env_false_and_an_explicit_proxy_are_honoured(
    proxy_env: Callable[..., None],
) -> None:
    async with serving(answer_ok) as server, proxying() as proxy:
        url = f"http://127.0.0.1:{server.port}/"
        proxy_env(ALL_PROXY=proxy.url, no_proxy="example.com, 127.0.0.1")
        async with Wire() as wire:
            with anyio.fail_after(10):
                await wire.request("GET", url)  # NO_PROXY: direct
        proxy_env(no_proxy="")
        async with Wire(trust_env=False) as wire:
            with anyio.fail_after(10):
                await wire.request("GET", url)  # the environment ignored: direct
        assert proxy.heads == []
        proxy_env(ALL_PROXY="http://127.0.0.1:9")  # nothing there: the argument wins
        async with Wire(proxy=proxy.url) as wire:
            with anyio.fail_after(10):
                await wire.request("GET", url)
        assert len(proxy.heads) == 1


async def test_a_proxy_that_cannot_be_reached_is_connect_failed_naming_it(
    proxy_env: Callable[..., None],
) -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()
    async with Wire(proxy=f"http://u:hunter2@127.0.0.1:{port}") as wire:
        for url in ("http://127.0.0.1:9/", "https://127.0.0.1:9/"):
            with anyio.fail_after(10), pytest.raises(ConnectFailed) as caught:
                await wire.request("POST", url, body=b"{}")
            assert f"proxy http://127.0.0.1:{port}" in str(caught.value)
            assert "hunter2" not in str(caught.value)
    with pytest.raises(ValueError, match="SOCKS"):
        Wire(proxy="socks5://127.0.0.1:1080")


NO_PROXY_CASES = [
    "",
    "*",
    "example.com",
    ".example.com",
    "www.example.com",
    "example.com:8080",
    "127.0.0.1",
    "10.0.0.0/8",
    "::1",
    "localhost",
    "http://example.com",
    "https://example.com:8443",
    "example.com, 127.0.0.1 ,,other.org",
]
URLS = [
    "http://example.com/",
    "https://example.com/",
    "http://www.example.com:8080/",
    "http://example.com:8080/",
    "https://example.com:8443/",
    "http://wwwexample.com/",
    "http://127.0.0.1:5000/",
    "http://10.0.0.1/",
    "http://10.0.0.0/",
    "http://[::1]:80/",
    "http://localhost/",
    "https://sub.other.org/",
]


@pytest.mark.parametrize("no_proxy", NO_PROXY_CASES)
def test_proxies_from_the_environment_are_chosen_by_httpx_s_rules(
    no_proxy: str, proxy_env: Callable[..., None]
) -> None:
    proxy_env(
        HTTP_PROXY="http://plain:3128",
        https_proxy="secure:3129",
        ALL_PROXY="http://every:3130",
        NO_PROXY=no_proxy,
    )
    wire = Wire()
    patterns = sorted(
        (httpx_utils.URLPattern(key), value)
        for key, value in httpx_utils.get_environment_proxies().items()
    )
    for url in URLS:
        expected = next(
            (value for pattern, value in patterns if pattern.matches(httpx.URL(url))), None
        )
        route = wire._split(url).route
        got = None if route.proxy is None else route.proxy.url.rsplit(":", 1)[0]
        want = None if expected is None else str(httpx.URL(expected).copy_with(port=None))
        assert got == (want.rstrip("/") if want else None), (no_proxy, url)


async def test_the_answer_to_a_head_ends_at_its_head_whatever_its_length_says() -> None:
    async def head_answer(server: Server, stream: SocketStream, head: bytes) -> bool:
        if head.startswith(b"HEAD"):
            await stream.send(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
            return True
        return await answer_ok(server, stream, head)

    async with serving(head_answer) as server, Wire() as wire:
        url = f"http://127.0.0.1:{server.port}/"
        with anyio.fail_after(10):
            response = await wire.request("HEAD", url)
            async with wire.stream("HEAD", url) as streamed:
                assert await streamed.aread() == b""
            after = await wire.request("GET", url)
    assert response.status == 200 and response.body == b""
    assert response.headers["content-length"] == "1000"
    assert after.json() == {"ok": True}


async def test_interim_answers_are_skipped_for_the_final_one() -> None:
    async def hints_first(server: Server, stream: SocketStream, head: bytes) -> bool:
        await stream.send(
            b"HTTP/1.1 100 Continue\r\n\r\n"
            b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
        )
        return await answer_ok(server, stream, head)

    async with serving(hints_first) as server, Wire() as wire:
        url = f"http://127.0.0.1:{server.port}/mcp"
        with anyio.fail_after(10):
            response = await wire.request("POST", url, body=b"{}")
            async with wire.stream("POST", url, body=b"{}") as streamed:
                assert streamed.status == 200 and await streamed.aread() == b'{"ok":true}'
    assert response.status == 200 and response.json() == {"ok": True}
    assert "link" not in response.headers
    assert server.connections == 1

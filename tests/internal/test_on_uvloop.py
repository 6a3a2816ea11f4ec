"""fleetroll on uvloop's event loop: the loop of Ray's async actors (Ray picks it
whenever it is installed) and of many trainers. The whole suite can run on it
(``FLEETROLL_TEST_UVLOOP=1 pytest``); these hold the two differences found so far."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import pytest
import trustme

from fleetroll._internal.wire import Wire
from fleetroll.environments.mcp.process import open_program
from http_servers import answer_ok, proxying, serving, serving_tls, trusting

uvloop = pytest.importorskip("uvloop")


def on_uvloop(fn: Callable[[], Awaitable[None]]) -> None:
    anyio.run(fn, backend_options={"use_uvloop": True})


def test_the_wire_s_requests_are_answered_on_uvloop() -> None:
    # uvloop's transports are not asyncio.Transport subclasses: an isinstance
    # check in connection_made left every request of a Ray actor hanging.
    async def main() -> None:
        async with serving(answer_ok) as server, Wire() as wire:
            with anyio.fail_after(10):
                for _ in range(2):
                    response = await wire.request("GET", f"http://127.0.0.1:{server.port}/")
                    assert response.status == 200 and response.json() == {"ok": True}
        assert server.connections == 1

    on_uvloop(main)


def test_a_program_that_is_not_there_is_named_in_its_error_on_uvloop() -> None:
    async def main() -> None:
        with pytest.raises(FileNotFoundError) as err:
            await open_program(["no-such-mcp-server-binary"])
        assert err.value.filename == "no-such-mcp-server-binary"
        assert "no-such-mcp-server-binary" in str(err.value)

    on_uvloop(main)


def test_the_wire_s_tunnel_through_a_proxy_opens_tls_on_uvloop() -> None:
    # The tunnel upgrades a proxy's connection to TLS in place (loop.start_tls).
    ca = trustme.CA()

    async def main() -> None:
        async with serving_tls(answer_ok, ca) as server, proxying() as proxy:
            wire = Wire(proxy=proxy.url, verify=trusting(ca))
            url = f"https://127.0.0.1:{server.port}/"
            async with wire:
                for _ in range(2):
                    with anyio.fail_after(10):
                        assert (await wire.request("GET", url)).json() == {"ok": True}
        assert len(proxy.heads) == 1 and proxy.heads[0].startswith("CONNECT ")

    on_uvloop(main)

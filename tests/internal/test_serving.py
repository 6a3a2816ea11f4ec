"""Our servers on a port they cannot have: one line naming the address, never a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from fleetroll._internal.serving import serve_asgi


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


async def nothing(scope: object, receive: object, send: object) -> None:
    raise AssertionError("never served")


async def test_serving_on_a_busy_port_raises_an_os_error_saying_so(busy_port: int) -> None:
    with pytest.raises(OSError, match="the port is in use"):
        async with serve_asgi(nothing, host="127.0.0.1", port=busy_port):
            pass


async def test_a_port_taken_after_the_check_is_an_os_error_not_uvicorns_exit(
    busy_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fleetroll._internal.serving

    # As if another process took the port between our check and uvicorn's bind.
    monkeypatch.setattr(fleetroll._internal.serving, "_check_free", lambda host, port: None)
    with pytest.raises(OSError, match="could not start"):
        async with serve_asgi(nothing, host="127.0.0.1", port=busy_port):
            pass


@pytest.mark.slow
@pytest.mark.parametrize("command", ["emulator", "serve", "dashboard"])
def test_each_server_command_on_a_busy_port_says_so_in_one_line(
    command: str, busy_port: int, tmp_path: Path
) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLEET_", "FLEETROLL_", "LOGFIRE_"))
    }
    env["FLEETROLL_TELEMETRY__DB_PATH"] = os.devnull
    env["FLEETROLL_SERVICE__TOKEN_FILE"] = str(tmp_path / "service-token")  # serve makes one
    done = subprocess.run(
        [sys.executable, "-m", "fleetroll", command, "--port", str(busy_port)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert f"127.0.0.1:{busy_port}" in done.stderr and "in use" in done.stderr


async def test_a_caller_cancelled_while_serving_still_shuts_the_server_down() -> None:
    # Cancelled with its caller (a trainer's time-out around `run_job`), the
    # server skipped uvicorn's shutdown: its lifespan task was cancelled (a
    # traceback in the log) and its listening socket stayed open until the
    # collector found it (an unclosed-socket warning that failed another test).
    shutdowns = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "lifespan"
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                shutdowns.append(True)
                await send({"type": "lifespan.shutdown.complete"})
                return

    with anyio.fail_after(15), anyio.CancelScope() as caller:
        async with serve_asgi(app) as url:
            port = int(url.rsplit(":", 1)[1])
            caller.cancel()
            await anyio.sleep(5)  # cancelled here
    assert shutdowns == [True]
    with pytest.raises(OSError):  # nobody listens there any more
        await anyio.connect_tcp("127.0.0.1", port)

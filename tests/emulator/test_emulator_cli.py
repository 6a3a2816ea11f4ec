"""`fleetroll emulator` as a user runs it: a real process, its printed lines, its key."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import httpx
import pytest
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

pytestmark = pytest.mark.slow  # each test starts fleetroll in a new process (~5 s here)


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLEET_", "FLEETROLL_", "LOGFIRE_", "OPENAI_"))
    }
    env["FLEETROLL_TELEMETRY__DB_PATH"] = os.devnull
    return {**env, **extra}


def fleetroll(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetroll", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(**env),
        stdin=subprocess.DEVNULL,
    )


@dataclass
class Running:
    process: Process
    lines: list[str] = field(default_factory=list)

    @property
    def exports(self) -> dict[str, str]:
        found = {}
        for line in self.lines:
            words = line.split()
            if words[:1] == ["export"]:
                name, _, value = words[1].partition("=")
                found[name] = value
        return found


@asynccontextmanager
async def emulator_process(*args: str, **env: str) -> AsyncIterator[Running]:
    """`fleetroll emulator ARGS` until its ledger line; SIGINT and its last lines on exit."""
    process = await anyio.open_process(
        [sys.executable, "-m", "fleetroll", "emulator", "--port", "0", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=clean_env(**env),
    )
    assert process.stdout is not None
    output = BufferedByteReceiveStream(process.stdout)
    running = Running(process)
    try:
        with anyio.fail_after(60):
            while not running.lines or "ledger:" not in running.lines[-1]:
                running.lines.append((await output.receive_until(b"\n", 65536)).decode())
        yield running
    finally:
        with anyio.CancelScope(shield=True), anyio.fail_after(30):
            process.send_signal(signal.SIGINT)
            rest = b""
            try:
                while True:
                    rest += await output.receive(65536)
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                pass
            running.lines += rest.decode().splitlines()
            await process.wait()
            await process.aclose()


async def test_the_emulator_prints_what_to_export_and_accepts_only_that_key() -> None:
    async with emulator_process() as emu, httpx.AsyncClient(timeout=30) as http:
        exports = emu.exports
        url, key = exports["FLEET_BASE_URL"], exports["FLEET_API_KEY"]
        assert len(key) >= 32
        with anyio.fail_after(30):
            good = await http.get(f"{url}/v1/env/", headers={"Authorization": f"Bearer {key}"})
            bad = await http.get(f"{url}/v1/env/", headers={"Authorization": "Bearer guess"})
            none = await http.get(f"{url}/v1/env/")
        assert good.status_code == 200
        assert bad.status_code == none.status_code == 401
        assert "detail" in none.json()
    # The key is printed once, on its export line, and nowhere else.
    output = "\n".join(emu.lines)
    assert output.count(key) == 1
    assert "emulator stopped" in output


async def test_the_emulator_takes_its_key_from_the_environment_when_given() -> None:
    key = "a-key-chosen-by-the-user-0123456789"
    async with emulator_process(FLEETROLL_EMULATOR_API_KEY=key) as emu:
        assert emu.exports["FLEET_API_KEY"] == key


def test_a_host_beyond_loopback_is_refused_in_one_line_without_allow_remote() -> None:
    done = fleetroll("emulator", "--host", "0.0.0.0")
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert "0.0.0.0" in done.stderr and "--allow-remote" in done.stderr


async def test_allow_remote_serves_beyond_loopback_with_a_warning() -> None:
    async with emulator_process("--host", "0.0.0.0", "--allow-remote") as emu:
        assert "0.0.0.0" in emu.exports["FLEET_BASE_URL"]
        assert any(line.startswith("warning:") for line in emu.lines)


def test_a_port_out_of_range_is_refused_without_a_traceback() -> None:
    done = fleetroll("emulator", "--port", "99999")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "99999 is not in the range 0<=x<=65535" in done.stderr


async def test_public_url_is_what_it_hands_out_and_tells_to_export() -> None:
    """Behind a reverse proxy: instances' URLs (MCP, manager) are on the proxy's base."""
    public = "https://fleet.test:8443"
    async with emulator_process("--public-url", f"{public}/") as emu:
        assert emu.exports["FLEET_BASE_URL"] == public
        listening = next(line for line in emu.lines if "listening on" in line)
        own = listening.split("listening on ")[1].split()[0]
        key = emu.exports["FLEET_API_KEY"]
        async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
            with anyio.fail_after(30):
                made = await http.post(
                    f"{own}/v1/env/instances",
                    json={"env_key": "ledger", "version": "v1"},
                    headers={"Authorization": f"Bearer {key}"},
                )
                assert made.status_code == 200, made.text
                urls = made.json()["urls"]
                gone = await http.delete(
                    f"{own}/v1/env/instances/{made.json()['instance_id']}",
                    headers={"Authorization": f"Bearer {key}"},
                )
                assert gone.status_code == 200
        assert urls["root"].startswith(f"{public}/instances/")
        assert all(url.startswith(public) for url in urls["app"])

"""The emulator in its own process, for load tests and benchmarks.

In-process, the emulator shares the event loop (and the core) with the
orchestrator it serves; in its own process, it uses the other core and its
CPU is not charged to fleetroll.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from types import TracebackType
from typing import Any, Self

import anyio
import httpx
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from fleetroll.emulator.faults import FaultProfile
from fleetroll.errors import EmulatorError

__all__ = ["EmulatorProcess"]

_LISTENING = re.compile(rb"listening on (http://\S+)")


class EmulatorProcess:
    """``fleetroll emulator`` as a child process, stopped on exit.

    Args:
        profile: the faults to inject (default: none).
        startup_timeout_s: how long to wait for the emulator to listen.
    """

    def __init__(
        self, profile: FaultProfile | None = None, *, startup_timeout_s: float = 60.0
    ) -> None:
        self.profile = profile or FaultProfile()
        self._startup_timeout_s = startup_timeout_s
        self._process: Process | None = None
        self.base_url = ""
        self.api_key = secrets.token_urlsafe(32)
        self.pid: int | None = None

    async def __aenter__(self) -> Self:
        self._process = await anyio.open_process(
            [
                sys.executable,
                "-m",
                "fleetroll",
                "emulator",
                "--port",
                "0",
                "--profile-json",
                self.profile.model_dump_json(),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            # The key goes through the environment, never the command line (ps shows that).
            env={**os.environ, "FLEETROLL_EMULATOR_API_KEY": self.api_key},
        )
        self.pid = self._process.pid
        assert self._process.stdout is not None
        output = BufferedByteReceiveStream(self._process.stdout)
        seen = b""
        try:
            with anyio.fail_after(self._startup_timeout_s):
                while True:
                    line = await output.receive_until(b"\n", 65536)
                    seen += line + b"\n"
                    match = _LISTENING.search(line)
                    if match:
                        self.base_url = match.group(1).decode()
                        break
        except (TimeoutError, anyio.EndOfStream, anyio.IncompleteRead) as exc:
            await self._stop()
            raise EmulatorError(
                f"the emulator process did not start: {seen.decode(errors='replace')[-2000:]}"
            ) from exc
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stop()

    async def _stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        with anyio.CancelScope(shield=True):
            process.terminate()
            with anyio.move_on_after(10) as scope:
                await process.wait()
            if scope.cancelled_caught:
                process.kill()
                await process.wait()
            await process.aclose()

    async def ledger(self) -> dict[str, Any]:
        """The emulator's ledger, as ``GET /_emulator/ledger`` answers it."""
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.get(
                f"{self.base_url}/_emulator/ledger",
                headers={"Authorization": f"Bearer {self.api_key}"},
            )
            response.raise_for_status()
            answer: dict[str, Any] = json.loads(response.content)
            return answer

"""The emulator in its own process, for load tests and benchmarks.

In-process, the emulator shares the event loop (and the core) with the
orchestrator it serves; in its own process, it uses the other core and its
CPU is not charged to fleetroll.

Each one is ``fleetroll emulator``, forked from a warm process (a "zygote",
one per parent process) that imported the emulator once: a new interpreter
spends ~2.5 s of CPU importing it (the MCP and Fleet SDKs), for every emulator
a test suite or a benchmark starts.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
from contextlib import suppress
from types import TracebackType
from typing import Any, Self

import anyio
import httpx

from fleetroll.errors import EmulatorError
from fleetroll.settings.fault_profiles import FaultProfile

__all__ = ["EmulatorProcess"]

_LISTENING = re.compile(rb"listening on (http://\S+)")


class _Zygote:
    """The warm process every EmulatorProcess of this process is forked from.

    Started on first use; it exits when this process closes its end of the
    socket (at exit, or when this process dies).
    """

    _lock = threading.Lock()
    _socket: socket.socket | None = None
    _process: subprocess.Popen[bytes] | None = None

    @classmethod
    def fork(cls, profile: FaultProfile, env: dict[str, str], output: int) -> int:
        """A new emulator child (blocking) injecting ``profile``; its stdout and stderr
        go to the ``output`` descriptor. Returns its pid."""
        request = {"profile": profile.model_dump_json(), "env": env, "cwd": os.getcwd()}
        request_line = json.dumps(request).encode() + b"\n"
        with cls._lock:
            if cls._process is None or cls._process.poll() is not None:
                cls._start()
            assert cls._socket is not None
            socket.send_fds(cls._socket, [request_line], [output])
            reply = _read_line(cls._socket, [])
        if not reply:
            raise EmulatorError("the emulator's zygote process exited")
        return int(reply)

    @classmethod
    def _start(cls) -> None:
        ours, theirs = socket.socketpair()
        with theirs:
            cls._process = subprocess.Popen(
                [sys.executable, "-c", f"import {__name__} as m; m._zygote({theirs.fileno()})"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=[theirs.fileno()],
            )
        cls._socket = ours


def _read_line(sock: socket.socket, fds: list[int]) -> bytes:
    """One newline-ended message from ``sock``, and any descriptors sent with it."""
    data = b""
    while not data.endswith(b"\n"):
        chunk, more, _, _ = socket.recv_fds(sock, 1 << 16, 1)
        fds += more
        if not chunk:
            return b""
        data += chunk
    return data


def _zygote(fd: int) -> None:
    """The zygote's loop: one forked emulator per request on the socket ``fd``."""
    # What an emulator imports, once for every child, as the command imports it.
    from fleetroll._internal.pydantic_plugins import skip_unused_pydantic_plugins

    skip_unused_pydantic_plugins(os.environ)
    import fleetroll.emulator.main
    import fleetroll.emulator.server  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    requests = socket.socket(fileno=fd)
    while True:
        fds: list[int] = []
        message = _read_line(requests, fds)
        if not message:
            return  # our parent has gone
        pid = os.fork()
        if pid == 0:
            requests.close()
            os._exit(_emulator(json.loads(message), fds[0]))
        for descriptor in fds:
            os.close(descriptor)
        requests.sendall(f"{pid}\n".encode())


def _emulator(request: dict[str, Any], output: int) -> int:
    """A forked child: an emulator, as ``fleetroll emulator --port 0`` runs one."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the emulator waits for its verifiers
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    from fleetroll._internal.pydantic_plugins import skip_unused_pydantic_plugins
    from fleetroll.emulator.main import serve_until_signalled
    from fleetroll.errors import FleetrollError
    from fleetroll.settings import load_settings
    from fleetroll.telemetry.console import configure_console_logging

    # As the ``fleetroll`` group and the command do before the emulator starts.
    skip_unused_pydantic_plugins(os.environ)
    code = 0
    try:
        settings = load_settings()
        configure_console_logging(settings.telemetry.console_level)
        key = settings.emulator_api_key
        serve_until_signalled(
            FaultProfile.model_validate_json(request["profile"]),
            settings.emulator,
            profile_name="custom",
            host=settings.emulator.host,
            port=0,
            api_key=key.get_secret_value() if key else None,
            public_url=None,
            say=lambda line: print(line, flush=True),
        )
    except FleetrollError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        code = 1
    except BaseException:  # never unwind into the zygote's loop: print, exit 1 (as Python would)
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
    return code


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
        #: The read end of the child's stdout and stderr: at its end, the child has exited.
        self._output: int | None = None
        self.base_url = ""
        self.api_key = secrets.token_urlsafe(32)
        self.pid: int | None = None

    async def __aenter__(self) -> Self:
        # The key goes through the environment, never the command line (ps shows that).
        env = {**os.environ, "FLEETROLL_EMULATOR_API_KEY": self.api_key}
        self._output, writer = os.pipe()
        seen = b""
        try:
            try:
                # Blocking, and seconds long the first time (the zygote imports the emulator).
                self.pid = await anyio.to_thread.run_sync(_Zygote.fork, self.profile, env, writer)
            finally:
                os.close(writer)
            with anyio.fail_after(self._startup_timeout_s):
                while (match := _LISTENING.search(seen)) is None:
                    chunk = await self._read()
                    if not chunk:
                        raise EOFError
                    seen += chunk
            self.base_url = match.group(1).decode()
        except (TimeoutError, EOFError) as exc:
            await self._stop()
            raise EmulatorError(
                f"the emulator process did not start: {seen.decode(errors='replace')[-2000:]}"
            ) from exc
        except BaseException:
            await self._stop()
            raise
        return self

    async def _read(self) -> bytes:
        assert self._output is not None
        await anyio.wait_readable(self._output)
        return os.read(self._output, 65536)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stop()

    async def _stop(self) -> None:
        if self._output is None:
            return
        with anyio.CancelScope(shield=True):
            try:
                for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 30.0)):
                    if self.pid is None:
                        break
                    with suppress(ProcessLookupError):
                        os.kill(self.pid, sig)
                    with anyio.move_on_after(wait_s):
                        while await self._read():  # its output ends when it exits
                            pass
                        break
            finally:
                os.close(self._output)
                self._output = None

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

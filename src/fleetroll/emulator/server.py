"""Starting the emulator: in-process on a free loopback port, or standalone."""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import anyio
import uvicorn

from fleetroll.emulator.app import EmulatorApp
from fleetroll.emulator.envs import default_envs
from fleetroll.emulator.envs.base import SampleEnv
from fleetroll.emulator.faults import FaultInjector, FaultProfile
from fleetroll.emulator.instances import InstanceStore
from fleetroll.emulator.ledger import Ledger
from fleetroll.emulator.verifiers import VerifierRunner
from fleetroll.errors import EmulatorError

__all__ = ["Emulator"]

_STARTUP_TIMEOUT_S = 30.0
_SHUTDOWN_TIMEOUT_S = 10.0


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves the host process's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Emulator:
    """A Fleet-compatible platform on loopback, for the SDK to talk to.

    Use it as an async context manager::

        async with Emulator(profile) as emu:
            fleet = AsyncFleet(api_key=emu.api_key, base_url=emu.base_url)

    Args:
        profile: the faults to inject (default: none).
        envs: the sample environments to serve (default: all of them).
        host, port: where to listen; port 0 picks a free one.
        api_key: the only API key accepted; None accepts any non-empty key.
        verifier_memory_mb: address-space cap of each verifier process.
    """

    def __init__(
        self,
        profile: FaultProfile | None = None,
        *,
        envs: Sequence[SampleEnv] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        verifier_memory_mb: int = 512,
    ) -> None:
        self.profile = profile or FaultProfile()
        self.ledger = Ledger()
        self._envs = list(envs) if envs is not None else default_envs()
        self._host = host
        self._port = port
        self._api_key = api_key
        self._verifier_memory_mb = verifier_memory_mb
        self._data_dir: Path | None = None
        self._stack = contextlib.AsyncExitStack()
        self.app: EmulatorApp | None = None
        self.base_url = ""

    @property
    def api_key(self) -> str:
        """A key the emulator accepts (its own, or a placeholder when any key goes)."""
        return self._api_key or "emulator-local-key"

    @property
    def store(self) -> InstanceStore:
        assert self.app is not None, "the emulator is not running"
        return self.app.store

    async def __aenter__(self) -> Self:
        self._stack = contextlib.AsyncExitStack()
        async with self._stack as stack:
            stack.callback(self._cleanup)
            await stack.enter_async_context(self._running())
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self._stack.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup as group:
            # The server's task group wraps the caller's own exception; hand it
            # back as it was raised, so `async with Emulator()` is transparent.
            if exc is not None and group.exceptions == (exc,):
                raise exc from exc.__cause__
            raise

    @contextlib.asynccontextmanager
    async def _running(self) -> AsyncIterator[None]:
        self._data_dir = Path(tempfile.mkdtemp(prefix="fleetroll-emulator-"))
        store = InstanceStore(self._data_dir, self.ledger)
        self.app = EmulatorApp(
            self._envs,
            store,
            FaultInjector(self.profile),
            self.ledger,
            VerifierRunner(memory_mb=self._verifier_memory_mb),
            api_key=self._api_key,
        )
        config = uvicorn.Config(
            self.app,
            host=self._host,
            port=self._port,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=1,
            access_log=False,
            # Thousands of concurrent rollouts hold thousands of connections.
            backlog=4096,
        )
        server = _EmbeddedServer(config)
        # Keep the host's logs clean: the MCP SDK and httpx log every request.
        for name in ("mcp", "httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)
        stopped = anyio.Event()

        async def serve() -> None:
            try:
                await server.serve()
            finally:
                stopped.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(serve)
            try:
                with anyio.fail_after(_STARTUP_TIMEOUT_S):
                    while not server.started:
                        if stopped.is_set():
                            raise EmulatorError(
                                f"the emulator could not listen on {self._host}:{self._port}"
                            )
                        await anyio.sleep(0.01)
                port = server.servers[0].sockets[0].getsockname()[1]
                self.base_url = f"http://{self._host}:{port}"
                self.app.base_url = self.base_url
                yield
            finally:
                server.should_exit = True
                with anyio.move_on_after(_SHUTDOWN_TIMEOUT_S, shield=True):
                    await stopped.wait()
                tg.cancel_scope.cancel()

    def _cleanup(self) -> None:
        if self.app is not None:
            self.app.store.close()
        if self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None

"""Starting the emulator: in-process on a free loopback port, or standalone."""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from fleetroll._serving import exit_transparently, serve_asgi
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
        await exit_transparently(self._stack, exc_type, exc, tb)

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
        # Keep the host's logs clean: the MCP SDK and httpx log every request.
        for name in ("mcp", "httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)
        try:
            # Thousands of concurrent rollouts hold thousands of connections.
            async with serve_asgi(
                self.app,
                host=self._host,
                port=self._port,
                startup_timeout_s=_STARTUP_TIMEOUT_S,
                shutdown_timeout_s=_SHUTDOWN_TIMEOUT_S,
                backlog=4096,
            ) as base_url:
                self.base_url = base_url
                self.app.base_url = base_url
                yield
        except OSError as exc:
            raise EmulatorError(f"the emulator could not start: {exc}") from exc

    def _cleanup(self) -> None:
        if self.app is not None:
            self.app.store.close()
        if self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None

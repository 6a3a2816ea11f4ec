"""Starting the emulator: in-process on a free loopback port, or standalone."""

from __future__ import annotations

import contextlib
import logging
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from starlette.requests import ClientDisconnect

from fleetroll._internal.exit_stack import exit_transparently
from fleetroll._internal.serving import serve_asgi
from fleetroll.emulator.app import EmulatorApp, RecordedRequest
from fleetroll.emulator.envs import default_envs
from fleetroll.emulator.envs.base import SampleEnv
from fleetroll.emulator.faults import FaultInjector
from fleetroll.emulator.instances import InstanceStore
from fleetroll.emulator.ledger import Ledger
from fleetroll.emulator.traces import TraceStore
from fleetroll.emulator.verifiers import VerifierRunner
from fleetroll.errors import EmulatorError
from fleetroll.settings.fault_profiles import FaultProfile
from fleetroll.settings.sections import VerifierLimits

__all__ = ["Emulator"]

_STARTUP_TIMEOUT_S = 30.0
_SHUTDOWN_TIMEOUT_S = 10.0


class _NotAClientDisconnect(logging.Filter):
    """Drops the traceback the MCP SDK logs when a client leaves mid-request
    (every cancelled rollout does): nobody is left to answer, nothing is wrong."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], ClientDisconnect))


def _quiet_client_disconnects(logger: logging.Logger) -> None:
    if not any(isinstance(f, _NotAClientDisconnect) for f in logger.filters):
        logger.addFilter(_NotAClientDisconnect())


class Emulator:
    """A Fleet-compatible platform on loopback, for the SDK to talk to.

    Use it as an async context manager::

        async with Emulator(profile) as emu:
            fleet = AsyncFleet(api_key=emu.api_key, base_url=emu.base_url)

    Args:
        profile: the faults to inject (default: none).
        envs: the sample environments to serve (default: all of them).
        host, port: where to listen; port 0 picks a free one.
        api_key: the only API key accepted; None generates one (read it from
            :attr:`api_key`).
        verifier_limits: what each verifier run may take and say (verifiers
            are code from tasks, run on this host in a sandboxed worker).
        verifier_max_parallel: verifier runs at once.
        keep_ended_instances, keep_ended_s: ended instances (and their
            SQLite files) kept for late reads; past either, the oldest go.
        record_requests: keep the latest this many control-plane and
            instance-API requests in :attr:`requests` (0: none; for tests).
        public_url: the base of the URLs it hands out (instances' MCP and
            manager URLs, browser leases) when a reverse proxy fronts it
            (e.g. ``https://fleet.test:8443``); default: its own
            :attr:`base_url`. Settable while it runs (:attr:`public_url`).
    """

    def __init__(
        self,
        profile: FaultProfile | None = None,
        *,
        envs: Sequence[SampleEnv] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        verifier_limits: VerifierLimits | None = None,
        verifier_max_parallel: int = 4,
        keep_ended_instances: int = 1024,
        keep_ended_s: float = 600.0,
        record_requests: int = 0,
        public_url: str | None = None,
    ) -> None:
        self.profile = profile or FaultProfile()
        self.ledger = Ledger()
        self._envs = list(envs) if envs is not None else default_envs()
        self._host = host
        self._port = port
        self._api_key = api_key or secrets.token_urlsafe(32)
        self._verifier_limits = verifier_limits or VerifierLimits()
        self._verifier_max_parallel = verifier_max_parallel
        self._keep_ended_instances = keep_ended_instances
        self._keep_ended_s = keep_ended_s
        self._record_requests = record_requests
        self._public_url = public_url.rstrip("/") if public_url else None
        self._data_dir: Path | None = None
        self._stack = contextlib.AsyncExitStack()
        self.app: EmulatorApp | None = None
        self.base_url = ""

    @property
    def api_key(self) -> str:
        """The one API key the emulator accepts (given, or generated at start)."""
        return self._api_key

    @property
    def public_url(self) -> str:
        """The base of the URLs it hands out: ``public_url`` if given, else :attr:`base_url`."""
        return self._public_url or self.base_url

    @public_url.setter
    def public_url(self, url: str) -> None:
        self._public_url = url.rstrip("/")
        if self.app is not None:
            self.app.base_url = self._public_url

    @property
    def store(self) -> InstanceStore:
        assert self.app is not None, "the emulator is not running"
        return self.app.store

    @property
    def requests(self) -> list[RecordedRequest]:
        """The requests received, oldest first (with ``record_requests``)."""
        assert self.app is not None, "the emulator is not running"
        return list(self.app.requests or ())

    def forget_requests(self) -> None:
        """Start the record afresh."""
        assert self.app is not None, "the emulator is not running"
        if self.app.requests is not None:
            self.app.requests.clear()

    @property
    def traces(self) -> TraceStore:
        """What the trace API received (trace jobs and ingested sessions)."""
        assert self.app is not None, "the emulator is not running"
        return self.app.traces

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
        store = InstanceStore(
            self._data_dir,
            self.ledger,
            keep_ended=self._keep_ended_instances,
            keep_ended_s=self._keep_ended_s,
            unseeded_random=self.profile.unseeded_random,
        )
        self.app = EmulatorApp(
            self._envs,
            store,
            FaultInjector(self.profile),
            self.ledger,
            VerifierRunner(limits=self._verifier_limits, max_parallel=self._verifier_max_parallel),
            api_key=self._api_key,
        )
        if self._record_requests:
            self.app.record_requests(self._record_requests)
        # Keep the host's logs clean: the MCP SDK and httpx log every request.
        for name in ("mcp", "httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)
        _quiet_client_disconnects(logging.getLogger("mcp.server.streamable_http"))
        try:
            # Thousands of concurrent rollouts hold thousands of connections.
            async with serve_asgi(
                self.app,
                host=self._host,
                port=self._port,
                startup_timeout_s=_STARTUP_TIMEOUT_S,
                shutdown_timeout_s=_SHUTDOWN_TIMEOUT_S,
                backlog=4096,
                # The compiled parser (a dependency); no proxy in front of us,
                # so no proxy-header middleware on every request either.
                http="httptools",
                proxy_headers=False,
            ) as base_url:
                self.base_url = base_url
                self.app.base_url = self._public_url or base_url
                yield
        except OSError as exc:
            raise EmulatorError(
                f"the emulator could not listen on {self._host}:{self._port}: {exc}"
            ) from exc

    def _cleanup(self) -> None:
        if self.app is not None:
            self.app.store.close()
        if self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None

"""Setting telemetry up once, at the entry point, and tearing it down cleanly.

:func:`open_telemetry` (async) and :class:`Telemetry` (sync) build, from the
``[telemetry]`` section, an :class:`~fleetroll.telemetry.events.Events` whose
sinks are Logfire (local store always, Logfire cloud when a ``LOGFIRE_TOKEN``
is given) and the console, with a :class:`~fleetroll.telemetry.events.Redactor`
that knows the secrets it is given (the entry point passes every secret of its
settings, ``Settings.secrets()``). With no Logfire cloud, events go straight into
the local store as the rows Logfire's logs of them would make
(:class:`~fleetroll.telemetry.sinks.StoreSink`: no span per event).

With ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or its ``_TRACES_``/``_LOGS_`` forms) set,
no Logfire account is needed: the OpenTelemetry SDK's own OTLP/HTTP exporters,
which Logfire sets up from those variables (``OTEL_EXPORTER_OTLP_HEADERS``,
``OTEL_EXPORTER_OTLP_PROTOCOL`` and the rest are theirs), send each event as a
span (Logfire's log of it) and as an OpenTelemetry log record; the local store
gets the same rows. Nothing is sent to Logfire without a token.

Logfire is configured with ``local=True``: each set-up owns its own Logfire
instance and tracer provider, and the process-wide ``logfire`` object is left
alone. Setting telemetry up twice in one process (tests, or a trainer that
configured Logfire for itself before using fleetroll) is therefore safe: each
set-up gets exactly its own records, and shutting one down leaves the others
running.

Frames of this package are marked as Logfire "non-user code", so a record's
``code.filepath``/``code.lineno`` point at the line that emitted the event
(``rollout.py``...), not at the sink. Retries are reported per call
(:mod:`fleetroll._internal.retrying`), as ``fleet_retry`` events and debug records on
the ``fleetroll.retries`` logger; no dependency's process-wide hooks are set.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import TextIO

import anyio
import logfire
from pydantic import SecretStr

from fleetroll.settings import TelemetrySettings
from fleetroll.telemetry.events import Events, EventSink, Redactor
from fleetroll.telemetry.sinks import ConsoleSink, LogfireSink, OtlpLogSink, StoreSink
from fleetroll.telemetry.store import SQLiteSpanProcessor, is_disabled

__all__ = ["Telemetry", "open_telemetry", "otlp_destinations"]

_log = logging.getLogger(__name__)


def otlp_destinations(environ: Mapping[str, str] | None = None) -> set[str]:
    """Which signals (``traces``, ``logs``) the OpenTelemetry environment variables
    send to an OTLP endpoint: ``OTEL_EXPORTER_OTLP_ENDPOINT`` both, the
    ``..._TRACES_ENDPOINT``/``..._LOGS_ENDPOINT`` one each; ``OTEL_TRACES_EXPORTER``/
    ``OTEL_LOGS_EXPORTER`` other than ``otlp`` turn one off (as Logfire reads them)."""
    env = os.environ if environ is None else environ
    out = set()
    for signal in ("traces", "logs"):
        endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get(
            f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"
        )
        exporter = env.get(f"OTEL_{signal.upper()}_EXPORTER", "").lower()
        if endpoint and exporter in ("otlp", ""):
            out.add(signal)
    return out


@functools.cache
def _mark_telemetry_frames_as_library_code() -> None:
    # Once per process: logfire appends to a global tuple on every call.
    logfire.add_non_user_code_prefix(Path(__file__).parent)


@functools.cache
def _version() -> str:
    try:
        return importlib.metadata.version("fleetroll")
    except importlib.metadata.PackageNotFoundError:  # a source tree not installed
        return "0+unknown"


class Telemetry:
    """Telemetry of one process: Logfire, the local store and the console.

    Build it once at the entry point, emit through :attr:`events`, and close it
    (or use it as a context manager) before the process ends, so that every
    record is flushed. Async code uses :func:`open_telemetry` instead, which
    does the blocking parts in a worker thread.
    """

    def __init__(
        self,
        telemetry: TelemetrySettings,
        *,
        secrets: Iterable[str | None] = (),
        logfire_token: SecretStr | None = None,
        service_name: str = "fleetroll",
        console: TextIO | None = None,
        extra_sinks: Sequence[EventSink] = (),
    ) -> None:
        """Configure Logfire, open the store (unless its path is ``os.devnull``), wire the sinks.

        Args:
            telemetry: where and how (``[telemetry]``).
            secrets: redacted from every event (the entry point's
                ``Settings.secrets()``).
            logfire_token: ``LOGFIRE_TOKEN``: with it (and ``send_to_logfire``),
                records also go to Logfire cloud.
            service_name: the ``service_name`` of every record.
            console: where console lines go (default: the current ``sys.stderr``).
            extra_sinks: more sinks for the same events (e.g. a ``MemorySink``).

        Raises:
            StoreError: the local store cannot be opened or created.
        """
        _mark_telemetry_frames_as_library_code()
        t = telemetry
        self.telemetry = telemetry
        self.redactor = Redactor(secrets)
        self.store: SQLiteSpanProcessor | None = None
        if not is_disabled(t.db_path):
            self.store = SQLiteSpanProcessor(
                t.db_path,
                flush_interval_s=t.flush_interval_s,
                flush_records=t.flush_records,
                max_queued=t.max_queued,
                shutdown_timeout_s=t.shutdown_timeout_s,
            )
        token = logfire_token
        send = token is not None and t.send_to_logfire
        try:
            self.logfire = logfire.configure(
                local=True,
                send_to_logfire=send,
                token=token.get_secret_value() if send and token is not None else None,
                console=False,
                service_name=service_name,
                service_version=_version(),
                environment=t.environment,
                additional_span_processors=[self.store] if self.store is not None else [],
                metrics=False,
                inspect_arguments=False,
                # Secrets are removed once, by our Redactor, before an event
                # reaches any sink. Logfire's own scrubbing would blank whole
                # error messages that merely contain words like "session" or
                # "auth", and it doubles the cost of each record.
                scrubbing=False,
            )
        except BaseException:
            if self.store is not None:
                self.store.shutdown()
            raise
        self.otlp = otlp_destinations()
        self.console = ConsoleSink(
            t.console_level,
            file=console,
            repeat_s=t.console_repeat_s,
            as_json=t.console == "json",
        )
        self.events = Events(
            [*self._logfire_sinks(send), self.console, *extra_sinks],
            self.redactor,
            off=() if t.tool_calls else ("fleet_tool_call",),
        )
        self._closed = False

    def _logfire_sinks(self, send: bool) -> list[EventSink]:
        """Events as Logfire logs when Logfire sends them somewhere (its cloud, or
        an OTLP endpoint), and as OTLP log records to an OTLP logs endpoint; else
        straight into the local store as the same rows (no span per event), or nowhere."""
        sinks: list[EventSink] = []
        if send or "traces" in self.otlp:
            sinks.append(LogfireSink(self.logfire))
        elif self.store is not None:
            sinks.append(StoreSink(self.logfire, self.store))
        if "logs" in self.otlp:
            sinks.append(OtlpLogSink(self.logfire))
        return sinks

    def flush(self, timeout_s: float | None = None) -> bool:
        """Push every record emitted so far to the store (and Logfire cloud); blocking.

        Returns False when that took longer than ``timeout_s`` (default
        ``telemetry.shutdown_timeout_s``).
        """
        timeout = self.telemetry.shutdown_timeout_s if timeout_s is None else timeout_s
        return self.logfire.force_flush(timeout_millis=int(timeout * 1000))

    def close(self) -> None:
        """Flush and shut every processor down, each bounded by ``shutdown_timeout_s``; blocking."""
        if self._closed:
            return
        self._closed = True
        timeout_ms = int(self.telemetry.shutdown_timeout_s * 1000)
        try:
            self.logfire.shutdown(timeout_millis=timeout_ms, flush=True)
        except Exception:  # shutting down must not mask the job's own outcome
            _log.exception("telemetry: logfire shutdown failed")
        finally:
            if self.store is not None:
                self.store.shutdown()  # idempotent; covers a provider that did not call it

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@asynccontextmanager
async def open_telemetry(
    telemetry: TelemetrySettings,
    *,
    secrets: Iterable[str | None] = (),
    logfire_token: SecretStr | None = None,
    service_name: str = "fleetroll",
    console: TextIO | None = None,
    extra_sinks: Sequence[EventSink] = (),
) -> AsyncIterator[Events]:
    """Telemetry for an async entry point: yields the :class:`Events` to pass down.

    Set-up and teardown (Logfire configuration, opening the store, the final
    flush) run in a worker thread, never on the event loop. On exit every
    record is flushed and the processors shut down, shielded from
    cancellation and bounded by ``telemetry.shutdown_timeout_s``. The
    arguments are :class:`Telemetry`'s::

        open_telemetry(
            settings.telemetry, secrets=settings.secrets(), logfire_token=settings.logfire_token
        )

    Raises:
        StoreError: the local store cannot be opened or created.
    """
    made = await anyio.to_thread.run_sync(
        functools.partial(
            Telemetry,
            telemetry,
            secrets=tuple(secrets),
            logfire_token=logfire_token,
            service_name=service_name,
            console=console,
            extra_sinks=extra_sinks,
        )
    )
    try:
        yield made.events
    finally:
        # Two shutdowns in a row at most (the Logfire pipeline, then the store).
        budget = 2 * telemetry.shutdown_timeout_s + 1
        with anyio.CancelScope(shield=True), anyio.move_on_after(budget) as scope:
            await anyio.to_thread.run_sync(made.close, abandon_on_cancel=True)
        if scope.cancelled_caught:
            _log.warning("telemetry: shutdown took over %g s; some records may be lost", budget)

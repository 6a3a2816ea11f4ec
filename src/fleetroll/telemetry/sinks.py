"""Where events go: Logfire log records, and human-readable console lines.

:class:`LogfireSink` turns each event into a Logfire log record whose message
*is* the event name (``message = 'fleet_rollout_completed'`` in SQL) and whose
attributes are the event's (base attributes included). Logfire hands the
record to its span processors: the local store, and Logfire cloud when a
token is configured.

:class:`ConsoleSink` prints through structlog, one line per event, to stderr.
The console is for a person watching a run, so each event has a *console*
level of its own (:func:`console_level`), separate from its record level:

- ``debug``: the per-rollout lifecycle (``fleet_rollout_started``,
  ``fleet_provisioning_completed``, ``fleet_instance_released``, a rollout
  completed normally or cancelled) and per-attempt noise that the rollout's
  completion sums up (``fleet_make_retry``, ``fleet_make_failed``,
  ``fleet_env_reset_failed``, ``fleet_tool_call_failed``,
  ``fleet_mcp_tool_error``, ``fleet_verifier_failed``);
- ``info``: batch start and end, and a rollout that ran out of steps;
- ``warning``: a rollout that failed for any other reason. On a terminal
  (where a live progress line is drawn) failures are summed up per
  ``failure_reason``: one short line (``12× tools_error: <error>``) at most
  every ``telemetry.console_repeat_s`` per reason, and the counts not shown
  yet when the batch ends. Elsewhere (a log file, CI) one line per failed
  rollout, cut to :data:`LINE_CHARS` characters;
- ``error``: an instance that could not be released (it may be leaking).

With the default ``console_level = "info"`` a healthy batch prints two lines.

Stdlib logging goes to the same place, at the same level:
:func:`fleetroll.telemetry.console.configure_console_logging`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TextIO

import logfire
import structlog
from logfire._internal.stack_info import get_user_stack_info
from opentelemetry._logs import SeverityNumber
from opentelemetry.trace import get_current_span

from fleetroll.telemetry.events import Event
from fleetroll.telemetry.store import (
    LEVEL_NUMBERS,
    EventOrigin,
    EventRecord,
    SQLiteSpanProcessor,
    level_name,
)

__all__ = [
    "CONSOLE_LEVELS",
    "LINE_CHARS",
    "ConsoleSink",
    "LogfireSink",
    "StoreSink",
    "console_level",
]

#: A failed rollout's line off a terminal is cut to this many characters.
LINE_CHARS: Final = 160
#: On a terminal, the error shown with a failure count is cut to this many.
_SUMMARY_ERROR_CHARS: Final = 100
#: What a console line starts with: ``12:00:00 [warning  ] ``.
_PREFIX_CHARS: Final = 21
#: A failed rollout's fields on its one line (off a terminal), most useful first.
_FAILURE_KEYS: Final = (
    "failure_reason",
    "task_key",
    "sample_index",
    "error_message",
    "env_key",
    "rollout_id",
)

DEBUG, INFO, WARNING, ERROR = logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR

#: Console level of events whose level does not depend on their attributes.
CONSOLE_LEVELS: Final[Mapping[str, int]] = {
    "fleet_job_started": DEBUG,  # for the store: how to resume the job's batch
    "fleet_rollout_started": DEBUG,
    "fleet_provisioning_completed": DEBUG,
    "fleet_env_created": DEBUG,
    # Its fleet_instance_release_failed twin is the error line.
    "fleet_env_close_failed": DEBUG,
    "fleet_instance_released": DEBUG,
    "fleet_instance_recycled": DEBUG,
    "fleet_make_retry": DEBUG,
    "fleet_retry": DEBUG,
    "fleet_make_failed": DEBUG,
    "fleet_env_reset_failed": DEBUG,
    "fleet_tool_call": DEBUG,
    "fleet_tool_call_failed": DEBUG,
    "fleet_mcp_tool_error": DEBUG,
    "fleet_verifier_failed": DEBUG,
    "fleet_batch_started": INFO,
    "fleet_batch_completed": INFO,
    "fleet_rollout_restarted": INFO,
    "fleet_instance_release_failed": ERROR,
}
_BY_EVENT_LEVEL: Final[Mapping[str, int]] = {
    "debug": DEBUG,
    "info": INFO,
    "warn": WARNING,
    "error": ERROR,
}
_BY_SETTING: Final[Mapping[str, int]] = {
    "debug": DEBUG,
    "info": INFO,
    "warning": WARNING,
    "error": ERROR,
}


def console_level(event: Event) -> int:
    """The stdlib logging level at which ``event`` shows on the console."""
    if event.name == "fleet_rollout_completed":
        reason = event.attributes.get("failure_reason")
        if reason is None or reason in ("cancelled", "superseded"):
            return DEBUG
        return INFO if reason in ("max_steps", "stale") else WARNING
    if event.name == "fleet_create_abandoned":
        # One a create in flight at a cancel (hundreds at a Ctrl-C): a line only
        # when its instance may be left running (a failed release has its own).
        return WARNING if event.attributes.get("outcome") == "cut" else DEBUG
    fixed = CONSOLE_LEVELS.get(event.name)
    return fixed if fixed is not None else _BY_EVENT_LEVEL.get(event.level, INFO)


class StoreSink:
    """Each event as the local store's row of Logfire's log of it, with no span made.

    For a Logfire set-up that sends nowhere but the local store (no token, or
    ``telemetry.send_to_logfire`` off): making an OpenTelemetry span per event,
    only for the store to turn it into a row, was most of telemetry's CPU per
    rollout. The row is the same (``code.*`` from the emitting frame, the
    current span's trace as parent, Logfire's own ids, resource and scope).
    """

    def __init__(self, instance: logfire.Logfire, store: SQLiteSpanProcessor) -> None:
        config = instance.config
        provider: Any = config.get_tracer_provider().provider  # the SDK's, with a resource
        # The scope of Logfire's logs: its logs tracer's (the SDK tracer under its proxy).
        sdk_tracer = getattr(instance._logs_tracer, "tracer", None)
        scope = getattr(sdk_tracer, "_instrumentation_scope", None)
        self._origin = EventOrigin(
            provider.resource,
            getattr(scope, "name", "logfire"),
            getattr(scope, "version", None),
        )
        self._ids = config.advanced.id_generator
        self._clock = config.advanced.ns_timestamp_generator
        self._min_level = config.min_level
        self._store = store

    def emit(self, event: Event) -> None:
        level = LEVEL_NUMBERS.get(event.level, 9)
        if level < self._min_level:
            return  # as Logfire.log does
        parent = get_current_span().get_span_context()
        if parent.is_valid:
            trace_id, parent_id = parent.trace_id, parent.span_id
        else:
            trace_id, parent_id = self._ids.generate_trace_id(), None
        self._store.record(
            EventRecord(
                self._clock(),
                trace_id,
                self._ids.generate_span_id(),
                parent_id,
                level_name(level) or "info",
                event.name,
                {**get_user_stack_info(), **event.attributes},
                self._origin,
            )
        )


class LogfireSink:
    """Each event as a Logfire log record: message = event name, attributes = event's."""

    def __init__(self, instance: logfire.Logfire) -> None:
        self._logfire = instance

    def emit(self, event: Event) -> None:
        # A fresh dict: logfire.log pops keys out of the one it is given.
        self._logfire.log(event.level, event.name, attributes=dict(event.attributes))


class OtlpLogSink:
    """Each event as an OpenTelemetry log record (body: the event name; its
    attributes), to the OTLP log exporter Logfire sets up from
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_LOGS_ENDPOINT``."""

    _SEVERITY: Final[Mapping[str, tuple[int, str]]] = {
        "debug": (5, "DEBUG"),
        "info": (9, "INFO"),
        "warn": (13, "WARN"),
        "error": (17, "ERROR"),
    }

    def __init__(self, instance: logfire.Logfire) -> None:
        provider = instance.config.get_logger_provider()
        self._logger = provider.get_logger("fleetroll")

    def emit(self, event: Event) -> None:
        number, text = self._SEVERITY.get(event.level, (9, "INFO"))
        self._logger.emit(
            timestamp=int(event.timestamp * 1e9),
            severity_number=SeverityNumber(number),
            severity_text=text,
            body=event.name,
            attributes={k: _otel_value(v) for k, v in event.attributes.items() if v is not None},
            event_name=event.name,
        )


def _otel_value(value: Any) -> Any:
    """An attribute value OpenTelemetry takes (a scalar); anything else as JSON text."""
    if isinstance(value, str | bool | int | float):
        return value
    return json.dumps(value, default=str)


_RESERVED: Final = frozenset({"event", "level", "timestamp"})  # structlog's own keys


class _StderrLogger:
    """structlog's output end: one line to ``file``, or to *the current* ``sys.stderr``.

    Looking ``sys.stderr`` up at each line lets a live progress display
    (which swaps it for its own) keep log lines above the progress bar.
    """

    def __init__(self, file: TextIO | None = None) -> None:
        self._file = file

    def msg(self, message: str) -> None:
        out = self._file or sys.stderr
        out.write(message + "\n")
        out.flush()

    debug = info = warning = warn = error = critical = exception = log = msg


@dataclass(slots=True)
class _Tally:
    """Failed rollouts of one ``failure_reason`` (terminal summaries)."""

    count: int = 0
    shown: int = 0  # the count last printed
    shown_at: float | None = None
    error: str = ""


class ConsoleSink:
    """Human-readable lines via structlog, at or above ``level`` (see the module docstring)."""

    def __init__(
        self,
        level: str = "info",
        *,
        file: TextIO | None = None,
        colors: bool | None = None,
        summarize: bool | None = None,
        repeat_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        as_json: bool = False,
    ) -> None:
        """Print events at or above ``level`` (``debug``, ``info``, ``warning``, ``error``).

        Args:
            summarize: sum failed rollouts up per failure reason (default: when
                the output is a terminal).
            repeat_s: with ``summarize``, a reason's count is printed at most
                this often.
            clock: monotonic seconds (tests pass their own).
            as_json: each line one JSON object (``timestamp``, ``level``,
                ``event`` and the event's attributes), never summed up: for a
                log shipper (``telemetry.console = "json"``).

        Raises:
            ValueError: ``level`` is not one of those names.
        """
        try:
            self.level = _BY_SETTING[level]
        except KeyError:
            raise ValueError(f"unknown console level {level!r}") from None
        stream = file or sys.stderr
        terminal = bool(getattr(stream, "isatty", lambda: False)())
        if colors is None:
            colors = terminal
        self.summarize = (terminal if summarize is None else summarize) and not as_json
        self._repeat_s = repeat_s
        self._clock = clock
        self._tallies: dict[str, _Tally] = {}
        processors: list[Any] = (
            [
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.add_log_level,
                structlog.processors.JSONRenderer(default=str, ensure_ascii=False),
            ]
            if as_json
            else [
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
                structlog.dev.ConsoleRenderer(colors=colors, sort_keys=False, pad_event_to=28),
            ]
        )
        self._json = as_json
        self._logger: Any = structlog.wrap_logger(
            _StderrLogger(file),
            processors=processors,
            wrapper_class=structlog.make_filtering_bound_logger(self.level),
            cache_logger_on_first_use=True,
        )

    def emit(self, event: Event) -> None:
        level = console_level(event)
        if level < self.level:
            return
        if event.name == "fleet_rollout_completed" and level >= WARNING and not self._json:
            self._failed(level, event.attributes)
            return
        if event.name == "fleet_batch_completed":
            self._flush_tallies()
        attributes = {
            (f"{k}_" if k in _RESERVED else k): v
            for k, v in event.attributes.items()
            if v is not None
        }
        self._logger.log(level, event.name, **attributes)

    def _failed(self, level: int, attributes: Mapping[str, Any]) -> None:
        reason = str(attributes.get("failure_reason"))
        error = " ".join(str(attributes.get("error_message") or "").split())
        if not self.summarize:
            fields = [
                f"{key}={error!r}" if key == "error_message" else f"{key}={attributes[key]}"
                for key in _FAILURE_KEYS
                if attributes.get(key) is not None
            ]
            line = " ".join(["fleet_rollout_completed", *fields])
            self._logger.log(level, _cut(line, LINE_CHARS - _PREFIX_CHARS))
            return
        tally = self._tallies.setdefault(reason, _Tally())
        tally.count += 1
        tally.error = error
        now = self._clock()
        if tally.shown_at is None or now - tally.shown_at >= self._repeat_s:
            self._show(tally, reason, level, now)

    def _show(self, tally: _Tally, reason: str, level: int, now: float) -> None:
        tally.shown, tally.shown_at = tally.count, now
        error = _cut(tally.error, _SUMMARY_ERROR_CHARS)
        self._logger.log(
            level, f"{tally.count}× {reason}: {error}" if error else f"{tally.count}× {reason}"
        )

    def _flush_tallies(self) -> None:
        """Counts not shown yet (the batch ended inside a reason's quiet period)."""
        now = self._clock()
        for reason, tally in self._tallies.items():
            if tally.count != tally.shown:
                self._show(tally, reason, WARNING, now)
        self._tallies.clear()


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"

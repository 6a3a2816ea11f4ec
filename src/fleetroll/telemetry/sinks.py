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
- ``warning``: a rollout that failed for any other reason (one line per
  failed rollout, with its ``failure_reason`` and error);
- ``error``: an instance that could not be released (it may be leaking).

With the default ``console_level = "info"`` a healthy batch prints two lines.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any, Final, TextIO

import logfire
import structlog

from fleetroll.telemetry.events import Event

__all__ = ["CONSOLE_LEVELS", "ConsoleSink", "LogfireSink", "console_level"]

DEBUG, INFO, WARNING, ERROR = logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR

#: Console level of events whose level does not depend on their attributes.
CONSOLE_LEVELS: Final[Mapping[str, int]] = {
    "fleet_rollout_started": DEBUG,
    "fleet_provisioning_completed": DEBUG,
    "fleet_instance_released": DEBUG,
    "fleet_make_retry": DEBUG,
    "fleet_make_failed": DEBUG,
    "fleet_env_reset_failed": DEBUG,
    "fleet_tool_call_failed": DEBUG,
    "fleet_mcp_tool_error": DEBUG,
    "fleet_verifier_failed": DEBUG,
    "fleet_batch_started": INFO,
    "fleet_batch_completed": INFO,
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
        if reason is None or reason == "cancelled":
            return DEBUG
        return INFO if reason == "max_steps" else WARNING
    fixed = CONSOLE_LEVELS.get(event.name)
    return fixed if fixed is not None else _BY_EVENT_LEVEL.get(event.level, INFO)


class LogfireSink:
    """Each event as a Logfire log record: message = event name, attributes = event's."""

    def __init__(self, instance: logfire.Logfire) -> None:
        self._logfire = instance

    def emit(self, event: Event) -> None:
        # A fresh dict: logfire.log pops keys out of the one it is given.
        self._logfire.log(event.level, event.name, attributes=dict(event.attributes))


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


class ConsoleSink:
    """Human-readable lines via structlog, at or above ``level`` (see the module docstring)."""

    def __init__(
        self,
        level: str = "info",
        *,
        file: TextIO | None = None,
        colors: bool | None = None,
    ) -> None:
        """Print events at or above ``level`` (``debug``, ``info``, ``warning``, ``error``).

        Raises:
            ValueError: ``level`` is not one of those names.
        """
        try:
            self.level = _BY_SETTING[level]
        except KeyError:
            raise ValueError(f"unknown console level {level!r}") from None
        if colors is None:
            stream = file or sys.stderr
            colors = bool(getattr(stream, "isatty", lambda: False)())
        self._logger: Any = structlog.wrap_logger(
            _StderrLogger(file),
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
                structlog.dev.ConsoleRenderer(colors=colors, sort_keys=False, pad_event_to=28),
            ],
            wrapper_class=structlog.make_filtering_bound_logger(self.level),
            cache_logger_on_first_use=True,
        )

    def emit(self, event: Event) -> None:
        level = console_level(event)
        if level < self.level:
            return
        attributes = {
            (f"{k}_" if k in _RESERVED else k): v
            for k, v in event.attributes.items()
            if v is not None
        }
        self._logger.log(level, event.name, **attributes)

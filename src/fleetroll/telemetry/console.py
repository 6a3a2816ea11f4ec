"""Stdlib logging on the console, as the command line wants it.

:func:`configure_console_logging` sends ``fleetroll.*`` records at the
console level (``telemetry.console_level``), and libraries' records (the mcp
client's "Error parsing SSE message" tracebacks under faults, httpx...) only
when that level is ``debug``. Lines go to the *current* ``sys.stderr``, so a
live progress display (which swaps it for its own) keeps them above its line.
Standard library only: ``fleetroll --help`` does not pay for more.

With ``json`` (``telemetry.console = "json"``) each record is one JSON object
on one line (:func:`json_line`): ``timestamp``, ``level``, ``logger``,
``event`` (the message), and ``exception`` when there is one.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, Final

__all__ = ["configure_console_logging", "json_line"]

_LEVELS: Final = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def _ours(record: logging.LogRecord) -> bool:
    return record.name == "fleetroll" or record.name.startswith("fleetroll.")


def json_line(level: str, event: str, **fields: Any) -> str:
    """One console line as JSON: ``timestamp`` (UTC, ISO 8601), ``level``, ``event``, ``fields``."""
    record = {
        "timestamp": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "level": level,
        "event": event,
        **fields,
    }
    return json.dumps(record, default=str, ensure_ascii=False)


class _ConsoleLogHandler(logging.Handler):
    """Writes records to the current ``sys.stderr``: fleetroll's at ``level``, others at debug."""

    def __init__(self, level: int, *, as_json: bool = False) -> None:
        super().__init__(logging.DEBUG)
        self.fleetroll_level = level
        self.as_json = as_json

    def filter(self, record: logging.LogRecord) -> bool:
        if _ours(record):
            return record.levelno >= self.fleetroll_level
        return self.fleetroll_level <= logging.DEBUG

    def format(self, record: logging.LogRecord) -> str:
        if self.as_json:
            fields: dict[str, Any] = {"logger": record.name}
            if record.exc_info and record.exc_info[1] is not None:
                exc = record.exc_info[1]
                fields["exception"] = (
                    logging.Formatter().formatException(record.exc_info)
                    if self.fleetroll_level <= logging.DEBUG
                    else f"{type(exc).__name__}: {exc}"
                )
            return json_line(record.levelname.lower(), record.getMessage(), **fields)
        message = record.getMessage()
        head = (
            record.levelname.lower()
            if _ours(record)
            else f"{record.levelname.lower()} {record.name}"
        )
        line = f"{head}: {message}"
        if record.exc_info and record.exc_info[1] is not None:
            if self.fleetroll_level <= logging.DEBUG:
                line += "\n" + logging.Formatter().formatException(record.exc_info)
            else:  # one line: what went wrong, not where
                exc = record.exc_info[1]
                line += f": {type(exc).__name__}: {exc}"
        return line

    def emit(self, record: logging.LogRecord) -> None:
        try:
            out = sys.stderr
            out.write(self.format(record) + "\n")
            out.flush()
        except Exception:
            self.handleError(record)


def configure_console_logging(level: str = "info", *, as_json: bool = False) -> None:
    """Route stdlib logging to the console, as the command line wants it (module docstring).

    Replaces the handler a previous call installed; other handlers are left
    alone. Libraries' records below warning are not even created unless
    ``level`` is ``debug``. ``as_json``: each record one JSON line.

    Raises:
        ValueError: ``level`` is not a console level name.
    """
    try:
        threshold = _LEVELS[level]
    except KeyError:
        raise ValueError(f"unknown console level {level!r}") from None
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, _ConsoleLogHandler):
            root.removeHandler(handler)
    root.addHandler(_ConsoleLogHandler(threshold, as_json=as_json))
    root.setLevel(logging.DEBUG if threshold <= logging.DEBUG else logging.WARNING)
    logging.getLogger("fleetroll").setLevel(threshold)

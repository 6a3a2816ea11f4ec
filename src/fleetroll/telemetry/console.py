"""Stdlib logging on the console, as the command line wants it.

:func:`configure_console_logging` sends ``fleetroll.*`` records at the
console level (``telemetry.console_level``), and libraries' records (the mcp
client's "Error parsing SSE message" tracebacks under faults, httpx...) only
when that level is ``debug``. Lines go to the *current* ``sys.stderr``, so a
live progress display (which swaps it for its own) keeps them above its line.
Standard library only: ``fleetroll --help`` does not pay for more.
"""

from __future__ import annotations

import logging
import sys
from typing import Final

__all__ = ["configure_console_logging"]

_LEVELS: Final = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def _ours(record: logging.LogRecord) -> bool:
    return record.name == "fleetroll" or record.name.startswith("fleetroll.")


class _ConsoleLogHandler(logging.Handler):
    """Writes records to the current ``sys.stderr``: fleetroll's at ``level``, others at debug."""

    def __init__(self, level: int) -> None:
        super().__init__(logging.DEBUG)
        self.fleetroll_level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if _ours(record):
            return record.levelno >= self.fleetroll_level
        return self.fleetroll_level <= logging.DEBUG

    def format(self, record: logging.LogRecord) -> str:
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


def configure_console_logging(level: str = "info") -> None:
    """Route stdlib logging to the console, as the command line wants it (module docstring).

    Replaces the handler a previous call installed; other handlers are left
    alone. Libraries' records below warning are not even created unless
    ``level`` is ``debug``.

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
    root.addHandler(_ConsoleLogHandler(threshold))
    root.setLevel(logging.DEBUG if threshold <= logging.DEBUG else logging.WARNING)
    logging.getLogger("fleetroll").setLevel(threshold)

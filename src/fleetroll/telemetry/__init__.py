"""Telemetry: rollout lifecycle events (docs/telemetry.md) and where they go.

- :mod:`~fleetroll.telemetry.events`: the one API that emits events;
- :mod:`~fleetroll.telemetry.session`: set-up at the entry point
  (:func:`open_telemetry`): Logfire, the local store, the console;
- :mod:`~fleetroll.telemetry.store`: the SQLite ``records`` table, Logfire's columns;
- :mod:`~fleetroll.telemetry.queries`: SQL over the store (``query``, ``stats``, ``check``).

``Telemetry`` and ``open_telemetry`` are imported on first use: code that only
emits events does not pay for importing Logfire.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fleetroll.telemetry.events import Event, Events, EventSink, MemorySink, Redactor

if TYPE_CHECKING:
    from fleetroll.telemetry.session import Telemetry, open_telemetry

__all__ = ["Event", "EventSink", "Events", "MemorySink", "Redactor", "Telemetry", "open_telemetry"]


def __getattr__(name: str) -> Any:
    if name in ("Telemetry", "open_telemetry"):
        from fleetroll.telemetry import session

        return getattr(session, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Emitting events: one small API, base attributes from context variables.

Code that knows a rollout binds its base attributes once
(``with events.bind(rollout_id=..., task_key=...)``); every event emitted
inside carries them. Emitting is synchronous and cheap, so it needs no
shielding: a cancelled rollout still gets its ``fleet_rollout_completed``.
A failing sink is logged and skipped; it never breaks a rollout.
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, Protocol

__all__ = ["BASE_ATTRIBUTES", "Event", "EventSink", "Events", "MemorySink", "Redactor"]

Level = Literal["debug", "info", "warn", "error"]

#: Attributes every rollout event carries (``instance_id`` once known).
BASE_ATTRIBUTES = (
    "batch_id",
    "rollout_id",
    "task_key",
    "sample_index",
    "env_key",
    "env_version",
    "modality",
    "instance_id",
)

_base: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "fleetroll_event_base", default=MappingProxyType({})
)
_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Event:
    name: str
    level: Level
    attributes: Mapping[str, Any]
    timestamp: float = field(default_factory=time.time)


class EventSink(Protocol):
    def emit(self, event: Event) -> None:
        """Record one event. Must not block the event loop."""
        ...


class MemorySink:
    """Keeps events in a list: for tests, and for in-process inspection."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def named(self, name: str) -> list[Event]:
        return [e for e in self.events if e.name == name]


class Redactor:
    """Replaces secrets (and bearer tokens) in string attributes."""

    _BEARER = re.compile(r"(?i)(bearer\s+)[^\s'\"]+")

    def __init__(self, secrets: Iterable[str | None] = ()) -> None:
        self._secrets = sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "[REDACTED]")
        return self._BEARER.sub(r"\1[REDACTED]", text)


class Events:
    """The one way fleetroll emits telemetry events."""

    def __init__(self, sinks: Sequence[EventSink] = (), redactor: Redactor | None = None) -> None:
        self._sinks = list(sinks)
        self._redact = redactor or Redactor()

    def add_sink(self, sink: EventSink) -> None:
        self._sinks.append(sink)

    @staticmethod
    @contextmanager
    def bind(**attributes: Any) -> Iterator[None]:
        """Add base attributes to every event emitted in this context."""
        token = _base.set({**_base.get(), **attributes})
        try:
            yield
        finally:
            _base.reset(token)

    @staticmethod
    def bound() -> Mapping[str, Any]:
        return _base.get()

    def emit(self, name: str, *, level: Level = "info", **attributes: Any) -> Event:
        attrs = {**_base.get(), **attributes}
        for key, value in attrs.items():
            if isinstance(value, str):
                attrs[key] = self._redact(value)
        event = Event(name, level, attrs)
        for sink in self._sinks:
            try:
                sink.emit(event)
            except Exception:  # a broken sink must not break a rollout
                _log.exception("telemetry sink %r failed on %s", sink, name)
        return event

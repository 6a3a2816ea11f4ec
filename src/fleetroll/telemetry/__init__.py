"""Telemetry: rollout lifecycle events (DESIGN.md §8) and where they go."""

from fleetroll.telemetry.events import Event, Events, EventSink, MemorySink, Redactor

__all__ = ["Event", "EventSink", "Events", "MemorySink", "Redactor"]

"""What the Ray actors of :mod:`fleetroll.pool.ray.executor` share: loading Ray, the
buffer of an actor's telemetry (events stamped with its ``worker`` index),
holder names in the cluster's admission, and the default actor count.

The actors themselves: :class:`~fleetroll.pool.ray.admission.AdmissionHost` (the
limiter: the cluster's one admission controller, which every actor uses
through a :class:`~fleetroll.pool.ray.admission.RemoteAdmission`) and
:class:`~fleetroll.pool.ray.executor.ExecutorWorker` (single rollouts on a
LocalExecutor).
"""

from __future__ import annotations

import os
from typing import Any

import anyio

from fleetroll.errors import ConfigError
from fleetroll.telemetry.events import Event

__all__ = ["default_num_actors", "holder", "load_ray"]


def load_ray() -> Any:
    """The ``ray`` module.

    Raises:
        ConfigError: Ray is not installed.
    """
    try:
        import ray
    except ImportError:
        raise ConfigError("Ray is not installed: pip install 'fleetroll[ray]'") from None
    return ray


class _Buffer:
    """An actor's telemetry events, waiting for the driver to take them."""

    def __init__(self, worker: int) -> None:
        self.worker = worker
        self.events: list[Event] = []
        self.changed = anyio.Event()

    def emit(self, event: Event) -> None:  # an EventSink
        # Stamped here, in the actor's process: which actor ran what.
        attributes = {**event.attributes, "worker": self.worker}
        self.events.append(Event(event.name, event.level, attributes, event.timestamp))
        self.changed.set()


def holder(index: int) -> str:
    """The name the limiter knows an actor by."""
    return f"worker-{index}"


def default_num_actors() -> int:
    """One actor per CPU this process may use: the default on one machine.

    Each actor is a process with its own event loop: more actors than cores
    only add start-up and contention (benchmarks/RESULTS.md, "Ray against one
    process").
    """
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)

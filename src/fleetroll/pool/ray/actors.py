"""What the Ray actors of :mod:`fleetroll.pool.ray.executor` share: loading Ray, the
buffer of an actor's telemetry (events stamped with its ``worker`` index), the
policies an actor makes from their recipes, holder names in the cluster's
admission, and the default actor count.

The actors themselves: :class:`~fleetroll.pool.ray.admission.AdmissionHost` (the
limiter: the cluster's one admission controller, which every actor uses
through a :class:`~fleetroll.pool.ray.admission.RemoteAdmission`) and
:class:`~fleetroll.pool.ray.executor.ExecutorWorker` (single rollouts on a
LocalExecutor).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

from fleetroll.errors import ConfigError
from fleetroll.policies.openai import OpenAIChatPolicy, PolicyRecipe
from fleetroll.telemetry.events import Event

__all__ = ["PolicyHost", "default_num_actors", "holder", "load_ray"]

#: Closing a policy (its HTTP client): bounded, shielded. Not a setting: closing
#: a client does no I/O worth waiting for longer.
_CLOSE_S = 5.0


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


class PolicyHost:
    """The policies of one actor, made from their recipes (a policy travels to the
    actors as its settings, :class:`~fleetroll.policies.openai.PolicyRecipe`).

    One policy per recipe in the process, shared by its rollouts (one HTTP client,
    one view of its servers' health), made at the first rollout that uses it.
    A policy no rollout uses is closed once another recipe arrives (a service
    makes one per batch), and every policy at the actor's end (:meth:`aclose`).
    """

    def __init__(self) -> None:
        #: Per recipe key: its policy, and the rollouts using it now.
        self._policies: dict[str, tuple[OpenAIChatPolicy, int]] = {}

    @asynccontextmanager
    async def policy(self, recipe: PolicyRecipe) -> AsyncIterator[OpenAIChatPolicy]:
        """The policy ``recipe`` makes (the same one for the same key)."""
        made, users = self._policies.get(recipe.key, (None, 0))
        if made is None:
            made = recipe.make()
            idle = [k for k, (_, n) in self._policies.items() if n == 0]
            self._policies[recipe.key] = (made, 1)
            await self._close(idle)
        else:
            self._policies[recipe.key] = (made, users + 1)
        try:
            yield made
        finally:
            entry = self._policies.get(recipe.key)
            if entry is not None and entry[0] is made:  # not closed by the actor's end
                self._policies[recipe.key] = (made, entry[1] - 1)

    async def aclose(self) -> None:
        """Close every policy (the actor ends)."""
        await self._close(list(self._policies))

    async def _close(self, keys: list[str]) -> None:
        closing = [self._policies.pop(key)[0] for key in keys]
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_S):
            for policy in closing:
                await policy.aclose()


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

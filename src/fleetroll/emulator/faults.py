"""Fault injection for the emulator: drawing what goes wrong, and when.

A :class:`~fleetroll.settings.fault_profiles.FaultProfile` is plain data (from
``[emulator.profiles.NAME]`` in a TOML file, or built in a test); a
:class:`FaultInjector` turns it into decisions with one seeded RNG, so a run
with the same seed and the same order of requests injects the same faults.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Literal

import anyio

from fleetroll.settings.fault_profiles import FaultProfile

if TYPE_CHECKING:
    from starlette.requests import Request

__all__ = ["CreateOutcome", "FaultInjector", "hang"]

CreateOutcome = Literal["ok", "5xx", "429", "instance_limit", "hang"]


class FaultInjector:
    """Draws fault decisions for one emulator from its profile's seeded RNG."""

    def __init__(self, profile: FaultProfile) -> None:
        self.profile = profile
        self._rng = random.Random(profile.seed)

    def chance(self, p: float) -> bool:
        return p > 0.0 and self._rng.random() < p

    def create_outcome(self, running: int) -> CreateOutcome:
        p = self.profile
        if p.instance_limit is not None and running >= p.instance_limit:
            return "instance_limit"
        if self.chance(p.p_create_hang):
            return "hang"
        if self.chance(p.p_create_429):
            return "429"
        if self.chance(p.p_create_5xx):
            return "5xx"
        return "ok"

    def server_error_status(self) -> int:
        return self._rng.choice((500, 502, 503))

    def create_latency(self) -> float:
        return self.profile.create_latency.draw(self._rng)

    def tool_latency(self) -> float:
        return self.profile.tool_latency.draw(self._rng)

    def death_after(self) -> float | None:
        """Seconds after creation at which a new instance dies, or None."""
        if self.chance(self.profile.p_instance_death):
            return self.profile.death_after.draw(self._rng)
        return None


async def hang(request: Request | None, seconds: float) -> bool:
    """Wait ``seconds``, or until the client that sent ``request`` goes away (True).

    Waits on the connection itself (its next ASGI message is the disconnect),
    not by polling: a poll every 0.25 s cost each 5 s create 20 wake-ups. The
    MCP servers answer JSON (``json_response``), so no task of the SDK watches
    for a client leaving either: without this, a hung call the client gave up
    on would stay in the emulator for all of ``seconds``.
    """
    with anyio.move_on_after(seconds):
        if request is None:
            await anyio.sleep(seconds)
            return False
        while (await request.receive())["type"] != "http.disconnect":
            pass
        return True
    return False

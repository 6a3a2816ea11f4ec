"""The ideal makespan of a scenario: its injected latencies and limits, nothing else.

A rollout's critical path, with every operation the emulator does not delay
counted as free (reset, MCP handshake, tool discovery, verification, release)::

    path   = create + warmup + acting
    acting = (steps + 1) * think + steps * tool

The scripted policy thinks once per step and once more for the turn that ends
the episode ("done"), hence ``steps + 1``. ``warmup`` is the profile's
``mcp_warmup_s`` (an instance's MCP endpoint answers 503 that long after its
create). A latency drawn from a range counts at its midpoint.

With ``N`` rollouts, ``C`` acting at once and provisioning that keeps up (the
pool creates instances for waiting rollouts while others act: up to ``C + K``
instances, ``K`` creates in flight)::

    ideal = create + ceil(N / C) * (warmup + acting)

:func:`ideal_makespan` computes the exact value for the pool's FIFO schedule
by a small event simulation, which also covers provisioning that does not keep
up: ``K`` creates in flight, ``R`` creates a second (a token bucket with a
burst of ``K``, as :class:`fleetroll.environments.fleet.provider.TokenBucket`) and the
emulator's own create queue (one create starts every ``create_queue_interval_s``).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from fleetroll.settings.fault_profiles import FaultProfile, Latency

__all__ = ["IdealModel", "ideal_makespan", "midpoint"]


def midpoint(latency: Latency) -> float:
    """A latency's mean: the midpoint of its range."""
    high = latency.min_s if latency.max_s is None else max(latency.max_s, latency.min_s)
    return (latency.min_s + high) / 2


@dataclass(frozen=True, slots=True)
class IdealModel:
    """The inputs of the ideal makespan, in seconds and counts."""

    rollouts: int
    concurrency: int
    max_creates: int
    creates_per_second: float
    create_s: float
    queue_interval_s: float
    warmup_s: float
    acting_s: float

    @classmethod
    def of(
        cls,
        profile: FaultProfile,
        *,
        rollouts: int,
        concurrency: int,
        max_creates: int,
        creates_per_second: float,
        steps: int,
        think_s: float,
    ) -> IdealModel:
        return cls(
            rollouts=rollouts,
            concurrency=concurrency,
            max_creates=max_creates,
            creates_per_second=creates_per_second,
            create_s=midpoint(profile.create_latency),
            queue_interval_s=profile.create_queue_interval_s,
            warmup_s=profile.mcp_warmup_s,
            acting_s=(steps + 1) * think_s + steps * midpoint(profile.tool_latency),
        )

    @property
    def path_s(self) -> float:
        """One rollout's critical path, alone on the platform."""
        return self.create_s + self.warmup_s + self.acting_s

    @property
    def closed_form_s(self) -> float:
        """``create + ceil(N / C) * (warmup + acting)``: exact when provisioning keeps up."""
        waves = math.ceil(self.rollouts / self.concurrency)
        return self.create_s + waves * (self.warmup_s + self.acting_s)


class _Bucket:
    """The provider's token bucket, on simulated time."""

    def __init__(self, rate: float, burst: int) -> None:
        self._rate = rate
        self._tokens = float(max(1, burst))
        self._burst = float(max(1, burst))
        self._now = 0.0

    def take(self, at: float) -> float:
        at = max(at, self._now)
        self._tokens = min(self._burst, self._tokens + (at - self._now) * self._rate)
        self._now = at
        if self._tokens < 1.0:
            at += (1.0 - self._tokens) / self._rate
            self._now = at
            self._tokens = 1.0
        self._tokens -= 1.0
        return at


def ideal_makespan(model: IdealModel) -> float:
    """The makespan of the pool's FIFO schedule with zero overhead.

    Rollouts take an instance slot (``C + K``), a create slot (``K``) and a
    rate token, wait out the emulator's create queue and the create latency,
    then an acting slot (``C``), and hold both slots until they end. With
    identical rollouts every stage's start times are non-decreasing, so one
    pass in order is exact.
    """
    m = model
    if m.rollouts <= 0:
        return 0.0
    instance_free = [0.0] * (m.concurrency + m.max_creates)
    create_free = [0.0] * m.max_creates
    acting_free = [0.0] * m.concurrency
    bucket = _Bucket(m.creates_per_second, m.max_creates)
    next_queue_slot = 0.0
    makespan = 0.0
    for _ in range(m.rollouts):
        start = max(heapq.heappop(instance_free), heapq.heappop(create_free))
        start = bucket.take(start)
        if m.queue_interval_s:
            start = max(start, next_queue_slot)
            next_queue_slot = start + m.queue_interval_s
        ready = start + m.create_s
        heapq.heappush(create_free, ready)
        acting = max(ready, heapq.heappop(acting_free))
        end = acting + m.warmup_s + m.acting_s
        heapq.heappush(acting_free, end)
        heapq.heappush(instance_free, end)
        makespan = max(makespan, end)
    return makespan

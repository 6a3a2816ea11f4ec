"""The admission controller: which instance may be created, and when.

One :class:`AdmissionController` per pool (on Ray, one for the whole cluster,
in the limiter actor: :mod:`fleetroll.pool.ray.admission`) decides, in one place:

* **creates**: how many create requests at once and how many a second, learnt
  from the provider's answers: :class:`~fleetroll.environments.admission.creates.CreateSlots`;
* **instances**: provisioned and not released yet, those still starting
  counted too (``admission.max_instances``), and per environment
  (``[admission.env."ledger:v1"]``);
* **the provider's account instance limit** (Fleet's): told by the provider
  (:meth:`AdmissionController.learn_account`, from ``account()`` and every 403
  ``instance_limit_exceeded``); a create refused so gives its place back and
  queues again until an instance is released (:meth:`AdmissionController.limit_reached`),
  within the provisioning budget, instead of failing its rollout;
* **a circuit breaker per environment version**: when the share of
  infrastructure failures of its last ``breaker.window`` rollouts reaches
  ``breaker.failure_share``, new rollouts of it wait (or end at once as
  ``env_unavailable``) while one probe rollout at a time tests recovery:
  :class:`~fleetroll.environments.admission.breakers.Breakers`.

It knows no provider: the provider reads its own answers into these signals
(Fleet's: :mod:`fleetroll.environments.fleet.admission`). What pools, providers
and rollouts ask of it is :class:`Admission`, which the controller and its Ray
proxy (:class:`fleetroll.pool.ray.admission.RemoteAdmission`) both implement.

Waiters are woken by a broadcast :class:`anyio.Event`, replaced on each
change; the counts are only ever changed on the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Protocol

import anyio

from fleetroll.environments.admission.breakers import Breakers
from fleetroll.environments.admission.creates import CreateLimits, CreateSlots, ReadFailure
from fleetroll.results import FailureReason
from fleetroll.settings import AdmissionSettings, EnvAdmissionSettings
from fleetroll.telemetry.events import Events

__all__ = [
    "Admission",
    "AdmissionController",
    "AdmissionState",
    "Ticket",
]


@dataclass(eq=False, slots=True)
class Ticket:
    """One instance's place: taken before its create, given back at its release."""

    env: str
    probe: bool = False
    running: bool = False
    released: bool = False


@dataclass(frozen=True, slots=True)
class AdmissionState:
    """What ``/metrics`` shows of admission (gauges)."""

    #: The instance cap in force (``admission.max_instances`` or the account's
    #: limit, whichever is lower); None: none.
    limit: int | None
    in_use: int
    starting: int
    queued: int
    open_breakers: int
    #: The create gate (:class:`CreateSlots`): its rate now, its in-flight limit
    #: now, the creates in flight.
    creates_per_second: float = 0.0
    creates_in_flight_limit: int = 0
    creates_in_flight: int = 0


class Admission(Protocol):
    """What a pool's provider and rollouts ask of admission: an
    :class:`AdmissionController` in this process, or the proxy of a Ray
    cluster's one (:class:`fleetroll.pool.ray.admission.RemoteAdmission`)."""

    @property
    def adaptive(self) -> bool:
        """The gate answers 429s (waits, slows down): they are no attempt's failure."""
        ...

    def slot(self, read: ReadFailure) -> AbstractAsyncContextManager[None]:
        """A create slot (concurrency and rate), learning from the create's answer
        (an error as the provider's ``read`` says)."""
        ...

    async def acquire(self, env: str, *, again: Ticket | None = None) -> Ticket:
        """A place for one instance of ``env`` (``key:version``); waits for room.

        Raises:
            EnvUnavailableError: the environment's breaker is open and
                ``admission.breaker.on_open`` is ``"fail"``.
        """
        ...

    def started(self, ticket: Ticket) -> None:
        """The ticket's instance is running (no longer starting)."""

    def release(self, ticket: Ticket) -> None:
        """Give the ticket's place back (idempotent)."""

    async def limit_reached(
        self, ticket: Ticket, instance_limit: int | None, running: int | None
    ) -> None:
        """The provider refused a create for its account's instance limit (Fleet's
        403): learn the limit, queue again with the same ticket.

        Raises:
            EnvUnavailableError: as :meth:`acquire`.
        """
        ...

    def learn_account(self, instance_limit: int | None, instance_count: int | None) -> None:
        """The provider's account limit (Fleet's ``account()`` or a 403's body)."""

    def record(self, env: str, reason: FailureReason | None) -> None:
        """One rollout of ``env`` ended with ``reason`` (None: completed)."""

    def state(self) -> AdmissionState:
        """The gauges of ``/metrics``."""
        ...


@dataclass(slots=True)
class _Counts:
    total: int = 0
    by_env: dict[str, int] = field(default_factory=dict)


class AdmissionController:
    """Admission of creates and instances for one pool (see the module's docstring).

    Args:
        settings: ``[admission]``: the instance caps and the breakers.
        limits: the create gate's (``CreateLimits.from_settings(settings.provisioning)``).
        events: where the create rate's and the breakers' events go.
        clock: the breakers' and the account count's (monotonic seconds).
    """

    def __init__(
        self,
        settings: AdmissionSettings,
        limits: CreateLimits,
        events: Events,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._clock = clock
        #: The create gate (concurrency and rate).
        self.creates = CreateSlots(limits, events)
        #: A circuit breaker per environment version.
        self.breakers = Breakers(settings.breaker, events, clock=clock)
        self._account_limit: int | None = None
        #: Instances of other clients on the account, as last seen (a 403, account()).
        self._others = 0
        self._others_seen = 0.0
        self._held = _Counts()
        self._running = 0
        self._queued = 0
        self._changed = anyio.Event()
        self.creates.cap(self.limit)

    # -- creates ------------------------------------------------------------

    @property
    def adaptive(self) -> bool:
        return self.creates.adaptive

    def slot(self, read: ReadFailure) -> AbstractAsyncContextManager[None]:
        """A create slot (concurrency and rate): a ``CreateGate``."""
        return self.creates.slot(read)

    # -- instances ----------------------------------------------------------

    @property
    def limit(self) -> int | None:
        account = None
        if self._account_limit is not None:
            account = max(0, self._account_limit - self._others)
        caps = [c for c in (self._settings.max_instances, account) if c is not None]
        return min(caps) if caps else None

    def learn_account(self, instance_limit: int | None, instance_count: int | None) -> None:
        """The provider's account limit (Fleet's ``account()`` or a 403's body);
        instances of others count.

        A limit below 0 or None means none. The provider's count is taken to include
        our instances still starting: if it does not, the cap comes out too
        high and the next 403 corrects it, never too low for good.
        """
        if instance_limit is None or instance_limit < 0:
            self._account_limit, self._others = None, 0
        else:
            self._account_limit = instance_limit
            self._others = max(0, (instance_count or 0) - self._held.total)
            self._others_seen = self._clock()
        self.creates.cap(self.limit)
        self._wake()

    def _others_recheck(self) -> float | None:
        """Seconds until other clients' instances are presumed gone (None: none seen).

        They are released without our knowing: after ``admission.limit_recheck_s``
        a create is tried again (a 403 teaches the count anew).
        """
        if not self._others:
            return None
        due = self._others_seen + self._settings.limit_recheck_s - self._clock()
        if due <= 0:
            self._others = 0
            self.creates.cap(self.limit)
            return None
        return due

    async def acquire(self, env: str, *, again: Ticket | None = None) -> Ticket:
        """A place for one instance of ``env`` (``key:version``); waits for room.

        ``again``: a released ticket to admit anew (the same object is returned).

        Raises:
            EnvUnavailableError: the environment's breaker is open and
                ``admission.breaker.on_open`` is ``"fail"``.
        """
        self._queued += 1
        try:
            while True:
                verdict = self._admissible(env, again)
                if isinstance(verdict, Ticket):
                    return verdict
                changed = self._changed
                if verdict is None:
                    await changed.wait()
                else:  # a probe, or a recheck of the account's count, is due then
                    with anyio.move_on_after(verdict):
                        await changed.wait()
        finally:
            self._queued -= 1

    def _admissible(self, env: str, again: Ticket | None) -> Ticket | float | None:
        """A ticket, or None to wait for a change, or seconds to wait at most."""
        wait = self.breakers.wait_s(env)
        if wait is None or wait > 0:
            return wait
        probe = self.breakers.is_open(env)  # and its probe is due
        recheck = self._others_recheck()
        limit = self.limit
        if limit is not None and self._held.total >= limit:
            return recheck
        env_cap = self._env_settings(env).max_instances
        if env_cap is not None and self._held.by_env.get(env, 0) >= env_cap:
            return None
        if probe:
            self.breakers.probing(env)
        self._held.total += 1
        self._held.by_env[env] = self._held.by_env.get(env, 0) + 1
        if again is None:
            return Ticket(env, probe=probe)
        again.probe, again.running, again.released = probe, False, False
        return again

    def _env_settings(self, env: str) -> EnvAdmissionSettings:
        table = self._settings.env
        found = table.get(env) or table.get(env.partition(":")[0])
        return found or _NO_ENV_LIMITS

    def started(self, ticket: Ticket) -> None:
        """The ticket's instance is running (no longer starting)."""
        if not ticket.running and not ticket.released:
            ticket.running = True
            self._running += 1

    def release(self, ticket: Ticket) -> None:
        """Give the ticket's place back (idempotent)."""
        if ticket.released:
            return
        ticket.released = True
        if ticket.running:
            self._running -= 1
        self._held.total -= 1
        self._held.by_env[ticket.env] -= 1
        if ticket.probe:
            self.breakers.probe_released(ticket.env)
        self._wake()

    async def limit_reached(
        self, ticket: Ticket, instance_limit: int | None, running: int | None
    ) -> None:
        """The provider refused a create for its account's instance limit
        (Fleet's 403 ``instance_limit_exceeded``): learn the limit, give the
        ticket's place back and queue again for one (the same ticket is
        admitted anew; if this is cancelled, it stays released).
        """
        self.release(ticket)
        if instance_limit is not None:
            self.learn_account(instance_limit, running)
        if self.limit is None or self._held.total < self.limit:
            # The provider's count does not explain the refusal: do not ask again
            # at once, but after a release or admission.limit_recheck_s.
            changed = self._changed
            with anyio.move_on_after(self._settings.limit_recheck_s):
                await changed.wait()
        await self.acquire(ticket.env, again=ticket)

    # -- circuit breaker ----------------------------------------------------

    def record(self, env: str, reason: FailureReason | None) -> None:
        """One rollout of ``env`` ended with ``reason`` (None: completed)."""
        if self.breakers.record(env, reason):
            self._wake()  # its breaker closed: its rollouts waiting may go

    def quarantined(self) -> list[str]:
        """Environment versions whose breaker is open."""
        return self.breakers.quarantined()

    # -- state --------------------------------------------------------------

    def state(self) -> AdmissionState:
        creates = self.creates.state()
        return AdmissionState(
            limit=self.limit,
            in_use=self._held.total,
            starting=self._held.total - self._running,
            queued=self._queued,
            open_breakers=len(self.quarantined()),
            creates_per_second=creates.per_second,
            creates_in_flight_limit=creates.in_flight_limit,
            creates_in_flight=creates.in_flight,
        )

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


_NO_ENV_LIMITS = EnvAdmissionSettings()

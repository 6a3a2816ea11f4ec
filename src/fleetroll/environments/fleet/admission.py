"""Admission control: which instance may be created, and when.

One :class:`AdmissionController` per pool (on Ray, one for the whole cluster,
in the limiter actor: :mod:`fleetroll.pool.ray.admission`) decides, in one place:

* **creates**: at most ``provisioning.max_concurrent_creates`` create
  requests at once and ``provisioning.creates_per_second`` (a token bucket):
  :class:`CreateSlots`;
* **instances**: provisioned and not released yet, those still starting
  counted too (``admission.max_instances``), and per environment
  (``[admission.env."ledger:v1"]``);
* **Fleet's account instance limit**: read at start (``account()``) and from
  every 403 ``instance_limit_exceeded``; a create refused so gives its place
  back and queues again until an instance is released, within the
  provisioning budget, instead of failing its rollout;
* **a circuit breaker per environment version**: when the share of
  infrastructure failures of its last ``breaker.window`` rollouts reaches
  ``breaker.failure_share``, new rollouts of it wait (or end at once as
  ``env_unavailable``) while one probe rollout at a time tests recovery.

What pools, providers and rollouts ask of it is :class:`Admission`, which the
controller and its Ray proxy (:class:`fleetroll.pool.ray.admission.RemoteAdmission`)
both implement.

Waiters are woken by a broadcast :class:`anyio.Event`, replaced on each
change; the counts are only ever changed on the event loop.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from fleetroll.errors import EnvUnavailableError
from fleetroll.results import FailureReason
from fleetroll.settings import EnvAdmissionSettings, Settings
from fleetroll.telemetry.events import Events

__all__ = [
    "INFRASTRUCTURE_FAILURES",
    "Admission",
    "AdmissionController",
    "AdmissionState",
    "CreateSlots",
    "Ticket",
    "TokenBucket",
]

#: Failures that say the environment, not the agent, went wrong (the breaker's input).
INFRASTRUCTURE_FAILURES = frozenset(
    {
        FailureReason.INIT_ERROR,
        FailureReason.TOOLS_ERROR,
        FailureReason.INSTANCE_LOST,
        FailureReason.VERIFIER_ERROR,
        FailureReason.RESET_FAILED,
    }
)
#: Ends that say nothing of the environment's health: not counted in the window.
_NO_VERDICT = frozenset(
    {FailureReason.CANCELLED, FailureReason.SUPERSEDED, FailureReason.ENV_UNAVAILABLE}
)


class TokenBucket:
    """An async rate limiter: ``rate`` tokens a second, bursts up to ``burst``."""

    def __init__(self, rate: float, burst: int = 1) -> None:
        self._rate = rate
        self._burst = float(max(1, burst))
        self._tokens = self._burst
        self._updated = time.monotonic()
        self._lock = anyio.Lock()

    async def acquire(self) -> None:
        async with self._lock:
            now = time.monotonic()
            self._tokens = min(self._burst, self._tokens + (now - self._updated) * self._rate)
            self._updated = now
            if self._tokens < 1.0:
                await anyio.sleep((1.0 - self._tokens) / self._rate)
                self._updated = time.monotonic()
                self._tokens = 1.0
            self._tokens -= 1.0


class CreateSlots:
    """Create requests in flight (a limiter) and their rate (a token bucket).

    Built lazily on the loop that first uses it (a Ray actor's, or the pool's).
    """

    def __init__(self, max_concurrent: int, per_second: float) -> None:
        self.max_concurrent = max_concurrent
        self.per_second = per_second
        self._slots: anyio.CapacityLimiter | None = None
        self._rate: TokenBucket | None = None

    def _made(self) -> tuple[anyio.CapacityLimiter, TokenBucket]:
        if self._slots is None or self._rate is None:
            self._slots = anyio.CapacityLimiter(self.max_concurrent)
            self._rate = TokenBucket(self.per_second, burst=self.max_concurrent)
        return self._slots, self._rate

    @property
    def in_use(self) -> int:
        return 0 if self._slots is None else int(self._slots.borrowed_tokens)

    async def acquire(self, borrower: object) -> None:
        """Take a slot for ``borrower`` (then wait for the rate); give it back with release."""
        slots, rate = self._made()
        await slots.acquire_on_behalf_of(borrower)
        try:
            await rate.acquire()
        except BaseException:  # cancelled while waiting for the rate: give the slot back
            slots.release_on_behalf_of(borrower)
            raise

    def release(self, borrower: object) -> None:
        slots, _ = self._made()
        slots.release_on_behalf_of(borrower)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Held for the duration of one create request (a ``CreateGate``)."""
        token = object()
        await self.acquire(token)
        try:
            yield
        finally:
            self.release(token)


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


class Admission(Protocol):
    """What a pool's provider and rollouts ask of admission: an
    :class:`AdmissionController` in this process, or the proxy of a Ray
    cluster's one (:class:`fleetroll.pool.ray.admission.RemoteAdmission`)."""

    def slot(self) -> AbstractAsyncContextManager[None]:
        """A create slot (concurrency and rate): a ``CreateGate``."""
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
        """Fleet refused a create (403): learn its limit, queue again with the same ticket.

        Raises:
            EnvUnavailableError: as :meth:`acquire`.
        """
        ...

    def learn_account(self, instance_limit: int | None, instance_count: int | None) -> None:
        """Fleet's account limit (``account()`` or a 403's body)."""

    def record(self, env: str, reason: FailureReason | None) -> None:
        """One rollout of ``env`` ended with ``reason`` (None: completed)."""

    def state(self) -> AdmissionState:
        """The gauges of ``/metrics``."""
        ...


@dataclass(slots=True)
class _Breaker:
    outcomes: deque[bool]  # True: an infrastructure failure
    open: bool = False
    next_probe: float = 0.0
    probing: bool = False


@dataclass(slots=True)
class _Counts:
    total: int = 0
    by_env: dict[str, int] = field(default_factory=dict)


class AdmissionController:
    """Admission of creates and instances for one pool (see the module's docstring)."""

    def __init__(
        self,
        settings: Settings,
        events: Events,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings.admission
        self._events = events
        self._clock = clock
        p = settings.provisioning
        self.creates = CreateSlots(p.max_concurrent_creates, p.creates_per_second)
        self._account_limit: int | None = None
        #: Instances of other clients on the account, as last seen (a 403, account()).
        self._others = 0
        self._others_seen = 0.0
        self._held = _Counts()
        self._running = 0
        self._queued = 0
        self._breakers: dict[str, _Breaker] = {}
        self._changed = anyio.Event()

    # -- creates ------------------------------------------------------------

    def slot(self) -> AbstractAsyncContextManager[None]:
        """A create slot (concurrency and rate): a ``CreateGate``."""
        return self.creates.slot()

    # -- instances ----------------------------------------------------------

    @property
    def limit(self) -> int | None:
        account = None
        if self._account_limit is not None:
            account = max(0, self._account_limit - self._others)
        caps = [c for c in (self._settings.max_instances, account) if c is not None]
        return min(caps) if caps else None

    def learn_account(self, instance_limit: int | None, instance_count: int | None) -> None:
        """Fleet's account limit (``account()`` or a 403's body); instances of others count.

        A limit below 0 or None means none. Fleet's count is taken to include
        our instances still starting: if it does not, the cap comes out too
        high and the next 403 corrects it, never too low for good.
        """
        if instance_limit is None or instance_limit < 0:
            self._account_limit, self._others = None, 0
        else:
            self._account_limit = instance_limit
            self._others = max(0, (instance_count or 0) - self._held.total)
            self._others_seen = self._clock()
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
        probe = False
        breaker = self._breakers.get(env)
        if breaker is not None and breaker.open:
            due = breaker.next_probe - self._clock()
            if breaker.probing or due > 0:
                if self._settings.breaker.on_open == "fail":
                    raise EnvUnavailableError(
                        f"environment {env} is quarantined: too many infrastructure "
                        "failures (admission.breaker); a probe rollout tests its recovery",
                        env=env,
                    )
                return None if breaker.probing else max(due, 0.0)
            probe = True
        recheck = self._others_recheck()
        limit = self.limit
        if limit is not None and self._held.total >= limit:
            return recheck
        env_cap = self._env_settings(env).max_instances
        if env_cap is not None and self._held.by_env.get(env, 0) >= env_cap:
            return None
        if probe:
            assert breaker is not None
            breaker.probing = True
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
        breaker = self._breakers.get(ticket.env)
        if ticket.probe and breaker is not None and breaker.open:
            # The next probe, if this one's rollout does not close the breaker.
            breaker.probing = False
            breaker.next_probe = self._clock() + self._settings.breaker.probe_interval_s
        self._wake()

    async def limit_reached(
        self, ticket: Ticket, instance_limit: int | None, running: int | None
    ) -> None:
        """Fleet refused a create (403 ``instance_limit_exceeded``): learn its
        limit, give the ticket's place back and queue again for one (the same
        ticket is admitted anew; if this is cancelled, it stays released).
        """
        self.release(ticket)
        if instance_limit is not None:
            self.learn_account(instance_limit, running)
        if self.limit is None or self._held.total < self.limit:
            # Fleet's count does not explain the refusal: do not ask again at
            # once, but after a release or admission.limit_recheck_s.
            changed = self._changed
            with anyio.move_on_after(self._settings.limit_recheck_s):
                await changed.wait()
        await self.acquire(ticket.env, again=ticket)

    # -- circuit breaker ----------------------------------------------------

    def record(self, env: str, reason: FailureReason | None) -> None:
        """One rollout of ``env`` ended with ``reason`` (None: completed)."""
        b = self._settings.breaker
        if not b.enabled or reason in _NO_VERDICT:
            return
        failed = reason in INFRASTRUCTURE_FAILURES
        breaker = self._breakers.get(env)
        if breaker is None:
            breaker = self._breakers[env] = _Breaker(deque(maxlen=b.window))
        breaker.outcomes.append(failed)
        if breaker.open:
            # A success (the probe's, typically) says it serves again; a
            # failure changes nothing (the probe's release set the next one).
            if not failed:
                breaker.open = breaker.probing = False
                self._events.emit("fleet_env_recovered", **self._attributes(env, breaker))
                breaker.outcomes.clear()
                self._wake()
            return
        if len(breaker.outcomes) >= b.min_rollouts and self._share(breaker) >= b.failure_share:
            breaker.open = True
            breaker.probing = False
            breaker.next_probe = self._clock() + b.probe_interval_s
            self._events.emit(
                "fleet_env_quarantined", level="warn", **self._attributes(env, breaker)
            )

    @staticmethod
    def _share(breaker: _Breaker) -> float:
        n = len(breaker.outcomes)
        return sum(breaker.outcomes) / n if n else 0.0

    def _attributes(self, env: str, breaker: _Breaker) -> dict[str, Any]:
        key, _, version = env.partition(":")
        return {
            "env_key": key,
            "env_version": version or None,
            "failure_share": round(self._share(breaker), 4),
            "window": len(breaker.outcomes),
        }

    def quarantined(self) -> list[str]:
        """Environment versions whose breaker is open."""
        return sorted(env for env, b in self._breakers.items() if b.open)

    # -- state --------------------------------------------------------------

    def state(self) -> AdmissionState:
        return AdmissionState(
            limit=self.limit,
            in_use=self._held.total,
            starting=self._held.total - self._running,
            queued=self._queued,
            open_breakers=len(self.quarantined()),
        )

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


_NO_ENV_LIMITS = EnvAdmissionSettings()

"""Admission control: which instance may be created, and when.

One :class:`AdmissionController` per pool (on Ray, one for the whole cluster,
in the limiter actor: :mod:`fleetroll.pool.ray.admission`) decides, in one place:

* **creates**: how many create requests at once and how many a second
  (a token bucket), learnt from Fleet's answers (faster while it answers
  fast, slower on 429, 503, time-outs and slow answers) under
  ``provisioning.max_concurrent_creates`` and ``provisioning.creates_per_second``:
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

import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import anyio
from fleet._async import exceptions as fleet_errors

from fleetroll.environments.fleet.control import classify
from fleetroll.errors import EnvUnavailableError
from fleetroll.results import FailureReason
from fleetroll.settings import EnvAdmissionSettings, Settings
from fleetroll.telemetry.events import Events

__all__ = [
    "INFRASTRUCTURE_FAILURES",
    "Admission",
    "AdmissionController",
    "AdmissionState",
    "CreateAnswer",
    "CreateLimits",
    "CreateRate",
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
    """An async rate limiter: ``rate`` tokens a second, bursts up to ``burst``.

    Both may change while it is used (the learnt create rate); :meth:`pause`
    holds every token until a moment (a server's ``Retry-After``).
    """

    def __init__(self, rate: float, burst: int = 1) -> None:
        self._rate = rate
        self._burst = float(max(1, burst))
        self._tokens = self._burst
        self._updated = time.monotonic()
        self._paused_until = 0.0
        self._lock = anyio.Lock()

    @property
    def rate(self) -> float:
        return self._rate

    def retune(self, rate: float, burst: int) -> None:
        """A new rate and burst, from now on (tokens already earned are kept, up to the burst)."""
        self._refill(time.monotonic())
        self._rate = rate
        self._burst = float(max(1, burst))
        self._tokens = min(self._tokens, self._burst)

    def pause(self, until: float) -> None:
        """No token before ``until`` (monotonic); later pauses win."""
        self._paused_until = max(self._paused_until, until)

    def _refill(self, now: float) -> None:
        start = max(self._updated, self._paused_until)
        if now > start:
            self._tokens = min(self._burst, self._tokens + (now - start) * self._rate)
        self._updated = max(now, self._updated)

    async def acquire(self) -> None:
        async with self._lock:
            while True:
                now = time.monotonic()
                if now < self._paused_until:
                    await anyio.sleep(self._paused_until - now)
                    continue
                self._refill(now)
                if self._tokens >= 1.0:
                    self._tokens -= 1.0
                    return
                await anyio.sleep((1.0 - self._tokens) / self._rate)


#: Without a start of their own, the learnt rate and in-flight limit start at
#: this fraction of their ceilings (``provisioning.start_*``).
START_SHARE = 4

#: How fast the smoothed share of pressure answers follows each window's (DCTCP's g).
ALPHA_GAIN = 0.5

#: What one create's answer says of Fleet's load (``None``: a fast answer).
Pressure = Literal["throttled", "unavailable", "timeout", "slow"]


@dataclass(frozen=True, slots=True)
class CreateAnswer:
    """How one create request went, as the create gate learns from it."""

    elapsed_s: float
    #: Fleet is under pressure (None: it answered fast).
    pressure: Pressure | None = None
    #: The answer's ``Retry-After``, if it had one.
    retry_after_s: float | None = None
    #: The answer says nothing of Fleet's load (a 400, a 403, a cancelled request).
    neutral: bool = False

    @classmethod
    def of(cls, exc: BaseException | None, elapsed_s: float, *, slow_s: float) -> CreateAnswer:
        """Read a create's outcome: ``exc`` is what it raised (None: it succeeded)."""
        if exc is None:
            return cls(elapsed_s, "slow" if elapsed_s > slow_s else None)
        if not isinstance(exc, Exception):  # cancelled (or a KeyboardInterrupt): no answer
            return cls(elapsed_s, neutral=True)
        verdict = classify(exc)
        status = verdict.status_code
        if isinstance(exc, TimeoutError | fleet_errors.FleetTimeoutError) or status == 504:
            return cls(elapsed_s, "timeout")
        if status == 429:
            return cls(elapsed_s, "throttled", verdict.retry_after_s)
        if status == 503:
            return cls(elapsed_s, "unavailable", verdict.retry_after_s)
        return cls(elapsed_s, neutral=True)


@dataclass(frozen=True, slots=True)
class CreateLimits:
    """The create gate's bounds and its learner's start (``[provisioning]``)."""

    #: Ceilings: ``max_concurrent_creates`` and ``creates_per_second``.
    max_in_flight: int
    max_per_second: float
    #: Learn the rate from Fleet's answers (off: the ceilings are the rate).
    adaptive: bool = False
    start_in_flight: int = 1
    start_per_second: float = 1.0
    min_per_second: float = 0.1
    #: A successful create slower than this is pressure too.
    slow_s: float = math.inf
    #: The pause after a 429 or 503 without ``Retry-After``.
    backoff_s: float = 1.0

    @classmethod
    def from_settings(cls, settings: Settings) -> CreateLimits:
        p = settings.provisioning
        start_in_flight = p.start_concurrent_creates
        start_per_second = p.start_creates_per_second
        return cls(
            max_in_flight=p.max_concurrent_creates,
            max_per_second=p.creates_per_second,
            adaptive=p.adaptive_creates,
            start_in_flight=(
                max(1, p.max_concurrent_creates // START_SHARE)
                if start_in_flight is None
                else start_in_flight
            ),
            start_per_second=(
                p.creates_per_second / START_SHARE if start_per_second is None else start_per_second
            ),
            min_per_second=p.min_creates_per_second,
            slow_s=p.slow_create_s,
            backoff_s=p.backoff_initial_s,
        )


@dataclass(frozen=True, slots=True)
class CreateRate:
    """The create gate now (``/metrics``, the ``fleet_create_rate`` event)."""

    per_second: float
    in_flight_limit: int
    in_flight: int


class CreateSlots:
    """Create requests in flight (a limiter) and their rate (a token bucket),
    learnt from Fleet's answers when ``limits.adaptive``.

    The learner (TCP's congestion control: a slow start, then additive
    increase and a decrease in proportion to the pressure, as DCTCP):

    * answers are counted in windows (the in-flight limit's worth); after a
      window of fast answers only, the rate and the in-flight limit grow:
      doubled until the first pressure (the slow start), then one more create
      per second and one more in flight;
    * pressure is a 429, a 503, a create that timed out, or a success slower
      than ``provisioning.slow_create_s``. The first one halves both at once
      (it ends the slow start); after that, a window with pressure cuts both by
      ``alpha / 2`` (and adds the step for its fast answers' share), alpha
      being the share of pressure answers smoothed over windows: a stray 503
      changes little, a throttled account halves them;
    * a 429's or 503's ``Retry-After`` holds every create until it passed;
    * bounds: ``creates_per_second`` and ``max_concurrent_creates`` above
      (the ceilings), ``min_creates_per_second`` and one in flight below, and
      never more in flight than the instance cap (Fleet's account limit).

    Built lazily on the loop that first uses it (a Ray actor's, or the pool's).
    """

    def __init__(self, limits: CreateLimits, events: Events | None = None) -> None:
        self.limits = limits
        self._events = events
        if limits.adaptive:
            self._rate = min(limits.start_per_second, limits.max_per_second)
            self._window = min(limits.start_in_flight, limits.max_in_flight)
        else:
            self._rate, self._window = limits.max_per_second, limits.max_in_flight
        self._cap: int | None = None
        self._slow_start = True
        #: The window under way: answers, and those that said Fleet is under pressure.
        self._answers = 0
        self._pressured = 0
        #: The share of pressure answers, smoothed over windows (DCTCP's alpha).
        self._alpha = 0.0
        self._last_pressure: CreateAnswer | None = None
        self._paused_until = 0.0  # monotonic: a Retry-After
        self._slots: anyio.CapacityLimiter | None = None
        self._bucket: TokenBucket | None = None

    @property
    def adaptive(self) -> bool:
        """A 429 is the gate's to answer (it waits and slows down), not an attempt's."""
        return self.limits.adaptive

    def _made(self) -> tuple[anyio.CapacityLimiter, TokenBucket]:
        if self._slots is None or self._bucket is None:
            self._slots = anyio.CapacityLimiter(self._in_flight_limit)
            self._bucket = TokenBucket(self._rate, burst=self._in_flight_limit)
            self._bucket.pause(self._paused_until)
        return self._slots, self._bucket

    @property
    def _in_flight_limit(self) -> int:
        return max(1, self._window if self._cap is None else min(self._window, self._cap))

    @property
    def in_use(self) -> int:
        return 0 if self._slots is None else int(self._slots.borrowed_tokens)

    def state(self) -> CreateRate:
        return CreateRate(round(self._rate, 4), self._in_flight_limit, self.in_use)

    def cap(self, instances: int | None) -> None:
        """No more creates in flight than ``instances`` (the instance cap; None: none)."""
        if instances != self._cap:
            self._cap = instances
            self._retune()

    async def acquire(self, borrower: object) -> None:
        """Take a slot for ``borrower`` (then wait for the rate); give it back with release."""
        slots, bucket = self._made()
        await slots.acquire_on_behalf_of(borrower)
        try:
            await bucket.acquire()
        except BaseException:  # cancelled while waiting for the rate: give the slot back
            slots.release_on_behalf_of(borrower)
            raise

    def release(self, borrower: object, answer: CreateAnswer | None = None) -> None:
        """Give ``borrower``'s slot back; ``answer``: what its create learnt."""
        slots, _ = self._made()
        slots.release_on_behalf_of(borrower)
        if answer is not None:
            self.learn(answer)

    def learn(self, answer: CreateAnswer) -> None:
        """One create's answer: pause on ``Retry-After``; with ``adaptive``, retune."""
        limits = self.limits
        if answer.pressure in ("throttled", "unavailable"):
            wait = answer.retry_after_s if answer.retry_after_s is not None else limits.backoff_s
            self._paused_until = max(self._paused_until, time.monotonic() + wait)
            if self._bucket is not None:
                self._bucket.pause(self._paused_until)
        if not limits.adaptive or answer.neutral:
            return
        if answer.pressure is not None and self._slow_start:
            # The first pressure ends the slow start: halved at once, as TCP does.
            self._slow_start = False
            self._alpha = 1.0
            self._change(self._rate / 2, self._window // 2, answer.pressure, answer)
            return
        self._answers += 1
        self._pressured += answer.pressure is not None
        if answer.pressure is not None:
            self._last_pressure = answer
        if self._answers < self._in_flight_limit:
            return
        # A window's worth of answers: DCTCP's rule. The smoothed share of
        # pressure sets the decrease (half when every answer said so), so a
        # few stray 503s shave the rate while a throttled account halves it.
        share = self._pressured / self._answers
        self._alpha += ALPHA_GAIN * (share - self._alpha)
        if self._pressured:
            # Cut, and the window's additive step for its fast answers' share:
            # steady pressure at a share p settles the limits where the cut
            # equals the step (near 2 (1 - p) / p), full pressure halves them.
            cut = 1.0 - self._alpha / 2
            step = 1.0 - share
            self._change(
                self._rate * cut + step,
                int(self._window * cut + step),
                (self._last_pressure and self._last_pressure.pressure) or "timeout",
                self._last_pressure or answer,
            )
        elif self._slow_start:
            self._change(self._rate * 2, self._window * 2, "fast_answers", answer)
        else:
            self._change(self._rate + 1.0, self._window + 1, "fast_answers", answer)

    def _change(self, rate: float, window: int, reason: str, answer: CreateAnswer) -> None:
        limits = self.limits
        rate = min(limits.max_per_second, max(limits.min_per_second, rate))
        window = min(limits.max_in_flight, max(1, window))
        self._answers = self._pressured = 0
        self._last_pressure = None
        if (rate, window) == (self._rate, self._window):
            return
        self._rate, self._window = rate, window
        self._retune()
        if self._events is not None:
            self._events.emit(
                "fleet_create_rate",
                level="info" if answer.pressure is None else "warn",
                creates_per_second=round(rate, 4),
                creates_in_flight_limit=self._in_flight_limit,
                reason=reason,
                retry_after_s=answer.retry_after_s,
                create_s=round(answer.elapsed_s, 4),
            )

    def _retune(self) -> None:
        if self._slots is None or self._bucket is None:
            return
        self._slots.total_tokens = self._in_flight_limit
        self._bucket.retune(self._rate, self._in_flight_limit)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Held for the duration of one create request (a ``CreateGate``); learns
        from how it ends."""
        token = object()
        await self.acquire(token)
        with answered(self.limits.slow_s, lambda answer: self.release(token, answer)):
            yield


@contextmanager
def answered(slow_s: float, done: Callable[[CreateAnswer], None]) -> Iterator[None]:
    """Time the create request in the block and tell ``done`` how it ended (always)."""
    started = time.monotonic()
    raised: BaseException | None = None
    try:
        yield
    except BaseException as exc:  # read, then raised again
        raised = exc
        raise
    finally:
        done(CreateAnswer.of(raised, time.monotonic() - started, slow_s=slow_s))


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

    def slot(self) -> AbstractAsyncContextManager[None]:
        """A create slot (concurrency and rate), learning from the create's answer."""
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
        self.creates = CreateSlots(CreateLimits.from_settings(settings), events)
        self._account_limit: int | None = None
        #: Instances of other clients on the account, as last seen (a 403, account()).
        self._others = 0
        self._others_seen = 0.0
        self._held = _Counts()
        self._running = 0
        self._queued = 0
        self._breakers: dict[str, _Breaker] = {}
        self._changed = anyio.Event()
        self.creates.cap(self.limit)

    # -- creates ------------------------------------------------------------

    @property
    def adaptive(self) -> bool:
        return self.creates.adaptive

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

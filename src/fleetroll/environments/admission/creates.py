"""The create gate: how many create requests at once and how many a second.

:class:`CreateSlots` holds create requests in flight (a limiter) and their rate
(a :class:`TokenBucket`), both learnt from the provider's answers when
``provisioning.adaptive_creates`` is on: faster while it answers fast, slower
on throttling, unavailability, time-outs and slow answers, under
``provisioning.max_concurrent_creates`` and ``provisioning.creates_per_second``.

Nothing here knows a provider: what a failed create says of the provider's load
(a 429, a 503, its ``Retry-After``) is read by the provider, which hands the
gate a :data:`ReadFailure` with each slot (Fleet's:
:func:`fleetroll.environments.fleet.admission.read_create_error`).
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Literal

import anyio

from fleetroll.settings import ProvisioningSettings
from fleetroll.telemetry.events import Events

__all__ = [
    "CreateAnswer",
    "CreateLimits",
    "CreateRate",
    "CreateSlots",
    "ReadFailure",
    "TokenBucket",
    "answered",
]


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

#: What one create's answer says of the provider's load (``None``: a fast answer).
Pressure = Literal["throttled", "unavailable", "timeout", "slow"]


@dataclass(frozen=True, slots=True)
class CreateAnswer:
    """How one create request went, as the create gate learns from it."""

    elapsed_s: float
    #: The provider is under pressure (None: it answered fast).
    pressure: Pressure | None = None
    #: The answer's ``Retry-After``, if it had one.
    retry_after_s: float | None = None
    #: The answer says nothing of the provider's load (a 400, a 403, a cancelled request).
    neutral: bool = False

    @classmethod
    def of(
        cls, exc: BaseException | None, elapsed_s: float, *, slow_s: float, read: ReadFailure
    ) -> CreateAnswer:
        """Read a create's outcome: ``exc`` is what it raised (None: it succeeded),
        an error read by the provider's ``read``."""
        if exc is None:
            return cls(elapsed_s, "slow" if elapsed_s > slow_s else None)
        if not isinstance(exc, Exception):  # cancelled (or a KeyboardInterrupt): no answer
            return cls(elapsed_s, neutral=True)
        return read(exc, elapsed_s)


#: How a provider reads a failed create (the error it raised, the seconds it
#: took) as what it says of the provider's load: Fleet's is
#: :func:`fleetroll.environments.fleet.admission.read_create_error`.
ReadFailure = Callable[[Exception, float], CreateAnswer]


@dataclass(frozen=True, slots=True)
class CreateLimits:
    """The create gate's bounds and its learner's start (``[provisioning]``)."""

    #: Ceilings: ``max_concurrent_creates`` and ``creates_per_second``.
    max_in_flight: int
    max_per_second: float
    #: Learn the rate from the provider's answers (off: the ceilings are the rate).
    adaptive: bool = False
    start_in_flight: int = 1
    start_per_second: float = 1.0
    min_per_second: float = 0.1
    #: A successful create slower than this is pressure too.
    slow_s: float = math.inf
    #: The pause after a 429 or 503 without ``Retry-After``.
    backoff_s: float = 1.0

    @classmethod
    def from_settings(cls, p: ProvisioningSettings) -> CreateLimits:
        """The limits ``[provisioning]`` sets (its ``start_*`` default to a
        :data:`START_SHARE` of the ceilings)."""
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
    learnt from the provider's answers when ``limits.adaptive``.

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
      never more in flight than the instance cap (the provider's account limit).

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
        #: The window under way: answers, and those that said the provider is under pressure.
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
    async def slot(self, read: ReadFailure) -> AsyncIterator[None]:
        """Held for the duration of one create request (a ``CreateGate``); learns
        from how it ends, an error as the provider's ``read`` says."""
        token = object()
        await self.acquire(token)
        with answered(self.limits.slow_s, read, lambda answer: self.release(token, answer)):
            yield


@contextmanager
def answered(
    slow_s: float, read: ReadFailure, done: Callable[[CreateAnswer], None]
) -> Iterator[None]:
    """Time the create request in the block and tell ``done`` how it ended (always),
    an error as ``read`` says."""
    started = time.monotonic()
    raised: BaseException | None = None
    try:
        yield
    except BaseException as exc:  # read, then raised again
        raised = exc
        raise
    finally:
        done(CreateAnswer.of(raised, time.monotonic() - started, slow_s=slow_s, read=read))

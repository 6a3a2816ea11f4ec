"""Admission on Ray: one
:class:`~fleetroll.environments.admission.AdmissionController` for the cluster.

* :class:`AdmissionHost`: the Ray pool's limiter actor (``RayExecutor.limiter``).
  It holds the cluster's one controller: create concurrency and rate, the
  instance caps (starting instances counted), Fleet's account limit and the
  per-environment circuit breakers. Fleet's limits are per account, and a
  broken environment is broken for every actor: one controller sees them all.
  Callers are named by a *holder* (an actor's name, or the driver's); what a
  holder has (instance places, create slots, waits) is given back by
  :meth:`AdmissionHost.release_all` when it dies.
* :class:`RemoteAdmission`: the :class:`~fleetroll.environments.admission.Admission`
  protocol over that actor, for each actor's pools (and the driver's view of
  the state). Calls that only tell the host something (``started``,
  ``release``, ``record``, ``learn_account``) are sent without waiting for an
  answer (Ray runs an actor's calls from one caller in the order they were
  sent); calls that wait for room are bounded by the caller's budget (the
  provisioning budget), and one given up tells the host to give back what it
  may have granted meanwhile.

The breakers' events (``fleet_env_quarantined`` / ``fleet_env_recovered``)
stay in the host until the driver takes them (:meth:`RemoteAdmission.followed`),
which emits each once through the pool's :class:`~fleetroll.telemetry.events.Events`,
as it does the actors' events.

The classes are plain here; the pool makes the host a Ray actor when it opens.
"""

from __future__ import annotations

import itertools
import logging
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio

from fleetroll.environments.admission import (
    AdmissionController,
    AdmissionState,
    CreateAnswer,
    CreateLimits,
    ReadFailure,
    Ticket,
    answered,
)
from fleetroll.errors import EnvUnavailableError, ProvisionError
from fleetroll.results import FailureReason
from fleetroll.settings import Settings
from fleetroll.telemetry.events import Event, Events

__all__ = ["AdmissionHost", "Answer", "RemoteAdmission"]

_log = logging.getLogger(__name__)

#: How long the driver's follow call waits in the host for a breaker event.
#: Not a setting: it is how stale the driver's gauges may get (as the Ray
#: pool's take polls), and nothing a user runs changes that trade.
FOLLOW_WAIT_S = 0.5

_NONE = AdmissionState(limit=None, in_use=0, starting=0, queued=0, open_breakers=0)

_Key = tuple[str, str]  # (holder, request id)


@dataclass(frozen=True, slots=True)
class Answer:
    """The host's answer to a call that waited for room."""

    granted: bool
    probe: bool = False
    #: The breaker's refusal (``EnvUnavailableError``'s message), in fail-fast mode.
    unavailable: str | None = None
    state: AdmissionState | None = None


class _Held:
    """The controller's events, kept until the driver takes them (an EventSink)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.arrived = anyio.Event()

    def emit(self, event: Event) -> None:
        self.events.append(event)
        self.arrived.set()

    def take(self) -> list[Event]:
        events, self.events = self.events, []
        self.arrived = anyio.Event()
        return events


class AdmissionHost:
    """The cluster's admission (see the module's docstring): a Ray actor's class."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._controller: AdmissionController | None = None
        self._held: _Held | None = None
        self._tickets: dict[_Key, Ticket] = {}
        self._slots: set[_Key] = set()
        self._waits: dict[_Key, anyio.CancelScope] = {}
        self._dead: set[str] = set()
        #: Most create slots held at once (tests read it: the limit held cluster-wide).
        self.peak = 0

    @property
    def _admission(self) -> AdmissionController:
        # Made on the actor's event loop, at the first call (anyio's events need one).
        if self._controller is None:
            self._held = _Held()
            self._controller = AdmissionController(
                self._settings.admission,
                CreateLimits.from_settings(self._settings.provisioning),
                Events([self._held]),
            )
        return self._controller

    async def _wait(self, holder: str, rid: str, admit: Callable[[], Awaitable[Ticket]]) -> Answer:
        """Wait for a place, unless the holder is gone or gives up (:meth:`abandon`)."""
        key = (holder, rid)
        if holder in self._dead:
            return Answer(granted=False)
        with anyio.CancelScope() as scope:
            self._waits[key] = scope
            try:
                ticket = await admit()
            except EnvUnavailableError as exc:
                return Answer(granted=False, unavailable=str(exc), state=self._admission.state())
            finally:
                del self._waits[key]
            self._tickets[key] = ticket
            return Answer(granted=True, probe=ticket.probe, state=self._admission.state())
        return Answer(granted=False)  # abandoned while waiting

    async def acquire(self, holder: str, rid: str, env: str) -> Answer:
        return await self._wait(holder, rid, lambda: self._admission.acquire(env))

    async def limit_reached(
        self, holder: str, rid: str, instance_limit: int | None, running: int | None
    ) -> Answer:
        ticket = self._tickets.pop((holder, rid), None)
        if ticket is None:
            return Answer(granted=False)
        if holder in self._dead:
            self._admission.release(ticket)
            return Answer(granted=False)

        async def again() -> Ticket:
            # Releases the ticket first; given up, it stays released.
            await self._admission.limit_reached(ticket, instance_limit, running)
            return ticket

        return await self._wait(holder, rid, again)

    async def started(self, holder: str, rid: str) -> None:
        ticket = self._tickets.get((holder, rid))
        if ticket is not None:
            self._admission.started(ticket)

    async def release(self, holder: str, rid: str) -> None:
        ticket = self._tickets.pop((holder, rid), None)
        if ticket is not None:
            self._admission.release(ticket)

    async def learn_account(self, instance_limit: int | None, instance_count: int | None) -> None:
        self._admission.learn_account(instance_limit, instance_count)

    async def record(self, env: str, reason: FailureReason | None) -> None:
        self._admission.record(env, reason)

    async def acquire_slot(self, holder: str, rid: str) -> bool:
        """A create slot (concurrency, then the rate) for ``holder``."""
        key = (holder, rid)
        if holder in self._dead:
            return False
        creates = self._admission.creates
        with anyio.CancelScope() as scope:
            self._waits[key] = scope
            try:
                await creates.acquire(key)
            finally:
                del self._waits[key]
            self._slots.add(key)
            self.peak = max(self.peak, creates.in_use)
            return True
        return False

    async def release_slot(self, holder: str, rid: str, answer: CreateAnswer | None = None) -> None:
        """Give a create slot back; ``answer``: what its create said of the provider's load."""
        key = (holder, rid)
        if key in self._slots:
            self._slots.remove(key)
            self._admission.creates.release(key, answer)

    async def abandon(self, holder: str, rid: str) -> None:
        """The caller gave up a wait: stop it, or give back what it was granted."""
        key = (holder, rid)
        scope = self._waits.get(key)
        if scope is not None:
            scope.cancel()
        await self.release(holder, rid)
        await self.release_slot(holder, rid)

    async def release_all(self, holder: str) -> int:
        """Give back everything a dead holder still had, and refuse it any more."""
        self._dead.add(holder)
        mine = {key for key in [*self._waits, *self._tickets, *self._slots] if key[0] == holder}
        for _, rid in mine:
            await self.abandon(holder, rid)
        return len(mine)

    async def follow(self, wait_s: float) -> tuple[AdmissionState, list[Event]]:
        """The state now and the events since the last call (waiting up to ``wait_s``
        for one): the driver's, which emits the events."""
        admission = self._admission
        assert self._held is not None
        if not self._held.events:
            with anyio.move_on_after(wait_s):
                await self._held.arrived.wait()
        return admission.state(), self._held.take()

    async def stats(self) -> dict[str, int]:
        return {"in_use": self._admission.creates.in_use, "peak": self.peak}


class RemoteAdmission:
    """A provider's ``Admission`` over an :class:`AdmissionHost` actor.

    Args:
        host: the actor's handle (each method has ``.remote(...)``).
        holder: the name the host knows this caller by (see :func:`release_all`).
        call_s: ``timeouts.ray_call_s``: how long an answer that comes at once may take.
        limits: the create gate's (the host learns the rate from the answers
            this proxy reads); None: a fixed rate.
    """

    def __init__(
        self, host: Any, holder: str, call_s: float, *, limits: CreateLimits | None = None
    ) -> None:
        self._host = host
        self._adaptive = limits is not None and limits.adaptive
        self._slow_s = math.inf if limits is None else limits.slow_s
        self._holder = holder
        self._call_s = call_s
        self._prefix = uuid.uuid4().hex[:8]  # request ids unique across proxies
        self._numbers = itertools.count()
        #: The request id each admitted ticket is known by in the host.
        self._ids: dict[Ticket, str] = {}
        self._state = _NONE
        #: The last refresh failed: later failures of the streak are not logged again.
        self._unreadable = False

    def _new_id(self) -> str:
        return f"{self._prefix}-{next(self._numbers)}"

    async def _ask(self, method: Any, rid: str, *args: Any) -> Any:
        """A call that waits for room; if it is given up, the host is told to give
        back what it may have granted meanwhile."""
        answered = False
        try:
            answer = await method.remote(self._holder, rid, *args)
            answered = True
            return answer
        finally:
            if not answered:
                self._host.abandon.remote(self._holder, rid)

    def _refused(self, what: str) -> ProvisionError:
        return ProvisionError(
            f"the cluster's admission refused {self._holder} {what}: the pool let it go",
            transient=False,
            attempts=0,
        )

    @property
    def adaptive(self) -> bool:
        return self._adaptive

    def slot(self, read: ReadFailure) -> AbstractAsyncContextManager[None]:
        return self._slot(read)

    @asynccontextmanager
    async def _slot(self, read: ReadFailure) -> AsyncIterator[None]:
        rid = self._new_id()
        if not await self._ask(self._host.acquire_slot, rid):
            raise self._refused("a create slot")
        # The create's answer is read here, by the provider's ``read`` (the
        # SDK's errors stay in this process), and sent with the slot: the host
        # learns the cluster's rate.
        with answered(
            self._slow_s,
            read,
            lambda answer: self._host.release_slot.remote(
                self._holder, rid, answer if self._adaptive else None
            ),
        ):
            yield

    async def acquire(self, env: str, *, again: Ticket | None = None) -> Ticket:
        rid = self._new_id()
        answer: Answer = await self._ask(self._host.acquire, rid, env)
        return self._admitted(answer, env, rid, again)

    def _admitted(self, answer: Answer, env: str, rid: str, again: Ticket | None) -> Ticket:
        if answer.state is not None:
            self._state = answer.state
        if answer.unavailable is not None:
            raise EnvUnavailableError(answer.unavailable, env=env)
        if not answer.granted:
            raise self._refused(f"an instance of {env}")
        ticket = again if again is not None else Ticket(env)
        ticket.probe, ticket.running, ticket.released = answer.probe, False, False
        self._ids[ticket] = rid
        return ticket

    def started(self, ticket: Ticket) -> None:
        rid = self._ids.get(ticket)
        if rid is not None and not ticket.running and not ticket.released:
            ticket.running = True
            self._host.started.remote(self._holder, rid)

    def release(self, ticket: Ticket) -> None:
        if ticket.released:
            return
        ticket.released = True
        rid = self._ids.pop(ticket, None)
        if rid is not None:
            self._host.release.remote(self._holder, rid)

    async def limit_reached(
        self, ticket: Ticket, instance_limit: int | None, running: int | None
    ) -> None:
        rid = self._ids.pop(ticket, None)
        ticket.released = True  # the host gives its place back first
        if rid is None:  # not admitted here: queue anew
            await self.acquire(ticket.env, again=ticket)
            return
        answer: Answer = await self._ask(self._host.limit_reached, rid, instance_limit, running)
        self._admitted(answer, ticket.env, rid, ticket)

    def learn_account(self, instance_limit: int | None, instance_count: int | None) -> None:
        self._host.learn_account.remote(instance_limit, instance_count)

    def record(self, env: str, reason: FailureReason | None) -> None:
        self._host.record.remote(env, reason)

    def state(self) -> AdmissionState:
        """The cluster's state as last seen (an answer, or :meth:`refresh`)."""
        return self._state

    async def refresh(self, events: Events, *, wait_s: float = 0.0) -> None:
        """The cluster's state now, and the breakers' events since the last call,
        emitted on ``events`` (waiting up to ``wait_s`` for one).

        Raises:
            TimeoutError: the host did not answer within ``timeouts.ray_call_s``.
        """
        with anyio.fail_after(self._call_s + wait_s):
            state, taken = await self._host.follow.remote(wait_s)
        self._state = state
        for event in taken:
            events.emit(event.name, level=event.level, **dict(event.attributes))

    @asynccontextmanager
    async def followed(self, events: Events) -> AsyncIterator[None]:
        """Keep :meth:`state` current and ship the breakers' events while open; once
        more on exit (shielded, bounded), for the events of a batch's last rollouts."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._follow, events)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()
        with anyio.CancelScope(shield=True):
            await self._refresh_quietly(events)

    async def _follow(self, events: Events) -> None:
        while True:
            await self._refresh_quietly(events, wait_s=FOLLOW_WAIT_S)

    async def _refresh_quietly(self, events: Events, *, wait_s: float = 0.0) -> None:
        try:
            await self.refresh(events, wait_s=wait_s)
        except Exception as exc:  # a slow or dead limiter: the gauges stay as they were
            if not self._unreadable:  # once per streak, not twice a second
                _log.warning(
                    "could not read the cluster's admission state (its gauges keep"
                    " their last values until it answers): %r",
                    exc,
                )
            self._unreadable = True
            if isinstance(exc, TimeoutError):
                return
            await anyio.sleep(wait_s)  # the loop does not spin on a dead actor
        else:
            if self._unreadable:
                _log.warning("the cluster's admission state can be read again")
            self._unreadable = False

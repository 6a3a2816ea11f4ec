"""Instance reuse: a warm pool of Fleet instances around a provider.

Creating an instance is what Fleet is slow at (a queue that served about one
create per 10 s under load); resetting one to its seed takes about a second.
:class:`WarmPool` is a :class:`~fleetroll.environments.provider.Provider`
around another (the pool's), and with ``provisioning.reuse`` on it hands
instances from one rollout to the next:

* a rollout's instance whose rollout ended without an infrastructure failure
  (:func:`fleetroll.rollout.stages.instance_reusable`: the caller's ``reuse``)
  is reset to its seed, in the background, and goes to the oldest rollout
  waiting for an instance of its kind, or waits idle; one whose reset fails,
  which served ``1 + provisioning.max_reuses`` rollouts, or which has lived half
  its TTL is released instead;
* "its kind" is everything its create asked for: environment and version,
  data and version, ``env_variables``, the modality's image type and TTL
  (:func:`reuse_key`). Computer-use and browser-lease modalities, and ``mcp``
  tasks, are never reused: a screen or a leased browser keeps state that is
  not part of the seed a reset restores;
* a rollout that finds no idle instance creates one when none of its kind is in
  use or being created; otherwise it waits for one to come back, and creates its
  own once none came back or became ready for ``provisioning.reuse_wait_s``, or
  as soon as its place in the queue, at the rate instances of its kind come
  back, means a longer wait than that (such creates are paced: at most a
  quarter of the kind's instances at a time, at least one);
* at most ``provisioning.warm_instances`` idle instances of each kind are kept,
  each for ``provisioning.warm_idle_s``; closing the pool releases them all.

The reset happens when the instance is given back (to the seed and timestamp
of the task it served), so the next rollout's own reset (:meth:`WarmPool.reset`)
has nothing left to do unless its task asks for another; its verifier sees only
its own rollout's changes, as on a fresh instance. The batch's orphan sweep
by ``run_id`` waits while this pool still holds an instance of that run (it
would delete it under the rollout it went to): it runs once the last is
released, or when the pool closes.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import anyio
from anyio.abc import TaskGroup

from fleetroll._internal.deadlines import fail_after
from fleetroll.environments.provider import Instance, Provider, Verdict
from fleetroll.settings import ModalitySettings, ProvisioningSettings, TimeoutSettings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Events
from fleetroll.tools.routing import Route
from fleetroll.tools.session import ToolSession, describe

__all__ = ["ReuseLimits", "WarmPool", "open_warm_pool", "reuse_key"]


@dataclass(frozen=True, slots=True)
class ReuseLimits:
    """The warm pool's knobs (``[provisioning]`` and ``[timeouts]``)."""

    max_reuses: int
    wait_s: float
    warm_instances: int
    idle_s: float
    reset_s: float
    release_s: float

    @classmethod
    def of(cls, provisioning: ProvisioningSettings, timeouts: TimeoutSettings) -> ReuseLimits:
        p, t = provisioning, timeouts
        return cls(
            max_reuses=p.max_reuses,
            wait_s=p.reuse_wait_s,
            warm_instances=p.warm_instances,
            idle_s=p.warm_idle_s,
            reset_s=t.reset_s,
            release_s=t.release_s,
        )


def reuse_key(task: TaskSpec, modalities: Mapping[str, ModalitySettings]) -> Hashable | None:
    """What an instance for ``task`` was created with: instances with the same
    key are interchangeable once reset. None: ``task``'s instances are never reused
    (``modalities``: the ``[modalities]`` table)."""
    if task.environment is not None:
        return None  # an mcp task: its own server, not a Fleet instance
    modality = modalities.get(task.modality)
    if modality is None or modality.tools != "api" or modality.browser_lease:
        return None
    variables = json.dumps(task.env_variables, sort_keys=True, default=str)
    ttl = task.ttl_seconds or modality.ttl_s
    return (task.env_spec, task.data_spec, variables, modality.image_type, ttl)


@dataclass(slots=True)
class _Held:
    """An instance of the pool: lent to a rollout, being reset, or idle."""

    instance: Instance
    key: Hashable
    run_id: str | None
    #: The task it serves (or last served): a reset for reuse is to its seed and time.
    task: TaskSpec
    #: Not handed to another rollout from then on: half its TTL has passed.
    reuse_until: float
    #: When it became idle (monotonic), while it is.
    idle_since: float = 0.0


@dataclass(slots=True)
class _Waiter:
    """A rollout waiting for an instance of its kind to come back."""

    ready: anyio.Event = field(default_factory=anyio.Event)
    held: _Held | None = None


@dataclass(slots=True)
class _Kind:
    """The instances of one :func:`reuse_key`."""

    idle: deque[_Held] = field(default_factory=deque)
    waiters: deque[_Waiter] = field(default_factory=deque)
    #: Being created, lent to a rollout, or being reset: those that may come back.
    out: int = 0
    #: When one last came back or became ready (monotonic).
    moved: float = 0.0
    #: Seconds between instances coming back while rollouts waited (a moving
    #: average): a waiter at place ``n`` expects to wait ``(n + 1) * interval``.
    interval: float | None = None
    #: Creates under way by rollouts that would have waited too long.
    growing: int = 0

    def room_to_grow(self) -> int:
        """More such creates allowed now: a quarter of the kind's instances out (at
        least one), so that what a create costs now is learnt before many queue."""
        return max(1, self.out // 4) - self.growing

    def came_back(self) -> None:
        now = time.monotonic()
        if self.waiters and self.moved:
            gap = now - self.moved
            self.interval = gap if self.interval is None else 0.7 * self.interval + 0.3 * gap
        self.moved = now

    def expected_wait(self, place: int) -> float | None:
        """Seconds until the waiter at ``place`` (0: the oldest) gets one, if known."""
        return None if self.interval is None else (place + 1) * self.interval


class WarmPool:
    """Reuses the instances of ``inner`` (see the module's docstring).

    Open it with :func:`open_warm_pool`: its background work (resets, idle
    expiry) runs in the task group that opens. :meth:`aclose` releases every
    instance it holds, then closes ``inner``.
    """

    def __init__(
        self,
        inner: Provider,
        events: Events,
        *,
        provisioning: ProvisioningSettings,
        timeouts: TimeoutSettings,
        modalities: Mapping[str, ModalitySettings],
    ) -> None:
        self._inner = inner
        self._modalities = modalities
        self._events = events
        self._limits = ReuseLimits.of(provisioning, timeouts)
        self._kinds: defaultdict[Hashable, _Kind] = defaultdict(_Kind)
        self._held: dict[str, _Held] = {}
        #: Reset when given back, untouched since, with the (seed, timestamp) it
        #: was reset to: the next rollout's reset is done if it asks for the same.
        self._just_reset: dict[str, tuple[int | None, int | None]] = {}
        #: Orphan sweeps put off while an instance of their run_id is held.
        self._deferred: set[str] = set()
        self._tg: TaskGroup | None = None
        self._background = 0
        self._drained = anyio.Event()
        self._idle_changed = anyio.Event()
        self._closing = False
        self._closed = False

    # -- the protocol, delegated --------------------------------------------

    async def preflight(self, tasks: Sequence[TaskSpec]) -> list[str]:
        return await self._inner.preflight(tasks)

    def route(self, instance: Instance, task: TaskSpec) -> Route:
        return self._inner.route(instance, task)

    def open_tools(
        self, instance: Instance, route: Route
    ) -> AbstractAsyncContextManager[ToolSession]:
        return self._inner.open_tools(instance, route)

    async def verify(self, instance: Instance, task: TaskSpec, final_answer: str | None) -> Verdict:
        return await self._inner.verify(instance, task, final_answer)

    async def is_alive(self, instance: Instance) -> bool:
        return await self._inner.is_alive(instance)

    async def reset(self, instance: Instance, task: TaskSpec) -> None:
        """Reset it, unless it was reset when it was given back, to ``task``'s seed
        and timestamp, and nothing has touched it since (the first reset of a
        reused instance's rollout)."""
        point = self._just_reset.pop(instance.instance_id, None)
        if point is not None and point == (task.seed, task.timestamp):
            return
        await self._inner.reset(instance, task)

    # -- provisioning -------------------------------------------------------

    async def provision(self, task: TaskSpec, *, run_id: str | None = None) -> Instance:
        """An idle instance of ``task``'s kind, one given back while waiting, or a new one.

        Raises:
            ProvisionError: creating one failed (as :meth:`Provider.provision`).
        """
        key = None if self._closing else reuse_key(task, self._modalities)
        if key is None:
            return await self._inner.provision(task, run_id=run_id)
        kind = self._kinds[key]
        arrived = time.monotonic()
        while True:
            held = self._take_idle(kind)
            if held is not None:
                held.task = task
                return held.instance
            now = time.monotonic()
            deadline = max(arrived, kind.moved) + self._limits.wait_s
            expected = kind.expected_wait(len(kind.waiters))
            if kind.out == 0 or now >= deadline or self._closing:
                break
            too_long = expected is not None and expected > self._limits.wait_s
            if too_long and kind.room_to_grow() > 0:  # a new one comes sooner
                return await self._create(task, key, kind, run_id, growing=True)
            held = await self._wait(kind, deadline - now)
            if held is not None:
                held.task = task
                return held.instance
        return await self._create(task, key, kind, run_id)

    def _take_idle(self, kind: _Kind) -> _Held | None:
        while kind.idle:
            held = kind.idle.pop()  # the most recently reset: older ones expire first
            kind.out += 1
            if time.monotonic() < held.reuse_until:
                self._lent(held)
                return held
            self._start(partial(self._release, held, "ttl"))
        return None

    async def _wait(self, kind: _Kind, timeout_s: float) -> _Held | None:
        """Wait up to ``timeout_s`` for an instance handed on (None: woken without one)."""
        waiter = _Waiter()
        kind.waiters.append(waiter)
        try:
            with anyio.move_on_after(timeout_s):
                await waiter.ready.wait()
        except anyio.get_cancelled_exc_class():
            if waiter.held is not None:  # handed to us as we were cancelled: it goes on
                self._start(partial(self._hand_on, waiter.held))
            raise
        finally:
            if waiter in kind.waiters:
                kind.waiters.remove(waiter)
        if waiter.held is not None:
            self._lent(waiter.held)
        return waiter.held

    async def _create(
        self,
        task: TaskSpec,
        key: Hashable,
        kind: _Kind,
        run_id: str | None,
        *,
        growing: bool = False,
    ) -> Instance:
        kind.out += 1
        kind.growing += growing
        made = False
        try:
            instance = await self._inner.provision(task, run_id=run_id)
            made = True
        finally:  # failed or cancelled: only the counts are put right
            kind.growing -= growing
            if not made:
                kind.out -= 1
                self._wake_if_none_out(kind)
        kind.came_back()
        self._shed(kind)
        ttl = task.ttl_seconds or self._modalities[task.modality].ttl_s
        self._held[instance.instance_id] = _Held(
            instance, key, run_id, task, reuse_until=instance.created_mono + ttl / 2
        )
        return instance

    def _lent(self, held: _Held) -> None:
        self._events.emit(
            "fleet_instance_recycled",
            instance_id=held.instance.instance_id,
            uses=held.instance.uses,
            outcome="reused",
        )

    def _shed(self, kind: _Kind) -> None:
        """Waiters who would now wait longer than ``reuse_wait_s`` (the newest) create
        their own instead, as many as :meth:`_Kind.room_to_grow` allows."""
        room = kind.room_to_grow()
        while kind.waiters and room > 0:
            expected = kind.expected_wait(len(kind.waiters) - 1)
            if expected is None or expected <= self._limits.wait_s:
                return
            kind.waiters.pop().ready.set()
            room -= 1

    @staticmethod
    def _wake_if_none_out(kind: _Kind) -> None:
        """Nothing of the kind may come back: its waiters create their own."""
        if kind.out > 0:
            return
        for waiter in kind.waiters:
            waiter.ready.set()
        kind.waiters.clear()

    # -- giving back --------------------------------------------------------

    async def release(self, instance: Instance, *, reuse: bool = False) -> bool:
        """Keep it for another rollout (``reuse``, and it may be), else release it.

        Never raises; the reset and the hand-over run in the background.
        """
        held = self._held.get(instance.instance_id)
        if held is None:
            return await self._inner.release(instance)
        held.instance = instance
        why = self._why_not_reused(held, reuse)
        if why is not None:
            return await self._release(held, why)
        self._start(partial(self._recycle, held))
        return True

    def _why_not_reused(self, held: _Held, reuse: bool) -> str | None:
        if not reuse:
            return "rollout_failed"
        if self._closing:
            return "closing"
        if held.instance.uses > self._limits.max_reuses:
            return "max_reuses"
        if time.monotonic() >= held.reuse_until:
            return "ttl"
        return None

    async def _recycle(self, held: _Held) -> None:
        """Reset ``held`` to its seed (the seed and timestamp of the task it served:
        the next is most often another sample of it), then hand it on, or keep it
        idle; released when the reset fails (or the pool closes meanwhile)."""
        began = time.monotonic()
        task = held.task
        try:
            with fail_after(self._limits.reset_s):
                await self._inner.reset(held.instance, task)
        except anyio.get_cancelled_exc_class():
            await self._release(held, "closing")
            raise
        except Exception as exc:  # any failure: its state is unknown, so it goes
            self._events.emit(
                "fleet_env_reset_failed",
                level="warn",
                instance_id=held.instance.instance_id,
                timeout_s=self._limits.reset_s,
                error_type=type(exc).__name__,
                error_message=f"reset for reuse: {describe(exc)}"[:500],
            )
            await self._release(held, "reset_failed")
            return
        held.instance = dataclasses.replace(held.instance, uses=held.instance.uses + 1)
        self._just_reset[held.instance.instance_id] = (task.seed, task.timestamp)
        self._events.emit(
            "fleet_instance_recycled",
            instance_id=held.instance.instance_id,
            uses=held.instance.uses - 1,
            outcome="reset",
            reset_s=round(time.monotonic() - began, 4),
        )
        await self._hand_on(held)

    async def _hand_on(self, held: _Held) -> None:
        """To the oldest rollout waiting for its kind, else idle (or released)."""
        kind = self._kinds[held.key]
        kind.came_back()
        while kind.waiters:
            waiter = kind.waiters.popleft()
            if not waiter.ready.is_set():
                waiter.held = held
                waiter.ready.set()
                self._shed(kind)
                return
        if self._closing:
            await self._release(held, "closing")
            return
        if len(kind.idle) >= self._limits.warm_instances:
            await self._release(held, "warm_instances")
            return
        kind.out -= 1
        held.idle_since = time.monotonic()
        kind.idle.append(held)
        self._idle_changed.set()

    async def _release(self, held: _Held, why: str) -> bool:
        """Let ``held`` go for good (shielded and bounded by the inner provider)."""
        kind = self._kinds[held.key]
        kind.out -= 1
        self._wake_if_none_out(kind)
        self._held.pop(held.instance.instance_id, None)
        self._just_reset.pop(held.instance.instance_id, None)
        self._events.emit(
            "fleet_instance_recycled",
            instance_id=held.instance.instance_id,
            uses=held.instance.uses,
            outcome="released",
            reason=why,
        )
        with anyio.CancelScope(shield=True):
            released = await self._inner.release(held.instance)
            if held.run_id in self._deferred and not self._holds(held.run_id):
                self._deferred.discard(held.run_id)
                await self._inner.sweep(held.run_id or "")
        return released

    # -- background work and closing ---------------------------------------

    def _start(self, work: Callable[[], Awaitable[object]]) -> None:
        assert self._tg is not None, "open the pool with open_warm_pool()"
        self._background += 1

        async def run() -> None:
            try:
                await work()
            finally:
                self._background -= 1
                if self._background == 0:
                    self._drained.set()
                    self._drained = anyio.Event()

        self._tg.start_soon(run)

    async def _expire(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Release idle instances ``warm_idle_s`` after they became idle."""
        task_status.started()
        while True:
            now = time.monotonic()
            soonest = None
            for kind in self._kinds.values():
                for held in list(kind.idle):
                    until = min(held.idle_since + self._limits.idle_s, held.reuse_until)
                    if until <= now:
                        kind.idle.remove(held)
                        kind.out += 1  # counted until it is gone
                        why = "idle" if until < held.reuse_until else "ttl"
                        self._start(partial(self._release, held, why))
                    elif soonest is None or until < soonest:
                        soonest = until
            self._idle_changed = anyio.Event()
            with anyio.move_on_after(float("inf") if soonest is None else soonest - now):
                await self._idle_changed.wait()

    def _holds(self, run_id: str | None) -> bool:
        return any(held.run_id == run_id for held in self._held.values())

    async def sweep(self, run_id: str) -> int:
        """The inner provider's orphan sweep, put off while an instance of
        ``run_id`` is held here (it may be lent to another batch's rollout)."""
        if self._holds(run_id):
            self._deferred.add(run_id)
            return 0
        return await self._inner.sweep(run_id)

    @property
    def idle(self) -> int:
        """Idle instances held now (all kinds)."""
        return sum(len(kind.idle) for kind in self._kinds.values())

    async def drain(self) -> None:
        """Release every instance held here and run the sweeps put off. Idempotent."""
        self._closing = True
        with anyio.CancelScope(shield=True):
            for kind in self._kinds.values():
                for waiter in kind.waiters:
                    waiter.ready.set()
            while self._background:  # resets under way: they end released
                await self._drained.wait()
            async with anyio.create_task_group() as tg:
                for kind in self._kinds.values():
                    while kind.idle:
                        held = kind.idle.pop()
                        kind.out += 1
                        tg.start_soon(self._release, held, "closing")
            for run_id in sorted(self._deferred):
                self._deferred.discard(run_id)
                await self._inner.sweep(run_id)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self.drain()
        finally:
            await self._inner.aclose()


@asynccontextmanager
async def open_warm_pool(
    inner: Provider,
    events: Events,
    *,
    provisioning: ProvisioningSettings,
    timeouts: TimeoutSettings,
    modalities: Mapping[str, ModalitySettings],
) -> AsyncIterator[WarmPool]:
    """A :class:`WarmPool` over ``inner``, its background work running until exit;
    on exit every instance it holds is released (``inner`` is closed by
    :meth:`WarmPool.aclose`, as any provider's owner closes it). Its limits are
    ``[provisioning]``'s and ``[timeouts]``'s (:class:`ReuseLimits`)."""
    pool = WarmPool(
        inner, events, provisioning=provisioning, timeouts=timeouts, modalities=modalities
    )
    async with anyio.create_task_group() as tg:
        pool._tg = tg
        await tg.start(pool._expire)
        try:
            yield pool
        finally:
            await pool.drain()
            tg.cancel_scope.cancel()


def _type_check(
    inner: Provider, p: ProvisioningSettings, t: TimeoutSettings, m: dict[str, ModalitySettings]
) -> Provider:
    # mypy: it satisfies the protocol
    return WarmPool(inner, Events(), provisioning=p, timeouts=t, modalities=m)

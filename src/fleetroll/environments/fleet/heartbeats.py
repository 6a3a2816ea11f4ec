"""Heartbeats: Fleet stops an instance that misses them, so a killed process's
instances stop within about two intervals instead of at their TTL.

An instance is made with ``heartbeat_interval`` (``provisioning.heartbeat_s``;
Fleet accepts 30-3600 s) only while a :class:`Heartbeats` loop runs in this
process (a pool's provider starts one: :meth:`Heartbeats.start`): an instance
made with an interval and never beaten would be stopped under its rollout. The
loop beats a new instance at once, then every held instance each half interval (``POST
/v1/env/instances/{id}/heartbeat``, the SDK's ``AsyncEnv.heartbeat``), so one
lost or late beat never stops an instance; Fleet (and the emulator) stops one
whose last beat is two intervals old.
"""

from __future__ import annotations

import logging
from collections import deque

import anyio
from anyio.abc import TaskGroup
from fleet._async import exceptions as fleet_errors

from fleetroll._internal.deadlines import fail_after
from fleetroll.environments.fleet.direct import FleetEnv

__all__ = ["BEATS_PER_INTERVAL", "Heartbeats"]

_log = logging.getLogger(__name__)

#: Beats sent per interval: one may be lost or late without stopping the instance.
BEATS_PER_INTERVAL = 2
#: Beats in flight at once (each its own short request).
_MAX_CONCURRENT_BEATS = 32


class Heartbeats:
    """The instances this process holds on Fleet, beaten while :meth:`start`'s loop runs.

    Args:
        interval_s: ``provisioning.heartbeat_s``; None: no heartbeats.
        timeout_s: one beat's deadline (never past half an interval).
    """

    def __init__(self, interval_s: int | None, *, timeout_s: float) -> None:
        self._interval = interval_s
        # A hung beat must not hold the round past the next one.
        self._timeout_s = (
            timeout_s if interval_s is None else min(timeout_s, interval_s / BEATS_PER_INTERVAL)
        )
        self._held: dict[str, FleetEnv] = {}
        #: Held since the last round: beaten at once (Fleet's watch starts at
        #: an instance's first beat).
        self._new: dict[str, FleetEnv] = {}
        self._arrived = anyio.Event()
        self._running = False
        #: Beats sent and beats that failed (tests and the bench read them).
        self.sent = 0
        self.failed = 0

    @property
    def interval(self) -> int | None:
        """The interval to make instances with: None unless the loop runs."""
        return self._interval if self._running else None

    def hold(self, env: FleetEnv) -> None:
        """Beat ``env`` from now on (if it was made with an interval)."""
        if env.heartbeat_interval:
            self._held[env.instance_id] = self._new[env.instance_id] = env
            self._arrived.set()

    def drop(self, instance_id: str) -> None:
        """Stop beating the instance (it is being released)."""
        self._held.pop(instance_id, None)
        self._new.pop(instance_id, None)

    def start(self, tg: TaskGroup) -> None:
        """Run the loop in ``tg`` (creates ask for heartbeats from now on)."""
        if self._interval is None or self._running:
            return
        self._running = True
        tg.start_soon(self._run)

    async def _run(self) -> None:
        assert self._interval is not None
        period = self._interval / BEATS_PER_INTERVAL
        due = anyio.current_time() + period
        try:
            while True:
                with anyio.move_on_after(due - anyio.current_time()):
                    await self._arrived.wait()
                self._arrived = anyio.Event()
                if anyio.current_time() >= due:
                    due = max(due + period, anyio.current_time())
                    envs, self._new = list(self._held.values()), {}
                else:  # only the new ones now; all of them at the next round
                    envs, self._new = list(self._new.values()), {}
                # A few beaters take the round's instances in turn: no task and no
                # limiter wait per instance (a batch's start makes a thousand at once).
                queue = deque(envs)
                async with anyio.create_task_group() as tg:
                    for _ in range(min(_MAX_CONCURRENT_BEATS, len(queue))):
                        tg.start_soon(self._beat_all, queue)
        finally:
            self._running = False

    async def _beat_all(self, queue: deque[FleetEnv]) -> None:
        while queue:
            await self._beat(queue.popleft())

    async def _beat(self, env: FleetEnv) -> None:
        if env.instance_id not in self._held:
            return  # released meanwhile
        self.sent += 1
        try:
            with fail_after(self._timeout_s):
                await env.heartbeat()
        except Exception as exc:  # the next beat may pass; the rollout sees a death
            self.failed += 1
            released = env.instance_id not in self._held
            if isinstance(exc, fleet_errors.FleetAPIError) and exc.status_code == 404:
                self.drop(env.instance_id)  # gone: nothing left to keep alive
            # A beat that crossed its instance's release (a 404 from the delete
            # that won) is expected: not a line on the user's console.
            _log.log(
                logging.DEBUG if released else logging.WARNING,
                "heartbeat of instance %s failed: %s",
                env.instance_id,
                type(exc).__name__,
            )

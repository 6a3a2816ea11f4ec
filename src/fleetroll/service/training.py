"""What a remote trainer needs beyond results: groups with cursors, the policy version, pauses.

* :class:`GroupLog`: a batch's complete groups (:mod:`fleetroll.training.groups`) in
  completion order, computed from its results as they arrive (so batches on
  any pool have them), streamed as NDJSON like the results: a group's cursor
  is its 1-based index, ``?after=n`` resumes.
* :class:`PauseLeases`: pauses of policy calls held for a trainer over HTTP.
  A pause is a lease: it ends after ``ttl_s`` unless renewed, so a trainer
  that crashes mid weight swap cannot hold every rollout forever.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import anyio
from anyio.abc import TaskGroup

from fleetroll.errors import OperationTimeout
from fleetroll.pool.rollout_pool import RolloutPool, group_id, rollout_id
from fleetroll.results import RolloutResult
from fleetroll.service.errors import ApiError
from fleetroll.tasks import TaskSpec
from fleetroll.training.groups import Group, GroupTracker

_log = logging.getLogger(__name__)

__all__ = ["GroupLog", "PauseLeases"]

_LINES_PER_CHUNK = 64


class _Record(Protocol):
    """What a group stream reads of its batch record."""

    @property
    def done(self) -> bool: ...
    def changed(self) -> anyio.Event: ...
    def last_line(self, cursor: int) -> bytes: ...


class GroupLog:
    """A batch's complete groups, in completion order; a cursor is an index + 1.

    A group whose rollouts run again (a resubmitted batch re-runs its
    cancelled ones) is superseded, skipped by streams, and comes again once
    complete: read from the start, a stream gives each group once, the newest.
    """

    def __init__(
        self,
        batch_id: str,
        tasks: Sequence[TaskSpec],
        samples_per_task: int,
        oversample: int,
        *,
        groups_target: int | None = None,
    ) -> None:
        self.batch_id = batch_id
        self._members = {
            group_id(batch_id, t.key): (
                t.key,
                [rollout_id(batch_id, t.key, n) for n in range(samples_per_task + oversample)],
            )
            for t in tasks
        }
        self._expected = samples_per_task
        self.groups: list[Group] = []
        self._superseded: set[int] = set()
        #: The batch's ``groups_target``: its tracker marks the groups the pool cut.
        self._target = groups_target
        self._tracker = GroupTracker(
            batch_id, samples_per_task, self._members, target=groups_target
        )

    def add(self, result: RolloutResult) -> None:
        completion = self._tracker.add(result)
        if completion is not None:
            self.groups.append(completion[0])
            self._tracker.cut()  # the pool stopped those groups' rollouts: mark them cut

    def rerun(self, rollout_ids: Iterable[str], kept: Iterable[RolloutResult]) -> None:
        """``rollout_ids`` run again; ``kept`` are the newest results of the others."""
        rerun = set(rollout_ids)
        touched = {
            gid: (key, [rid for rid in ids if rid in rerun])
            for gid, (key, ids) in self._members.items()
            if rerun.intersection(ids)
        }
        for i, group in enumerate(self.groups):
            if group.group_id in touched:
                self._superseded.add(i)
        previous = [r for r in kept if r.group_id in touched and r.rollout_id not in rerun]
        # The pool counts the groups complete before toward groups_target, as here.
        full = sum(
            1
            for i, group in enumerate(self.groups)
            if i not in self._superseded and group.group_id not in touched and group.complete
        )
        self._tracker = GroupTracker(
            self.batch_id, self._expected, touched, previous, target=self._target, full=full
        )
        self._tracker.cut()

    async def lines(
        self,
        record: _Record,
        after: int,
        *,
        heartbeat_s: float,
        stopping: Callable[[], bool],
        complete_only: bool = False,
    ) -> AsyncIterator[bytes]:
        """NDJSON chunks: the groups after cursor ``after``, then an end line.

        As ``BatchRecord.lines``: heartbeats while idle, no end line when the
        server stops (the client reconnects). ``complete_only`` skips groups
        short of their scored samples; they still advance the cursor (the
        heartbeat and end lines carry it), so cursors mean the same either way.
        """
        cursor = after
        while True:
            changed = record.changed()
            while cursor < len(self.groups):
                upto = min(len(self.groups), cursor + _LINES_PER_CHUNK)
                chunk = [
                    f'{{"type":"group","cursor":{i + 1},"group":{group}}}\n'
                    for i in range(cursor, upto)
                    if i not in self._superseded and (self.groups[i].complete or not complete_only)
                    for group in (self.groups[i].model_dump_json(),)
                ]
                cursor = upto
                if chunk:
                    yield "".join(chunk).encode()
            if record.done:
                yield record.last_line(cursor)
                return
            if stopping():
                return
            with anyio.move_on_after(heartbeat_s) as idle:
                await changed.wait()
            if idle.cancelled_caught:
                yield f'{{"type":"heartbeat","cursor":{cursor}}}\n'.encode()


@dataclass
class _Lease:
    pause_id: str
    expires: float
    ended: anyio.Event = field(default_factory=anyio.Event)
    #: Set once the pause is no longer held.
    over: anyio.Event = field(default_factory=anyio.Event)


class PauseLeases:
    """Pauses of a pool's policy calls, each held until released or expired.

    Needs a task group (``tg``) before use: one task per lease holds the pause.
    """

    def __init__(self, pool: RolloutPool, max_ttl_s: float) -> None:
        self._pool = pool
        self._max_ttl_s = max_ttl_s
        self._leases: dict[str, _Lease] = {}
        self.tg: TaskGroup | None = None

    def __len__(self) -> int:
        return len(self._leases)

    def _check(self, ttl_s: float) -> None:
        if ttl_s > self._max_ttl_s:
            raise ApiError(
                422,
                f"a pause lasts at most service.max_pause_ttl_s = {self._max_ttl_s:g} s"
                " per lease; renew it to hold longer",
                loc=["body", "ttl_s"],
            )

    async def start(self, ttl_s: float) -> str:
        """Pause policy calls for ``ttl_s`` (unless renewed); the pause's id.

        Raises:
            ApiError: 422, ``ttl_s`` is over ``service.max_pause_ttl_s``.
        """
        self._check(ttl_s)
        if self.tg is None:
            raise RuntimeError("the service is not running")
        lease = _Lease(uuid.uuid4().hex, anyio.current_time() + ttl_s)
        self._leases[lease.pause_id] = lease
        try:
            await self.tg.start(self._hold, lease)
        except OperationTimeout as exc:  # a Ray actor did not confirm the pause
            raise ApiError(504, str(exc)) from None
        return lease.pause_id

    def renew(self, pause_id: str, ttl_s: float) -> None:
        """The pause now ends ``ttl_s`` from now (unless renewed again).

        Raises:
            ApiError: 404 (no such pause: released, or expired), 422 (``ttl_s`` too long).
        """
        self._check(ttl_s)
        self._get(pause_id).expires = anyio.current_time() + ttl_s

    async def release(self, pause_id: str) -> None:
        """End the pause now (it is over when this returns).

        Raises:
            ApiError: 404, no such pause (released, or expired).
        """
        lease = self._get(pause_id)
        lease.ended.set()
        await lease.over.wait()  # its holder task lets go at its next turn

    def _get(self, pause_id: str) -> _Lease:
        lease = self._leases.get(pause_id)
        if lease is None:
            raise ApiError(404, f"no pause {pause_id!r} (released, or its lease expired)")
        return lease

    async def _hold(
        self, lease: _Lease, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        started = False
        try:
            async with self._pool.policy_paused():
                task_status.started()
                started = True
                while not lease.ended.is_set() and anyio.current_time() < lease.expires:
                    # A renewal moves the expiry on: the loop looks again when this one passes.
                    with anyio.move_on_at(lease.expires):
                        await lease.ended.wait()
        except OperationTimeout as exc:
            if not started:
                raise  # the pause was never held: its POST answers 504
            # Over here; a slow actor gets the pause's end (and a version set in
            # it) with its next rollout. Raised, it would end the service.
            _log.warning("pause %s ended, but %s", lease.pause_id, exc)
        finally:
            self._leases.pop(lease.pause_id, None)
            lease.over.set()

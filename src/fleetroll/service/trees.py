"""Rollout trees submitted over HTTP (``POST /v1/trees``): the registry that
checks, starts, cancels and keeps them, and each tree's record.

A tree (:meth:`fleetroll.pool.rollout_pool.RolloutPool.start_tree`) is a root
rollout, then ``width`` branches from its branch point: two batches of the
pool (``{tree_id}-root``, ``{tree_id}-b{k}``), one after the other, which is
why it is not one idempotent ``POST /v1/batches``. One server-side task per
tree reads its results and appends each to the tree's :class:`TreeRecord`
(the root is cursor 1, the branches follow as they end); readers stream from
that list at their own pace, and resume with ``?after=<cursor>``, as a
batch's readers do.

Trees are kept in memory only (a tree is re-run whole, as ``fleetroll run
--branch-at`` does): after a restart a tree's id is unknown (404), and
submitting it again runs it anew. Resubmitting an identical request under a
known ``tree_id`` returns the same tree, whatever its state.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

import anyio
from anyio.abc import TaskGroup

from fleetroll.errors import FleetrollError, PoolFullError
from fleetroll.policies import Policy
from fleetroll.pool.rollout_pool import RolloutPool, TreeRun
from fleetroll.results import RolloutResult
from fleetroll.service.batches import RequestPolicies
from fleetroll.service.errors import ApiError
from fleetroll.service.metrics import Metrics
from fleetroll.service.models import TreeRequest, TreeState, TreeStatus
from fleetroll.service.preflight import BatchPreflight
from fleetroll.service.requests import batch_fingerprint
from fleetroll.settings import ServiceSettings
from fleetroll.tasks import TaskSpec

__all__ = ["TreeRecord", "TreeRegistry"]

_log = logging.getLogger(__name__)
#: Closing a tree's policy (an HTTP client) after the tree: bounded, shielded.
#: Not a setting, as for batches: closing a client does no I/O worth waiting for.
_POLICY_CLOSE_S = 5.0
_REFUSED_AGENT = (
    "a tree replays its prefix in fleetroll's own loop: an agent command cannot be"
    " branched; give a policy (scripted or openai)"
)


class TreeRecord:
    """One tree and its results so far: the root first, then branches as they end."""

    def __init__(self, run: TreeRun, fingerprint: str) -> None:
        self.run = run
        self.fingerprint = fingerprint
        self.results: list[RolloutResult] = []
        self.done = False
        self.cancel_requested = False
        #: Why the branches did not start (the pool was full), or None.
        self.error: str | None = None
        self._changed = anyio.Event()

    @property
    def tree_id(self) -> str:
        return self.run.tree_id

    @property
    def status(self) -> TreeStatus:
        if not self.done:
            return "running"
        if self.error is not None:
            return "failed"
        return "cancelled" if self.cancel_requested else "finished"

    def state(self) -> TreeState:
        run = self.run
        root, branches = (self.results[0], self.results[1:]) if self.results else (None, [])
        return TreeState(
            tree_id=run.tree_id,
            status=self.status,
            cancel_requested=self.cancel_requested,
            branch_at=run.branch_at,
            width=run.width,
            root_batch_id=run.root_batch_id,
            branches_batch_id=run.branches_batch_id,
            root=root,
            branches=branches,
            groups=run.tree.groups if run.tree is not None else [],
            results=len(self.results),
            error=self.error,
        )

    def append(self, result: RolloutResult) -> None:
        self.results.append(result)
        self.notify()

    def finish(self, error: str | None = None) -> None:
        self.error = error
        self.done = True
        self.notify()

    def notify(self) -> None:
        """Wake every waiting reader (each then re-checks what it waits for)."""
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_done(self) -> None:
        """Wait until every result is in (bound it with a deadline of your own)."""
        while not self.done:
            await self._changed.wait()

    def _line(self, line: dict[str, object]) -> bytes:
        return (json.dumps(line, separators=(",", ":")) + "\n").encode()

    async def lines(
        self, after: int, *, heartbeat_s: float, stopping: Callable[[], bool]
    ) -> AsyncIterator[bytes]:
        """NDJSON chunks: the results after cursor ``after``, then an end line.

        Heartbeat lines go out while nothing happens for ``heartbeat_s``;
        ``stopping()`` true (the server is shutting down) ends the stream
        without an end line, so the client knows it was cut.
        """
        cursor = after
        while True:
            if cursor < len(self.results):
                chunk = [
                    f'{{"type":"result","cursor":{i + 1},"result":{r.model_dump_json()}}}\n'
                    for i, r in enumerate(self.results[cursor:], start=cursor)
                ]
                cursor = len(self.results)
                yield "".join(chunk).encode()
                continue
            if self.done:
                end: dict[str, object] = {"type": "end", "cursor": cursor, "status": self.status}
                if self.error is not None:
                    end["error"] = self.error
                yield self._line(end)
                return
            if stopping():
                return
            changed = self._changed
            with anyio.move_on_after(heartbeat_s) as idle:
                await changed.wait()
            if idle.cancelled_caught:
                yield self._line({"type": "heartbeat", "cursor": cursor})


class TreeRegistry:
    """The service's trees, by id, run on ``pool``. Needs a task group (``tg``) before use.

    ``refusing`` says why the service takes no new rollouts (its store cannot
    be written: :attr:`fleetroll.service.batches.BatchRegistry.store_error`), or None.
    """

    def __init__(
        self,
        pool: RolloutPool,
        metrics: Metrics,
        *,
        preflight: BatchPreflight,
        policies: RequestPolicies,
        service: ServiceSettings,
        refusing: Callable[[], str | None] = lambda: None,
    ) -> None:
        self._pool = pool
        self._metrics = metrics
        self._preflight = preflight
        self._policies = policies
        self._service = service
        self._refusing = refusing
        self._records: dict[str, TreeRecord] = {}
        self._finished: deque[str] = deque()
        self.tg: TaskGroup | None = None
        self.stopping = False

    def __iter__(self) -> Iterator[TreeRecord]:
        return iter(list(self._records.values()))

    def get(self, tree_id: str) -> TreeRecord:
        """Raises: ApiError: 404, no such tree (or it was forgotten)."""
        record = self._records.get(tree_id)
        if record is None:
            raise ApiError(
                404, f"no tree {tree_id!r} (unknown, finished long ago, or before a restart)"
            )
        return record

    async def submit(self, request: TreeRequest, task: TaskSpec) -> tuple[TreeRecord, bool]:
        """Start the tree of ``request`` (``task``: its task, checked), or return the
        identical one already started; and whether it is new.

        Raises:
            ApiError: 422 (an agent command, a width over the service's limit, the
                pre-flight refused it), 409 (the id is taken by a different request
                or its batches' ids by running batches), 503 (the pool is full, or
                the service takes no new rollouts).
        """
        if request.agent_command is not None:
            raise ApiError(422, _REFUSED_AGENT, loc=["body", "agent_command"])
        limit = self._service.max_batch_rollouts
        if request.width > limit:
            raise ApiError(
                422,
                f"{request.width} branches, over this service's limit of {limit} rollouts"
                " per batch (service.max_batch_rollouts)",
                loc=["body", "width"],
            )
        fingerprint = _fingerprint(request, task)
        tree_id = request.tree_id or uuid.uuid4().hex[:12]
        existing = self._records.get(tree_id)
        if existing is None:
            self._refuse_if_failing()
            await self._preflight.check([task], request.policy, loc=["body", "task"])
            existing = self._records.get(tree_id)  # its twin may have started it meanwhile
        if existing is not None:
            if existing.fingerprint != fingerprint:
                raise ApiError(
                    409,
                    f"tree {tree_id!r} already exists with a different task, policy, branch"
                    " point, width or deadline; resubmit the same request, or use another"
                    " tree_id",
                )
            return existing, False
        record = self._start(task, request, tree_id, fingerprint)
        return record, True

    def _start(
        self, task: TaskSpec, request: TreeRequest, tree_id: str, fingerprint: str
    ) -> TreeRecord:
        if self.tg is None:
            raise RuntimeError("the service is not running")
        policy = self._policies.build(request.policy)
        try:
            run = self._pool.start_tree(
                task,
                policy,
                branch_at=request.branch_at,
                width=request.width,
                tree_id=tree_id,
                deadline_s=request.deadline_s,
            )
        except PoolFullError as exc:
            self.tg.start_soon(_close_policy, policy)
            if exc.requested > exc.limit:
                raise ApiError(422, str(exc), loc=["body", "width"]) from None
            raise ApiError(503, str(exc), headers={"Retry-After": "30"}) from None
        except ValueError as exc:  # a batch of the pool holds its root's id
            self.tg.start_soon(_close_policy, policy)
            raise ApiError(409, str(exc)) from None
        record = TreeRecord(run, fingerprint)
        self._records[tree_id] = record
        self.tg.start_soon(self._consume, record, policy)
        return record

    def _refuse_if_failing(self) -> None:
        """Raises: ApiError: 503, the service takes no new rollouts (its store failed)."""
        why = self._refusing()
        if why is not None:
            raise ApiError(
                503,
                f"{why}; this service takes no new rollouts until it is restarted: make room"
                " in service.state_dir, restart fleetroll serve, then submit again",
            )

    async def _consume(self, record: TreeRecord, policy: Policy) -> None:
        error: str | None = None
        try:
            async with record.run:
                async for result in record.run:
                    self._metrics.observe(result)
                    record.append(result)
        except (FleetrollError, ValueError) as exc:  # the branches could not start
            error = f"tree {record.tree_id}: the branches did not start: {exc}"
            _log.warning("%s", error)
        finally:
            with anyio.CancelScope(shield=True):
                await _close_policy(policy)
            record.finish(error)
            self._retire(record)

    def cancel(self, tree_id: str) -> TreeRecord:
        """Cancel what is still running (no branch starts after it); every result still arrives.

        Raises:
            ApiError: 404, no such tree.
        """
        record = self.get(tree_id)
        if not record.done:
            record.cancel_requested = True
            record.run.cancel()
        return record

    def stop(self) -> None:
        """The server is stopping: end every results stream now."""
        self.stopping = True
        for record in self._records.values():
            record.notify()

    async def cancel_all(self, wait_s: float) -> None:
        """Cancel every running tree and wait (at most ``wait_s``) for their last results."""
        running = [r for r in self._records.values() if not r.done]
        for record in running:
            record.cancel_requested = True
            record.run.cancel()
        with anyio.move_on_after(wait_s):
            for record in running:
                await record.wait_done()

    def _retire(self, record: TreeRecord) -> None:
        """Keep the last ``service.keep_finished_batches`` finished trees; forget older ones."""
        self._finished.append(record.tree_id)
        while len(self._finished) > self._service.keep_finished_batches:
            old = self._records.pop(self._finished.popleft(), None)
            if old is None:
                continue
            for batch in old.run.batches:
                if self._pool.batches.get(batch.batch_id) is batch:  # not a newer one's
                    self._pool.forget(batch.batch_id)


def _fingerprint(request: TreeRequest, task: TaskSpec) -> str:
    """What makes two submissions "the same tree" (a policy's api_key does not)."""
    batch = batch_fingerprint([task], request.policy, request.width, request.deadline_s)
    blob = json.dumps({"batch": batch, "branch_at": request.branch_at}).encode()
    return hashlib.sha256(blob).hexdigest()


async def _close_policy(policy: Policy) -> None:
    with anyio.CancelScope(shield=True), anyio.move_on_after(_POLICY_CLOSE_S):
        await policy.aclose()

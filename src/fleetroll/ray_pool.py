"""Scale-out on Ray: one batch over several actors, each running a RolloutPool.

::

    async with RayRolloutPool(settings, api_key=..., base_url=..., num_actors=4) as pool:
        async for result in pool.run_batch(tasks, ScriptedPolicy(), samples_per_task=8):
            ...

The same interface and guarantees as :class:`~fleetroll.pool.RolloutPool`:

* exactly one result per rollout, with the same deterministic ids;
* admission cluster-wide, in a small limiter actor holding the cluster's one
  :class:`~fleetroll.admission.AdmissionController` (:mod:`fleetroll.ray_admission`):
  creates, instance caps, Fleet's account limit (all per account) and each
  environment's circuit breaker; active rollouts are limited per actor;
* cancellation reaches every actor;
* an actor that dies has its unfinished rollouts re-run on a healthy actor,
  and the instances it held are released (each shard has its own Fleet
  ``run_id``, swept when the actor is found dead);
* telemetry events from actors come back with their results and are emitted
  by the driver's :class:`~fleetroll.telemetry.events.Events`, so local
  stores and ``fleetroll stats --check`` see the whole batch; each carries
  ``worker``, the index of the actor that emitted it;
* :meth:`RayBatch.view` reads a running rollout on its actor (the same
  :class:`~fleetroll.rollout.RolloutView` a local batch gives), so the
  service's MCP tools follow rollouts on Ray as they do local ones.

Ray is optional: ``pip install 'fleetroll[ray]'``.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping, Sequence
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import anyio
from anyio.abc import TaskGroup

from fleetroll._exit_stack import exit_transparently
from fleetroll.errors import ConfigError, OperationTimeout
from fleetroll.policies import Policy
from fleetroll.pool import (
    BatchCounts,
    BatchMap,
    ResultStream,
    check_capacity,
    check_unique_keys,
    group_id,
    rollout_id,
)
from fleetroll.progress import RolloutIds
from fleetroll.provisioning import FleetProvider
from fleetroll.ray_actors import RolloutWorker, default_num_actors, holder, load_ray
from fleetroll.ray_admission import AdmissionHost, RemoteAdmission
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout import Phase, RolloutView
from fleetroll.rollout_events import EventPage, ended_page
from fleetroll.settings import Settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Event, Events

__all__ = ["RayBatch", "RayRolloutPool"]

#: How long an actor holds a ``take`` call open for results (a long poll).
#: Not a setting: it trades a cancel's latency against calls per second, and
#: nothing a user runs changes that trade.
_TAKE_WAIT_S = 0.5
#: How long an actor, once something came in, gathers what follows before it
#: answers a ``take``: one call per burst of events, not per event (the same trade).
_TAKE_GATHER_S = 0.05
#: How soon a follower asks again when a rollout's actor does not hold its shard
#: yet: the shard opens within a few of these.
_OPENING_POLL_S = 0.05


# -- the driver -----------------------------------------------------------------


@dataclass
class _Shard:
    shard_id: str
    worker: int
    ids: list[str]


@dataclass
class _Plan:
    tasks: list[TaskSpec]
    policy: Policy
    samples: int
    batch_id: str
    deadline: float | None = None  # on the driver's clock: then the batch is cancelled
    by_id: dict[str, tuple[TaskSpec, int]] = field(default_factory=dict)
    dead_shards: list[str] = field(default_factory=list)


class RayBatch(ResultStream):
    """A batch over Ray actors: an async iterator of its results.

    Args:
        rollouts: each rollout's task and sample index, by rollout id.
        call_s: how long :meth:`view` waits for an actor's answer.
    """

    def __init__(
        self, batch_id: str, rollouts: Mapping[str, tuple[TaskSpec, int]], call_s: float
    ) -> None:
        super().__init__(len(rollouts))
        self.batch_id = batch_id
        self.total = len(rollouts)
        self.cancelled = False
        self.failed = 0
        self._on_cancel: list[Any] = []
        self._rollouts = rollouts
        self._call_s = call_s
        #: Where each rollout runs: its actor and shard (the latest, after a re-run).
        self._where: dict[str, tuple[Any, str]] = {}
        self._results: dict[str, RolloutResult] = {}
        self._placed = anyio.Event()  # set (and replaced) by each place()

    def counts(self) -> BatchCounts:
        """A snapshot for progress displays (phases live in the actors)."""
        done = len(self.delivered)
        return BatchCounts(
            total=self.total,
            queued=0,
            provisioning=0,
            running=self.total - done,
            done=done - self.failed,
            failed=self.failed,
        )

    def deliver(self, result: RolloutResult) -> None:
        if result.rollout_id not in self.delivered:
            self._results[result.rollout_id] = result
            if result.status == "failed":
                self.failed += 1
        super().deliver(result)

    def place(self, rollout_ids: Sequence[str], worker: Any, shard_id: str) -> None:
        """These rollouts run on ``worker``, in ``shard_id``: their views are asked there."""
        for rid in rollout_ids:
            self._where[rid] = (worker, shard_id)
        self._placed.set()
        self._placed = anyio.Event()

    async def view(self, rollout_id: str, *, messages: bool = True) -> RolloutView:
        """What one rollout is doing: asked of its actor while it runs.

        Before it reaches an actor it is ``pending``; once its result is
        in, the view is built from that.

        Raises:
            KeyError: the batch holds no such rollout.
            OperationTimeout: its actor did not answer within ``timeouts.ray_call_s``.
        """
        task, sample = self._rollouts[rollout_id]
        place = self._where.get(rollout_id)
        if place is not None and rollout_id not in self._results:
            worker, shard_id = place
            ray = load_ray()
            try:
                with anyio.fail_after(self._call_s):
                    view: RolloutView | None = await worker.view.remote(
                        shard_id, rollout_id, messages
                    )
            except TimeoutError:
                raise OperationTimeout(
                    f"the Ray actor running rollout {rollout_id} did not answer within"
                    f" {self._call_s:g} s (timeouts.ray_call_s); ask again",
                    operation="view",
                    timeout_s=self._call_s,
                    rollout_id=rollout_id,
                ) from None
            except ray.exceptions.RayActorError:
                view = None  # its actor died: the rollout runs again elsewhere, or is lost
            if view is not None:
                return view
        # Not on an actor yet, or the actor let it go: then its result is in.
        result = self._results.get(rollout_id)
        ids = RolloutIds(self.batch_id, rollout_id, sample, group_id(self.batch_id, task.key))
        if result is None:
            return RolloutView(ids, task.key, Phase.PENDING, 0, (), None)
        transcript = tuple(result.transcript) if messages else ()
        return RolloutView(ids, task.key, Phase.DONE, result.steps, transcript, result)

    async def events(self, rollout_id: str, *, after: int, wait_s: float) -> EventPage:
        """One rollout's live events after ``after``: asked of its actor (which waits
        up to ``wait_s`` for one). Once the actor let it go, only its ``end`` event
        is left, built from its result.

        Raises:
            KeyError: the batch holds no such rollout.
            OperationTimeout: its actor did not answer within ``timeouts.ray_call_s``.
        """
        self._rollouts[rollout_id]  # KeyError: not ours
        place = self._where.get(rollout_id)
        opening = False
        if place is not None:
            worker, shard_id = place
            ray = load_ray()
            try:
                with anyio.fail_after(self._call_s + wait_s):
                    page: EventPage | None = await worker.events.remote(
                        shard_id, rollout_id, after, wait_s
                    )
            except TimeoutError:
                raise OperationTimeout(
                    f"the Ray actor running rollout {rollout_id} did not answer within"
                    f" {self._call_s:g} s (timeouts.ray_call_s); ask again",
                    operation="events",
                    timeout_s=self._call_s,
                    rollout_id=rollout_id,
                ) from None
            except ray.exceptions.RayActorError:
                page = None  # its actor died: the rollout runs again elsewhere, or is lost
            else:
                opening = page is None
            if page is not None:
                return page
        result = self._results.get(rollout_id)
        if result is not None:
            return ended_page(after, result)
        if opening:
            # Its actor does not hold the shard yet (Ray may start this call before
            # run_shard, whose arguments are bigger): ask again soon, not after wait_s.
            await anyio.sleep(min(wait_s, _OPENING_POLL_S))
        else:
            # Not on an actor yet (or again, after its actor died): wait for a placement.
            with anyio.move_on_after(wait_s):
                await self._placed.wait()
        return EventPage((), missed=0, ended=False)

    def cancel(self) -> None:
        """Cancel what is still running on every actor; results keep coming.

        The driver tells the actors within a poll (``_TAKE_WAIT_S`` and its gather window);
        :meth:`aclose` tells them before it returns.
        """
        self.cancelled = True

    async def aclose(self) -> None:
        """Cancel what is still running on every actor; results keep coming."""
        self.cancel()
        for cancel in list(self._on_cancel):
            await cancel()


class RayRolloutPool:
    """A RolloutPool spread over Ray actors. An async context manager.

    Args:
        num_actors: actors to create; each runs its own RolloutPool with
            ``pool.concurrency`` active rollouts. None: one per CPU
            (:func:`default_num_actors` on a local Ray, the cluster's CPUs
            when joining one at ``address``).
        address: a Ray cluster to join (default: join the one this process
            is in, or start a local one).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        api_key: str,
        base_url: str | None = None,
        num_actors: int | None = None,
        address: str | None = None,
        events: Events | None = None,
    ) -> None:
        if num_actors is not None and num_actors < 1:
            raise ValueError("num_actors must be at least 1")
        self.settings = settings
        self.events = events or Events()
        self._api_key = api_key
        self._base_url = base_url
        self._num_actors = num_actors
        self._address = address
        self._started_ray = False
        self.workers: list[Any] = []
        self.alive: list[bool] = []
        self.limiter: Any = None
        self._admission: RemoteAdmission | None = None
        self._tg: TaskGroup | None = None
        self._stack = AsyncExitStack()
        self._provider: FleetProvider | None = None
        #: Per batch id, per event name: rollout ids whose event was emitted.
        self._seen: dict[str, dict[str, set[str]]] = {}
        #: Running batches, and the last ``pool.keep_finished_batches`` drained
        #: ones (as RolloutPool's).
        self.batches = BatchMap[RayBatch](settings.pool.keep_finished_batches)

    async def __aenter__(self) -> Self:
        ray = load_ray()
        async with AsyncExitStack() as stack:
            if not ray.is_initialized():
                ray.init(
                    address=self._address,
                    include_dashboard=False,
                    log_to_driver=False,
                    ignore_reinit_error=True,
                )
                self._started_ray = True
                stack.callback(ray.shutdown)
            if self._num_actors is None:
                # A cluster we joined: its CPUs; a Ray we started here: ours.
                joined = not self._started_ray
                cpus = int(ray.cluster_resources().get("CPU", 0)) if joined else 0
                self._num_actors = cpus or default_num_actors()
            limiter_cls = ray.remote(num_cpus=0, max_concurrency=100_000)(AdmissionHost)
            worker_cls = ray.remote(num_cpus=0, max_concurrency=100_000)(RolloutWorker)
            self.limiter = limiter_cls.remote(self.settings)
            call_s = self.settings.timeouts.ray_call_s
            self._admission = RemoteAdmission(self.limiter, "driver", call_s)
            for n in range(self._num_actors):
                self.workers.append(
                    worker_cls.remote(self.settings, self._api_key, self._base_url, self.limiter, n)
                )
                self.alive.append(True)
            await anyio.to_thread.run_sync(  # actors are up (and importable) before work
                ray.get, [w.pid.remote() for w in self.workers]
            )
            stack.callback(self._kill_actors)
            self._provider = FleetProvider(
                self.settings, self.events, api_key=self._api_key, base_url=self._base_url
            )
            stack.push_async_callback(self._provider.aclose)
            # Entered before the batches' task group: its last look runs after them.
            await stack.enter_async_context(self._admission.followed(self.events))
            self._tg = await stack.enter_async_context(anyio.create_task_group())
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await exit_transparently(self._stack, exc_type, exc, tb)

    @property
    def admission(self) -> RemoteAdmission:
        """The cluster's admission (the limiter actor's): ``state()`` is its gauges
        (as :attr:`RolloutPool.admission`'s), current within a fraction of a second.

        Raises:
            RuntimeError: the pool is not open.
        """
        if self._admission is None:
            raise RuntimeError("the pool is not open: use `async with RayRolloutPool(...)`")
        return self._admission

    @property
    def num_actors(self) -> int:
        """The actors this pool runs (known once it has started)."""
        return len(self.workers) or self._num_actors or default_num_actors()

    def _kill_actors(self) -> None:
        ray = load_ray()
        for worker in [*self.workers, self.limiter]:
            try:
                ray.kill(worker)
            except Exception:  # already dead
                continue

    def run_batch(
        self,
        tasks: Sequence[TaskSpec],
        policy: Policy,
        *,
        samples_per_task: int = 1,
        batch_id: str | None = None,
        deadline_s: float | None = None,
        skip: Collection[str] = (),
        oversample: int | None = None,
    ) -> RayBatch:
        """Start a batch sharded round-robin over the actors (see RolloutPool.run_batch).

        ``oversample`` (default ``pool.oversample``) must be 0: Ray runs every
        sample, as ``fleetroll run --ray`` says.

        Raises:
            ConfigError: ``oversample`` (or ``pool.oversample``) is not 0.
            ValueError: two tasks share a key, or a batch with this id is still running.
            PoolFullError: the batch would take the unfinished rollouts past
                ``pool.max_queued_rollouts``.
        """
        extra = self.settings.pool.oversample if oversample is None else oversample
        if extra:
            given = "pool.oversample" if oversample is None else "oversample"
            raise ConfigError(
                f"{given} = {extra} needs the local pool: oversampling is not supported"
                " on Ray (pass 0, or use RolloutPool)"
            )
        if self._tg is None:
            raise RuntimeError("the pool is not open: use `async with RayRolloutPool(...)`")
        if samples_per_task < 1:
            raise ValueError("samples_per_task must be at least 1")
        check_unique_keys(tasks)
        batch_id = batch_id or uuid.uuid4().hex[:12]
        if batch_id in self.batches and not self.batches[batch_id].finished.is_set():
            raise ValueError(f"batch {batch_id} is already running")
        deadline = None if deadline_s is None else anyio.current_time() + deadline_s
        plan = _Plan(list(tasks), policy, samples_per_task, batch_id, deadline)
        for task in tasks:
            for sample in range(samples_per_task):
                rid = rollout_id(plan.batch_id, task.key, sample)
                if rid not in skip:
                    plan.by_id[rid] = (task, sample)
        check_capacity(self.batches, len(plan.by_id), self.settings.pool.max_queued_rollouts)
        batch = RayBatch(plan.batch_id, plan.by_id, self.settings.timeouts.ray_call_s)
        ids = list(plan.by_id)
        live = [n for n, ok in enumerate(self.alive) if ok]
        shards = [
            _Shard(f"{plan.batch_id}-{n}-{uuid.uuid4().hex[:6]}", n, ids[i :: len(live)])
            for i, n in enumerate(live)
        ]
        self.batches.add(batch)
        self._tg.start_soon(self._run, plan, batch, [s for s in shards if s.ids])
        return batch

    async def _run(self, plan: _Plan, batch: RayBatch, shards: list[_Shard]) -> None:
        try:
            async with anyio.create_task_group() as tg:
                for shard in shards:
                    tg.start_soon(self._drive, plan, batch, shard, tg)
        finally:
            # Once more at the end: a create a dead worker had in flight may
            # have made its instance after the first sweep.
            with anyio.CancelScope(shield=True):
                for run_id in plan.dead_shards:
                    await self._provider_sweep(run_id)
            for rid in plan.by_id:
                if rid not in batch.delivered:  # never reached an actor: still one result
                    batch.deliver(_lost(plan, batch, rid, "the rollout was lost with its worker"))
            batch.close_stream()
            self._seen.pop(plan.batch_id, None)

    def forget(self, batch_id: str) -> None:
        """Let a finished batch go (see :meth:`RolloutPool.forget`).

        Raises:
            ValueError: the batch is still running.
        """
        self.batches.forget(batch_id)

    async def _drive(self, plan: _Plan, batch: RayBatch, shard: _Shard, tg: TaskGroup) -> None:
        ray = load_ray()
        worker = self.workers[shard.worker]
        worker.run_shard.remote(
            shard.shard_id, plan.tasks, plan.policy, plan.samples, plan.batch_id, shard.ids
        )
        batch.place(shard.ids, worker, shard.shard_id)

        told = False

        async def cancel() -> None:
            nonlocal told
            if not told:
                told = True
                with suppress(ray.exceptions.RayActorError):
                    await worker.cancel.remote(shard.shard_id)

        batch._on_cancel.append(cancel)
        try:
            while True:
                if plan.deadline is not None and anyio.current_time() >= plan.deadline:
                    batch.cancel()
                if batch.cancelled:
                    await cancel()
                try:
                    results, events, done, error = await worker.take.remote(
                        shard.shard_id, _TAKE_WAIT_S, _TAKE_GATHER_S
                    )
                except ray.exceptions.RayActorError:
                    await self._worker_died(plan, batch, shard, tg)
                    return
                for event in events:
                    self._reemit(event)
                for result in results:
                    batch.deliver(result)
                if done:
                    if error:
                        for rid in shard.ids:
                            if rid not in batch.delivered:
                                batch.deliver(_lost(plan, batch, rid, f"worker error: {error}"))
                    worker.forget.remote(shard.shard_id)  # every result is in: views come from them
                    return
        finally:
            batch._on_cancel.remove(cancel)

    async def _provider_sweep(self, run_id: str) -> None:
        assert self._provider is not None
        await self._provider.sweep(run_id)

    def _reemit(self, event: Event) -> None:
        rid = event.attributes.get("rollout_id")
        if rid is not None and event.name in ("fleet_rollout_started", "fleet_rollout_completed"):
            # A rollout re-run after its worker died may have had either event
            # shipped already: each is emitted once per rollout, first wins.
            batch_seen = self._seen.setdefault(str(event.attributes.get("batch_id")), {})
            seen = batch_seen.setdefault(event.name, set())
            if rid in seen:
                return
            seen.add(rid)
        self.events.emit(event.name, level=event.level, **dict(event.attributes))

    async def _worker_died(
        self, plan: _Plan, batch: RayBatch, shard: _Shard, tg: TaskGroup
    ) -> None:
        self.alive[shard.worker] = False
        plan.dead_shards.append(shard.shard_id)
        self.events.emit(
            "fleet_worker_lost",
            level="error",
            batch_id=plan.batch_id,
            worker=shard.worker,
            shard_id=shard.shard_id,
        )
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self.settings.timeouts.ray_call_s):
                await self.limiter.release_all.remote(holder(shard.worker))
            await self._provider_sweep(shard.shard_id)
        missing = [rid for rid in shard.ids if rid not in batch.delivered]
        live = [n for n, ok in enumerate(self.alive) if ok]
        if not missing:
            return
        if not live or batch.cancelled:
            why = "its worker died" + ("" if live else " and no worker is left")
            for rid in missing:
                batch.deliver(_lost(plan, batch, rid, why))
            return
        retry = _Shard(f"{plan.batch_id}-{live[0]}-{uuid.uuid4().hex[:6]}", live[0], missing)
        tg.start_soon(self._drive, plan, batch, retry, tg)


def _lost(plan: _Plan, batch: RayBatch, rid: str, why: str) -> RolloutResult:
    """The result of a rollout no worker could finish: cancelled if its batch was."""
    task, sample = plan.by_id[rid]
    if batch.cancelled:
        reason, why = FailureReason.CANCELLED, f"the batch was cancelled ({why})"
    else:
        reason = FailureReason.INIT_ERROR
    return RolloutResult(
        rollout_id=rid,
        batch_id=plan.batch_id,
        task_key=task.key,
        sample_index=sample,
        group_id=group_id(plan.batch_id, task.key),
        env_key=task.env_key,
        env_version=task.env_version,
        modality=task.modality,
        status="failed",
        failure_reason=reason,
        error=why,
    )

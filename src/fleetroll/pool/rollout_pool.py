"""RolloutPool: batches of rollouts for a training controller.

::

    async with RolloutPool(settings, api_key=..., base_url=...) as pool:
        batch = pool.run_batch(tasks, policy, samples_per_task=8)
        async for result in batch:      # each result as soon as its rollout ends
            ...

A batch always yields exactly ``len(tasks) * (samples_per_task + oversample)``
results, one per rollout id: a crash, a timeout or cancellation each still
yields one. :meth:`Batch.groups` yields each task's group of samples as soon
as it is complete (:mod:`fleetroll.training.groups`).

:meth:`RolloutPool.run_eval` evaluates a policy (``k`` samples per task, no
oversampling) beside the training batches, with its own share of the pool
(``max_concurrency``) and its own policy version tag, and returns its pass@k
report (:mod:`fleetroll.evaluation`).

An asynchronous RL trainer sets :attr:`RolloutPool.policy_version` after each
weight sync (recorded on turns; ``pool.max_staleness`` flags or restarts
rollouts too far behind) and holds new policy calls with
:meth:`RolloutPool.policy_paused` while it swaps weights.

Limits, each a ``CapacityLimiter`` named for what it protects:

* ``instances``: instances held at once (provisioning, waiting or active):
  ``concurrency + max_concurrent_creates``, so instances for waiting rollouts
  are created while others run (provisioning is pipelined);
* ``active``: rollouts acting at once (``pool.concurrency``); a rollout's
  agent clock starts when it gets its slot;
* creates (concurrency and rate), instance caps, Fleet's account limit and
  per-environment circuit breakers: :attr:`RolloutPool.admission`
  (:mod:`fleetroll.environments.admission`), shared by every batch of the pool;
* ``pool.max_queued_rollouts``: rollouts not yet finished across batches; a
  batch that would pass it is refused with :class:`~fleetroll.errors.PoolFullError`.

A pool runs for as long as its controller (days, for a training run), so it
does not keep what it has delivered: ``pool.batches`` holds the running
batches and at most ``pool.keep_finished_batches`` finished ones whose results
were all read, the oldest forgotten first (:meth:`RolloutPool.forget` lets one
go at once).

The pool runs its rollouts only through its executor
(:class:`~fleetroll.pool.executor.Executor`, by default a
:class:`~fleetroll.pool.executor.LocalExecutor` in this process): everything
above is the pool's, whatever the executor.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from types import TracebackType
from typing import Self

import anyio
from anyio.abc import TaskGroup

from fleetroll._internal.exit_stack import exit_transparently
from fleetroll.environments.admission import Admission, AdmissionController, CreateLimits
from fleetroll.environments.fleet.traces import TraceUploader, open_trace_uploader
from fleetroll.environments.provider import Provider
from fleetroll.errors import ConfigError
from fleetroll.evaluation import DEFAULT_SUCCESS_THRESHOLD, EvalReport, eval_batch, evaluate
from fleetroll.policies import Policy
from fleetroll.policies.gate import PolicyGate
from fleetroll.pool.batch import (
    Batch,
    BatchCounts,
    BatchMap,
    ResultStream,
    check_capacity,
    check_unique_keys,
    group_id,
    rollout_id,
)
from fleetroll.pool.executor import Executor, ExecutorContext, LocalExecutor, RolloutHandle
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout.branching import BranchPolicy, prefix_of
from fleetroll.rollout.engine import RolloutEngine
from fleetroll.rollout.env_session import EnvSession
from fleetroll.rollout.machine import Agent, RolloutIds
from fleetroll.settings import Settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Events
from fleetroll.training.groups import Group, GroupTracker, Tree
from fleetroll.training.weight_sync import abort_generations

__all__ = [
    "Batch",
    "BatchCounts",
    "BatchMap",
    "Group",
    "ResultStream",
    "RolloutPool",
    "Tree",
    "TreeRun",
    "check_capacity",
    "check_unique_keys",
    "group_id",
    "rollout_id",
]


class TreeRun:
    """A rollout tree as it runs (:meth:`RolloutPool.start_tree`): an async
    iterator of its results, the root first, then each branch as it ends.

    Its root batch starts when it is made; its branches once the root reached
    the branch point. :meth:`cancel` (or leaving ``async with run``) stops it:
    what runs ends ``cancelled``, and no branch starts after it. Read to its
    end, :attr:`tree` holds the :class:`Tree` (``groups`` included).
    """

    def __init__(
        self,
        pool: RolloutPool,
        task: TaskSpec,
        policy: Policy,
        *,
        branch_at: int,
        width: int,
        tree_id: str,
        deadline_s: float | None,
    ) -> None:
        self.tree_id = tree_id
        self.branch_at = branch_at
        self.width = width
        #: The root's batch (one rollout) and the branches' (``width`` rollouts).
        self.root_batch_id = f"{tree_id}-root"
        self.branches_batch_id = f"{tree_id}-b{branch_at}"
        #: The tree once read to its end (None before).
        self.tree: Tree | None = None
        self._pool = pool
        self._task = task
        self._policy = policy
        self._deadline_s = deadline_s
        self._began = anyio.current_time()
        self._cancelled = False
        self._root: RolloutResult | None = None
        self._branches: list[RolloutResult] = []
        root_task = task.model_copy(update={"max_steps": branch_at})
        #: Its batches so far: the root's, then the branches'.
        self.batches: list[Batch] = [
            pool.run_batch(
                [root_task],
                policy,
                batch_id=self.root_batch_id,
                oversample=0,
                deadline_s=deadline_s,
            )
        ]

    def cancel(self) -> None:
        """Cancel what runs; no branch starts after this. Every result still arrives."""
        self._cancelled = True
        self.batches[-1].cancel()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> RolloutResult:
        """The root's result, then (from the branch point) each branch's.

        Raises:
            PoolFullError: the branches would take the pool past
                ``pool.max_queued_rollouts`` (other batches filled it meanwhile).
        """
        if self._root is None:
            [root] = await self.batches[0].results()
            self._root = root
            if (
                self._cancelled
                or root.failure_reason is not FailureReason.MAX_STEPS
                or root.steps < self.branch_at
            ):
                self.tree = Tree(root=root)  # it ended before the branch point, or was cancelled
            return root
        if self.tree is None and self._cancelled and len(self.batches) == 1:
            self.tree = Tree(root=self._root)  # cancelled once the root had ended
        if self.tree is not None:
            raise StopAsyncIteration
        if len(self.batches) == 1:
            self.batches.append(self._branch(self._root))
        batch = self.batches[1]
        try:
            result = await anext(batch)
        except StopAsyncIteration:
            groups = [g async for g in batch.groups()]
            self.tree = Tree(root=self._root, branches=self._branches, groups=groups)
            raise
        self._branches.append(result)
        return result

    def _branch(self, root: RolloutResult) -> Batch:
        """Start the branches from ``root``'s prefix, within what the deadline left."""
        spent = anyio.current_time() - self._began
        left = None if self._deadline_s is None else max(0.0, self._deadline_s - spent)
        return self._pool.run_batch(
            [self._task],
            BranchPolicy(prefix_of(root, self.branch_at), self._policy),
            samples_per_task=self.width,
            batch_id=self.branches_batch_id,
            oversample=0,
            deadline_s=left,
        )


class RolloutPool:
    """Runs batches of rollouts under shared limits. An async context manager.

    ``provider`` replaces Fleet (the emulator's or the real one) with another
    :class:`~fleetroll.environments.provider.Provider` (tests use the in-memory
    :class:`~fleetroll.testing.fake_provider.FakeProvider`); the pool closes it.
    ``admission`` replaces the pool's own admission controller (a Ray actor's
    pools share the cluster's: :mod:`fleetroll.pool.ray.admission`).
    ``executor`` runs the rollouts (default: a
    :class:`~fleetroll.pool.executor.LocalExecutor` over ``provider``, or Fleet);
    the pool opens and closes it.

    ``api_key`` is Fleet's: a pool that runs only ``mcp`` tasks (each with an
    ``environment``) needs none, and without one a batch with a Fleet task is
    refused when it is started.

    Raises:
        ConfigError: (on entering) ``traces.upload`` is on and there is no
            ``api_key`` (traces go to Fleet).
        ValueError: both ``executor`` and ``provider`` are given (the
            provider is the local executor's).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        events: Events | None = None,
        provider: Provider | None = None,
        admission: Admission | None = None,
        executor: Executor | None = None,
        run_id: str | None = None,
    ) -> None:
        if executor is not None and provider is not None:
            raise ValueError("pass provider= to the executor, not to a pool given executor=")
        self.settings = settings
        #: This process's run id (``serve``'s): instances are tagged
        #: ``{run_id}-{batch_id}``, so one ``collect(run_id)`` finds them all.
        #: None: tagged with the batch id alone (``run``: its journal's).
        self.run_id = run_id
        self._local: LocalExecutor | None = None
        if executor is None:
            self._local = executor = LocalExecutor(
                settings, api_key=api_key, base_url=base_url, provider=provider
            )
        self._executor: Executor = executor
        self.events = events or Events()
        self._api_key = api_key
        self._base_url = base_url
        self._open = False
        self._traces: TraceUploader | None = None
        self._tg: TaskGroup | None = None
        self._stack: AsyncExitStack | None = None
        self._room = anyio.CapacityLimiter(1)  # sized by the executor once open
        concurrency = settings.pool.concurrency
        self.active = anyio.CapacityLimiter(concurrency)
        self.instances = anyio.CapacityLimiter(
            concurrency + settings.provisioning.max_concurrent_creates
        )
        #: Create limits, instance caps, Fleet's account limit, per-environment
        #: breakers: this pool's own, or ``admission`` (a Ray cluster's,
        #: :mod:`fleetroll.pool.ray.admission`).
        self.admission: Admission = admission or AdmissionController(
            settings.admission, CreateLimits.from_settings(settings.provisioning), self.events
        )
        #: The policy version recorded on turns, and the trainer's pause on policy calls.
        self.policy_gate = PolicyGate(mode=settings.policy.weight_update)
        #: Running batches, and the last ``pool.keep_finished_batches`` drained ones.
        self.batches = BatchMap[Batch](settings.pool.keep_finished_batches)

    @property
    def executor(self) -> Executor:
        """What runs the pool's rollouts."""
        return self._executor

    @property
    def engine(self) -> RolloutEngine:
        """The engine of this process (its provider, its redactor): the local
        executor's, or the one an executor running rollouts elsewhere keeps here
        for sessions and checks (``RayExecutor.engine``).

        Raises:
            RuntimeError: the pool is not open, or nothing of it runs in this process.
        """
        if self._local is not None:
            return self._local.engine
        here: RolloutEngine | None = getattr(self._executor, "engine", None)
        if here is None:
            raise RuntimeError("the pool's rollouts do not run in this process")
        return here

    @property
    def policy_version(self) -> int:
        """The policy version recorded on turns from now on (the trainer sets it).

        Set here, it is on every policy call that starts in this process from
        now on; Ray actors get it within ``timeouts.ray_call_s``. Await
        :meth:`set_policy_version` (or set it in :meth:`policy_paused`) to know
        that every call starting after it, on every actor, records it.

        Raises:
            TypeError: (setting) the value is not an int.
        """
        return self.policy_gate.version

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        self.policy_gate.version = value

    async def set_policy_version(self, value: int) -> None:
        """Set :attr:`policy_version`; return once every place policy calls start
        in has it (every live Ray actor confirmed it): each call that starts
        after this returns records ``value``.

        Raises:
            TypeError: the value is not an int.
            OperationTimeout: a live Ray actor did not confirm within
                ``timeouts.ray_call_s`` (the version is set: it reaches that
                actor with its next rollout, or when it answers).
        """
        aborting = self.policy_gate.mode == "abort" and not self.policy_gate.paused
        self.policy_gate.version = value
        await self._executor.gate_synced()
        if aborting:  # a bump outside a pause: the calls running now resume on it
            await self._abort_generations()

    async def _abort_generations(self) -> None:
        """``policy.weight_update = "abort"``: every generation running on the policy
        servers stops (SGLang's ``/abort_request``) and its call resumes from its
        partial output once the policy calls may start again."""
        key = self.settings.openai_api_key
        await abort_generations(
            self.settings.policy.servers,
            api_key=key.get_secret_value() if key is not None else None,
            timeout_s=self.settings.timeouts.weight_sync_s,
        )

    @asynccontextmanager
    async def policy_paused(self) -> AsyncIterator[None]:
        """Hold new policy calls for the block (a weight swap); pauses nest.

        Calls already running finish; tool calls, provisioning and verification
        go on. The wait is charged to no rollout deadline, only to the batch's
        ``deadline_s``. Once the block is entered no new call starts anywhere
        (every Ray actor confirmed the pause), a version set in the block is on
        every call that starts after it (every actor confirmed it before the
        pause ends), and once the block is left calls start again everywhere
        (every actor confirmed the pause's end, unless another pause holds).

        With ``policy.weight_update = "abort"`` the generations running on the
        policy servers are aborted once the pause holds, each call resuming from
        its partial output after the block; with ``"in_flight"`` nothing is held
        (the servers take the weights between tokens) and the block only marks
        an update.

        Raises:
            OperationTimeout: a live Ray actor did not confirm within
                ``timeouts.ray_call_s``.
            WeightSyncError: (``abort``) a policy server did not take the abort.
        """
        async with self.policy_gate.paused_calls():
            await self._executor.gate_synced()
            if self.policy_gate.mode == "abort":
                await self._abort_generations()
            try:
                yield
            finally:
                with anyio.CancelScope(shield=True):
                    await self._executor.gate_synced()
        await self._executor.gate_synced()

    async def __aenter__(self) -> Self:
        if self._api_key is None and self.settings.traces.upload:
            raise ConfigError(
                "traces.upload is on but the pool has no Fleet api_key to upload with:"
                " pass api_key= (FLEET_API_KEY) or set traces.upload = false"
            )
        stack = AsyncExitStack()
        async with stack:
            context = ExecutorContext(
                self.events, self.admission, self.policy_gate, self.active, self.instances
            )
            await stack.enter_async_context(self._executor.open(context))
            #: Rollouts under way across batches: no more than the executor has room for.
            self._room = anyio.CapacityLimiter(self._executor.capacity)
            # Entered before the batches' task group: its bounded flush runs after them.
            self._traces = await stack.enter_async_context(
                open_trace_uploader(
                    self.settings.traces,
                    self.events,
                    connect_s=self.settings.timeouts.mcp_connect_s,
                    api_key=self._api_key or "",
                    base_url=self._base_url,
                )
            )
            self._tg = await stack.enter_async_context(anyio.create_task_group())
            stack.push_async_callback(self._cancel_all)
            self._stack = stack.pop_all()
        self._open = True
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._stack is not None
        try:
            await exit_transparently(self._stack, exc_type, exc, tb)
        finally:
            self._open = False
            self._tg = None

    async def _cancel_all(self) -> None:
        for batch in self.batches.values():
            batch.cancel()

    def tag(self, batch_id: str) -> str:
        """Fleet's ``run_id`` of ``batch_id``'s instances: the batch id, under the
        pool's :attr:`run_id` if it has one."""
        return batch_id if self.run_id is None else f"{self.run_id}-{batch_id}"

    def forget(self, batch_id: str) -> None:
        """Let a finished batch go: ``pool.batches`` no longer holds it (nor its transcripts).

        Unknown ids are ignored (the pool may have forgotten it already).

        Raises:
            ValueError: the batch is still running.
        """
        self.batches.forget(batch_id)

    def run_batch(
        self,
        tasks: Sequence[TaskSpec],
        policy: Policy,
        *,
        samples_per_task: int = 1,
        batch_id: str | None = None,
        deadline_s: float | None = None,
        skip: Collection[str] = (),
        only: Collection[str] | None = None,
        run_id: str | None = None,
        oversample: int | None = None,
        previous: Sequence[RolloutResult] = (),
        groups_target: int | None = None,
        max_in_flight: int | None = None,
        policy_version: int | None = None,
    ) -> Batch:
        """Start a batch; iterate the returned :class:`Batch` for its results.

        Args:
            samples_per_task: rollouts per task (a group, for GRPO-style training).
            batch_id: reuse an id to resume a batch (rollout ids are derived from it).
            deadline_s: cancel whatever is still running after this many seconds.
            skip: rollout ids already finished (a resumed batch runs only the rest).
            only: run just these rollout ids (a shard of a larger batch).
            run_id: Fleet's ``run_id`` for the instances (default: :meth:`tag`);
                instances left behind are swept by it when the batch ends.
            oversample: extra rollouts per group (default ``pool.oversample``),
                sample indices ``samples_per_task`` and up: they stand in, in
                that order, for samples that end unscored (infrastructure
                failures), not for slow ones; once a group's kept samples are
                decided, the extras still running end as ``superseded``
                (:mod:`fleetroll.training.groups`).
            previous: results of this batch's rollouts from an earlier run (a
                resume): they are not run again and count in their groups.
            groups_target: straggler cut-off by whole groups: once this many
                groups are complete, every rollout of the other groups is
                stopped (``superseded``) and those groups come with ``cut``
                true (:mod:`fleetroll.training.groups`: its bias). None: every
                group runs to its end.
            max_in_flight: at most this many of the batch's rollouts run at
                once (provisioning to release), within the pool's own limits:
                a batch's share of the pool beside others (an evaluation beside
                training batches). A cap, not a reservation: every batch's
                rollouts take the pool's slots as they come.
            policy_version: a tag recorded on every result of the batch
                (``RolloutResult.policy_version``): the policy version it runs,
                for an evaluation. Turns record the pool's version as ever.

        Raises:
            ValueError: ``samples_per_task`` is below 1, ``oversample`` below 0,
                ``groups_target`` not between 1 and the number of tasks,
                ``max_in_flight`` below 1, two tasks share a key, or a batch
                with this id is still running.
            PoolFullError: the batch would take the pool's unfinished
                rollouts past ``pool.max_queued_rollouts``.
            ConfigError: a task runs on Fleet and the pool has no Fleet ``api_key``.
        """
        if self._tg is None:
            raise RuntimeError("the pool is not open: use `async with RolloutPool(...)`")
        self._executor.check_tasks(tasks)
        if samples_per_task < 1:
            raise ValueError("samples_per_task must be at least 1")
        extra = self.settings.pool.oversample if oversample is None else oversample
        if extra < 0:
            raise ValueError("oversample must be at least 0")
        if groups_target is not None and not 1 <= groups_target <= len(tasks):
            raise ValueError(
                f"groups_target must be between 1 and the batch's {len(tasks)} tasks (groups),"
                f" not {groups_target}"
            )
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        check_unique_keys(tasks)
        batch_id = batch_id or uuid.uuid4().hex[:12]
        if batch_id in self.batches and not self.batches[batch_id].finished.is_set():
            raise ValueError(f"batch {batch_id} is already running")
        skip = set(skip) | {r.rollout_id for r in previous}
        tag = run_id or self.tag(batch_id)
        rollouts = []
        members: dict[str, tuple[str, list[str]]] = {}
        ranks: dict[str, int] = {}
        for task in tasks:
            members[group_id(batch_id, task.key)] = (task.key, [])
            for sample in range(samples_per_task + extra):
                rid = rollout_id(batch_id, task.key, sample)
                if rid in skip or (only is not None and rid not in only):
                    continue
                ids = RolloutIds(
                    batch_id=batch_id,
                    rollout_id=rid,
                    sample_index=sample,
                    group_id=group_id(batch_id, task.key),
                )
                members[ids.group_id or ""][1].append(rid)
                ranks[rid] = sample
                rollouts.append(self._executor.rollout(task, ids, run_id=tag))
        # A group of this batch is one with a rollout here or a result from before
        # (a shard, ``only``, holds some groups only).
        before = {r.group_id for r in previous}
        members = {gid: m for gid, m in members.items() if m[1] or gid in before}
        check_capacity(self.batches, len(rollouts), self.settings.pool.max_queued_rollouts)
        batch = Batch(
            batch_id,
            rollouts,
            skipped=len(tasks) * (samples_per_task + extra) - len(rollouts),
            run_id=tag,
            tracker=GroupTracker(
                batch_id, samples_per_task, members, previous, ranks=ranks, target=groups_target
            ),
            max_in_flight=max_in_flight,
            policy_version=policy_version,
        )
        if deadline_s is not None:
            batch.scope.deadline = anyio.current_time() + deadline_s
        batch.traces = self._traces
        self.batches.add(batch)
        self._tg.start_soon(self._run_batch, batch, policy)
        return batch

    async def run_eval(
        self,
        tasks: Sequence[TaskSpec],
        policy: Policy,
        *,
        k: int,
        max_concurrency: int | None = None,
        policy_version: int | None = None,
        success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
        batch_id: str | None = None,
        deadline_s: float | None = None,
    ) -> EvalReport:
        """Evaluate ``policy`` on ``tasks``: ``k`` samples each, then pass@1 … pass@k.

        A batch of ``k`` samples per task without oversampling (a sample the
        platform failed is counted apart, never replaced: the report says how
        many each task lost), run beside the pool's other batches. Returns when
        every rollout has ended (:func:`fleetroll.evaluation.evaluate`).

        Args:
            k: samples per task, and the largest j of pass@j.
            max_concurrency: at most this many of its rollouts at once (its
                share of the pool beside training batches); default: the pool's limits only.
            policy_version: the tag of the policy evaluated, recorded on every
                result and on the report.
            success_threshold: the reward at or above which a sample is a success.
            batch_id: the batch's id (default ``eval-`` and 12 random hex digits).
            deadline_s: cancel what is still running after this long (the
                cancelled samples are unscored).

        Raises:
            ValueError: ``k`` or ``max_concurrency`` below 1, or as :meth:`run_batch`.
            PoolFullError, ConfigError: as :meth:`run_batch`.
        """
        options = eval_batch(k, max_concurrency, policy_version, batch_id, deadline_s)
        batch = self.run_batch(tasks, policy, **options)
        async with batch:
            results = await batch.results()
        return evaluate(
            results, k=k, success_threshold=success_threshold, policy_version=policy_version
        )

    async def run_tree(
        self,
        task: TaskSpec,
        policy: Policy,
        *,
        branch_at: int,
        width: int,
        tree_id: str | None = None,
        deadline_s: float | None = None,
    ) -> Tree:
        """Sample a tree: one rollout to step ``branch_at``, then ``width`` branches from there.

        The root runs its first ``branch_at`` steps (model turns with their tool
        calls and answers: the shared prefix) and stops there (``max_steps``).
        Each branch is a rollout of ``task`` on a fresh or reset instance (the
        pool's instance reuse and warm pool serve them) that first replays the
        prefix's tool calls, checking every answer equal to the root's, then
        samples on with ``policy`` from the prefix's conversation. An answer that
        differs ends that branch as ``replay_diverged``, not scored
        (:mod:`fleetroll.rollout.branching`). Deterministic replay needs a task
        whose reset restores one state: a ``seed`` and ``timestamp``.

        The root is batch ``{tree_id}-root`` (one rollout), the branches batch
        ``{tree_id}-b{branch_at}``, whose one group is the branch point's.
        Returns when every branch has ended; :meth:`start_tree` gives the
        results as they end.

        Raises:
            ValueError: ``branch_at`` or ``width`` below 1, or ``policy`` is an
                agent of its own (:class:`~fleetroll.rollout.machine.Agent`).
            PoolFullError, ConfigError: as :meth:`run_batch`.
        """
        run = self.start_tree(
            task, policy, branch_at=branch_at, width=width, tree_id=tree_id, deadline_s=deadline_s
        )
        async with run:
            async for _ in run:
                pass
        assert run.tree is not None  # read to its end
        return run.tree

    def start_tree(
        self,
        task: TaskSpec,
        policy: Policy,
        *,
        branch_at: int,
        width: int,
        tree_id: str | None = None,
        deadline_s: float | None = None,
    ) -> TreeRun:
        """Start a tree (as :meth:`run_tree`), its root now: its results as they end.

        Iterate the :class:`TreeRun` for the root, then each branch as it ends;
        read to its end, its ``tree`` is what :meth:`run_tree` returns.

        Raises:
            ValueError, PoolFullError, ConfigError: as :meth:`run_tree`.
        """
        if branch_at < 1:
            raise ValueError(f"branch_at must be at least 1 (a step to share), not {branch_at}")
        if width < 1:
            raise ValueError(f"width must be at least 1, not {width}")
        if isinstance(policy, Agent):
            raise ValueError(
                "run_tree replays the prefix in fleetroll's own loop: an agent of its own"
                " (an agent command) cannot be branched; give a policy (scripted or openai)"
            )
        return TreeRun(
            self,
            task,
            policy,
            branch_at=branch_at,
            width=width,
            tree_id=tree_id or uuid.uuid4().hex[:12],
            deadline_s=deadline_s,
        )

    async def _run_batch(self, batch: Batch, policy: Policy) -> None:
        self.events.emit(
            "fleet_batch_started",
            batch_id=batch.batch_id,
            rollouts=batch.total,
            # The whole batch, with rollouts an earlier run (resume) or another
            # shard has: what the dashboard measures progress against.
            total=batch.total + batch.skipped,
            concurrency=self.settings.pool.concurrency,
        )
        share = anyio.CapacityLimiter(batch.max_in_flight) if batch.max_in_flight else None
        try:
            with batch.scope:
                async with anyio.create_task_group() as tg:
                    # A rollout gets its task once the executor has room for it:
                    # a batch of 10,000 holds thousands of waiting handles, not tasks.
                    for rollout in batch.rollouts:
                        # (and within the batch's share, ``max_in_flight``, first:
                        # a batch held by its share takes no room from the others).
                        if rollout.result is not None:  # its group ended it before it started
                            continue
                        if share is not None:
                            await _acquire(share, rollout)
                        await _acquire(self._room, rollout)
                        if rollout.result is not None:  # ... while it waited for room
                            self._let_go(rollout, share)
                            continue
                        batch.started.add(rollout.ids.rollout_id)
                        tg.start_soon(self._one, batch, rollout, policy, share)
        finally:
            # Rollouts cancelled before they started still get their result.
            for rollout in batch.rollouts:
                if rollout.result is None:
                    reason, error = rollout.stop_reason or (
                        FailureReason.CANCELLED,
                        "the batch was cancelled before this rollout started",
                    )
                    batch.deliver(rollout.never_started(reason, error))
            batch.close_stream()
            # Instances of this batch no rollout knows about carry its run_id.
            await self._executor.sweep(batch.run_id)
            statuses = Counter(
                (r.result.failure_reason.value if r.result.failure_reason else "completed")
                for r in batch.rollouts
                if r.result is not None
            )
            self.events.emit(
                "fleet_batch_completed",
                batch_id=batch.batch_id,
                rollouts=batch.total,
                counts=dict(statuses),
            )

    async def _one(
        self,
        batch: Batch,
        rollout: RolloutHandle,
        policy: Policy,
        share: anyio.CapacityLimiter | None,
    ) -> None:
        try:
            await rollout.execute(policy)
        except anyio.get_cancelled_exc_class():
            if rollout.result is not None:
                batch.deliver(rollout.result)
            raise
        finally:
            self._let_go(rollout, share)
        assert rollout.result is not None
        batch.deliver(rollout.result)

    def _let_go(self, rollout: RolloutHandle, share: anyio.CapacityLimiter | None) -> None:
        """Give back the room (and the batch's share) a rollout held."""
        self._room.release_on_behalf_of(rollout)
        if share is not None:
            share.release_on_behalf_of(rollout)

    @asynccontextmanager
    async def session(
        self, task: TaskSpec, *, batch_id: str | None = None, sample_index: int = 0
    ) -> AsyncIterator[EnvSession]:
        """An env-style session (``reset``/``step``/``close``) under the pool's limits."""
        batch_id = batch_id or "sessions"
        ids = RolloutIds(
            batch_id=batch_id,
            sample_index=sample_index,
            rollout_id=uuid.uuid4().hex,
            group_id=group_id(batch_id, task.key),
        )
        if not self._open:
            raise RuntimeError("the pool is not open: use `async with RolloutPool(...)`")
        async with self._executor.session(task, ids, run_id=self.tag(batch_id)) as env:
            yield env


async def _acquire(limiter: anyio.CapacityLimiter, rollout: RolloutHandle) -> None:
    """Take a token of ``limiter`` for ``rollout``, waiting only when there is
    none: while there is room, a batch's rollouts all start in one go, in order,
    as if there were no limiter (a wait would let each run ahead of the next)."""
    try:
        limiter.acquire_on_behalf_of_nowait(rollout)
    except anyio.WouldBlock:
        await limiter.acquire_on_behalf_of(rollout)

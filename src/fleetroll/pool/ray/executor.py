"""A pool's rollouts on Ray actors: :class:`RayExecutor`, each actor a LocalExecutor.

What ``--ray`` opens (:func:`fleetroll.pool.batch_pool.open_batch_pool`). The pool
is the driver's one :class:`~fleetroll.pool.rollout_pool.RolloutPool` (ids, groups,
oversampling, resume, the policy gate, the read model); each actor
(:class:`ExecutorWorker`) runs single rollouts on a
:class:`~fleetroll.pool.executor.LocalExecutor` and answers their views and live
events. The driver mirrors its policy gate (version and pauses) onto every
actor and passes the actors' telemetry on. A dead actor's admission places go
back, and its rollouts run again once on another actor. Sessions run on the
driver (each is one task of this process for its whole life). With
``traces.upload``, a rollout's transcript comes back with its result, redacted
on its actor, and its trace is posted from the driver.

::

    async with ray_pool(settings, api_key=..., num_actors=2) as pool:
        batch = pool.run_batch(tasks, policy, samples_per_task=8, oversample=2)
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager, suppress
from typing import Any

import anyio

from fleetroll._internal.excerpts import shorten
from fleetroll.environments.admission import CreateLimits
from fleetroll.environments.fleet.provider import FleetProvider
from fleetroll.environments.fleet.traces import redacted
from fleetroll.environments.mixed import require_fleet_key
from fleetroll.errors import OperationTimeout
from fleetroll.policies import Policy
from fleetroll.policies.gate import PolicyGate
from fleetroll.policies.openai import PolicyRecipe
from fleetroll.pool.assembly import fleet_provider
from fleetroll.pool.executor import ExecutorContext, LocalExecutor, RolloutHandle
from fleetroll.pool.ray.actors import PolicyHost, _Buffer, default_num_actors, holder, load_ray
from fleetroll.pool.ray.admission import AdmissionHost, RemoteAdmission
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout.agent_command import AgentHost, AgentRecipe
from fleetroll.rollout.engine import RolloutEngine
from fleetroll.rollout.env_session import EnvSession
from fleetroll.rollout.events import EventPage, ended_page
from fleetroll.rollout.phases import Phase, RolloutView
from fleetroll.rollout.progress import RolloutIds
from fleetroll.settings import Settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Event, Events, Redactor
from fleetroll.tools.session import describe

__all__ = ["ExecutorWorker", "RayExecutor", "planned_actors", "ray_pool"]

_log = logging.getLogger(__name__)
#: How long a driver's take of an actor's telemetry waits for an event.
_TAKE_WAIT_S = 0.5
#: Events passed on once per rollout, even when it ran again after its actor died.
_ONCE = ("fleet_rollout_started", "fleet_rollout_completed")


class ExecutorWorker:
    """A Ray actor's side: single rollouts on a LocalExecutor, views, events, the gate."""

    def __init__(
        self,
        settings: Settings,
        api_key: str | None,
        base_url: str | None,
        limiter: Any,
        index: int,
    ) -> None:
        self._settings = settings
        self._buffer = _Buffer(index)
        admission = RemoteAdmission(
            limiter,
            holder(index),
            settings.timeouts.ray_call_s,
            limits=CreateLimits.from_settings(settings.provisioning),
        )
        self._gate = PolicyGate(mode=settings.policy.weight_update)
        self._pause: AsyncExitStack | None = None
        #: The driver's gate generation last mirrored (older states are dropped).
        self._generation = -1
        concurrency = settings.pool.concurrency
        self._context = ExecutorContext(
            # telemetry.tool_calls honoured here: an actor does not ship records
            # the driver's telemetry would drop.
            Events(
                [self._buffer],
                off=() if settings.telemetry.tool_calls else ("fleet_tool_call",),
            ),
            admission,
            self._gate,
            anyio.CapacityLimiter(concurrency),
            anyio.CapacityLimiter(concurrency + settings.provisioning.max_concurrent_creates),
        )
        self._executor = LocalExecutor(settings, api_key=api_key, base_url=base_url)
        #: Whether results go with their transcripts (for their traces).
        self._traces = settings.traces.upload
        self._stack: AsyncExitStack | None = None
        self._rollouts: dict[str, RolloutHandle] = {}
        #: The agent commands of this actor's rollouts (``--agent-command``), made
        #: here from their recipes, each with this actor's gateway.
        self._agents = AgentHost()
        #: The built-in ``openai`` policies of its rollouts, made here from their
        #: recipes (an HTTP client does not travel).
        self._policies = PolicyHost()

    async def start(self) -> int:
        """Open the executor (once); this actor's pid."""
        if self._stack is None:
            stack = AsyncExitStack()
            await stack.enter_async_context(self._executor.open(self._context))
            self._stack = stack
        return os.getpid()

    async def run(
        self,
        task: TaskSpec,
        ids: RolloutIds,
        run_id: str,
        policy: Policy,
        gate: tuple[int, bool, int] | None = None,
    ) -> tuple[RolloutResult, list[Event], list[dict[str, Any]]]:
        """Run one rollout; its result, the telemetry not taken yet (its
        completed event among it: the actor may die before the next take), and,
        when traces are uploaded, its transcript redacted here (where its
        secrets are known).

        ``gate``: the driver's policy gate when the rollout was sent (version,
        paused, generation), mirrored first: a version the trainer set before
        the rollout began is on its first turn, whichever comes first here, the
        rollout or the driver's mirroring.
        """
        if gate is not None:
            await self.mirror(*gate)
        rollout = self._executor.rollout(task, ids, run_id=run_id)
        self._rollouts[ids.rollout_id] = rollout
        messages: list[dict[str, Any]] = []
        if self._traces:

            def keep_transcript(result: RolloutResult) -> RolloutResult:
                # Taken as the result is built: an ended rollout lets its live
                # transcript (screenshots whole) go.
                messages.extend(redacted(rollout.messages, rollout.redactor))
                return result

            rollout.settle = keep_transcript
        if isinstance(policy, AgentRecipe):  # an agent command travels as its recipe
            async with self._agents.agent(policy) as agent:
                await rollout.execute(agent)
        elif isinstance(policy, PolicyRecipe):  # and so does the openai policy
            async with self._policies.policy(policy) as made:
                await rollout.execute(made)
        else:
            await rollout.execute(policy)
        assert rollout.result is not None
        events, self._buffer.events = self._buffer.events, []
        return rollout.result, events, messages

    async def close(self) -> None:
        """The actor's end (before it is killed): close the policies it made."""
        await self._policies.aclose()

    async def stop(self, rollout_id: str, reason: FailureReason, error: str) -> None:
        if (rollout := self._rollouts.get(rollout_id)) is not None:
            rollout.stop(reason, error)

    async def view(self, rollout_id: str, messages: bool) -> RolloutView | None:
        rollout = self._rollouts.get(rollout_id)
        return None if rollout is None else await rollout.read_view(messages=messages)

    async def events(self, rollout_id: str, after: int, wait_s: float) -> EventPage | None:
        rollout = self._rollouts.get(rollout_id)
        return None if rollout is None else await rollout.events(after, wait_s)

    async def forget(self, rollout_id: str) -> None:
        self._rollouts.pop(rollout_id, None)

    async def mirror(self, version: int, paused: bool, generation: int) -> int:
        """The driver's policy gate at ``generation`` (unless a later one came
        first); the generation this actor's gate is at now."""
        if generation < self._generation:
            return self._generation
        self._generation = generation
        self._gate.version = version
        if paused and self._pause is None:
            self._pause = AsyncExitStack()
            await self._pause.enter_async_context(self._gate.paused_calls())
        elif not paused and self._pause is not None:
            pause, self._pause = self._pause, None
            await pause.aclose()
        return generation

    async def gate_state(self) -> tuple[int, bool, int]:
        """This actor's gate: its version, whether paused, the calls it let start so far."""
        return self._gate.version, self._gate.paused, self._gate.admitted

    async def sweep(self, run_id: str) -> None:
        await self._executor.sweep(run_id)

    async def take_events(self, wait_s: float) -> list[Event]:
        buffer = self._buffer
        if not buffer.events:
            with anyio.move_on_after(wait_s):
                await buffer.changed.wait()
        buffer.changed = anyio.Event()
        events, buffer.events = buffer.events, []
        return events


def _what_raised(exc: BaseException) -> str:
    """One line for the error under ``exc``: a RayTaskError's cause is what was
    raised on the actor, a RaySystemError's ``client_exc`` what failed to load
    there, and Ray raises its own TypeError (with pages of diagnosis) from a
    pickling error: the innermost cause is the news."""
    while True:
        cause = getattr(exc, "cause", None) or getattr(exc, "client_exc", None) or exc.__cause__
        if isinstance(cause, str):  # a client_exc that came as its message
            return f"{type(exc).__name__}: {cause}"
        if not isinstance(cause, BaseException) or cause is exc:
            return describe(exc)
        exc = cause


def actor_run_id(run_id: str, index: int) -> str:
    """The Fleet ``run_id`` of the instances actor ``index`` makes for ``run_id``:
    a dead actor's are released at once, and only its."""
    return f"{run_id}-w{index}"


class RayRollout:
    """A rollout running on an actor, as the driver's pool sees it.

    If its actor dies, it runs again once on another (from scratch); with no
    actor left, or once stopped, it ends without running.
    """

    def __init__(self, executor: RayExecutor, task: TaskSpec, ids: RolloutIds, run_id: str) -> None:
        self._executor = executor
        self._index = executor.pick()
        self._worker = executor.workers[self._index]
        self._task = task
        self.ids = ids
        self._run_id = run_id
        self._call_s = executor.settings.timeouts.ray_call_s
        self.phase = Phase.PENDING
        self.result: RolloutResult | None = None
        self.settle: Callable[[RolloutResult], RolloutResult] | None = None
        self._stop: tuple[FailureReason, str] | None = None
        #: Its transcript, redacted on its actor (when ``traces.upload`` is on).
        self._messages: list[dict[str, Any]] = []
        #: Whether it was sent to its actor: until then the actor may still hold
        #: an earlier rollout of the same id (a resumed batch's), not this one.
        self.sent = False

    async def execute(self, policy: Policy) -> None:
        if self._stop is not None:
            self.never_started(*self._stop)
            return
        self.phase = Phase.PROVISIONING
        ray = load_ray()
        for attempt in range(2):
            tag = actor_run_id(self._run_id, self._index)
            self._executor.ran(self._index, self._run_id)
            gate = self._executor.gate_state()
            try:
                ref = self._worker.run.remote(self._task, self.ids, tag, policy, gate)
            except Exception as exc:  # what it runs with cannot be pickled: its failure
                self._failed("could not be sent to its Ray actor", exc)
                return
            self.sent = True
            try:
                result, events, self._messages = await ref
            except anyio.get_cancelled_exc_class():
                with (
                    anyio.CancelScope(shield=True),
                    anyio.move_on_after(self._call_s),
                    # The actor died, or the rollout failed there: it ends cancelled.
                    suppress(Exception),
                ):
                    why = self._stop or (FailureReason.CANCELLED, "the rollout was cancelled")
                    await self._worker.stop.remote(self.ids.rollout_id, *why)
                    result, events, self._messages = await ref
                    self._executor.pass_on(events)
                    self._end(result)
                raise
            except ray.exceptions.RayActorError:
                live = await self._executor.lost(self._index, self.ids, self._run_id)
                if live is None or attempt or self._stop is not None:
                    died = "its worker died" if live is not None else "no worker is left"
                    reason, error = self._stop or (FailureReason.INIT_ERROR, died)
                    self.never_started(reason, error)
                    return
                self._index, self._worker = live, self._executor.workers[live]
                continue
            except Exception as exc:
                # Raised on the actor by the rollout's code, or by the (de)serialisation
                # of what it was sent or sends back: this rollout's failure, not the
                # pool's (its batch goes on).
                self._failed("failed on its Ray actor", exc)
                return
            self._executor.pass_on(events)
            self._end(result)
            return

    def _failed(self, what: str, exc: Exception) -> None:
        """End it failed, with what raised ``exc`` as its error (redacted)."""
        error = self._executor.engine.redactor(f"the rollout {what}: {_what_raised(exc)}")
        self.never_started(FailureReason.INIT_ERROR, shorten(error))

    def _end(self, result: RolloutResult) -> None:
        self.phase = Phase.DONE
        self.result = result if self.settle is None else self.settle(result)

    def stop(self, reason: FailureReason, error: str) -> None:
        if self._stop is None:
            self._stop = (reason, error)
        self._worker.stop.remote(self.ids.rollout_id, reason, error)

    @property
    def stop_reason(self) -> tuple[FailureReason, str] | None:
        return self._stop

    def never_started(self, reason: FailureReason, error: str) -> RolloutResult:
        task = self._task
        self._end(
            RolloutResult(
                rollout_id=self.ids.rollout_id,
                batch_id=self.ids.batch_id,
                task_key=task.key,
                sample_index=self.ids.sample_index,
                group_id=self.ids.group_id,
                env_key=task.env_key,
                env_version=task.env_version,
                modality=task.modality,
                status="failed",
                failure_reason=reason,
                error=error,
            )
        )
        assert self.result is not None
        return self.result

    async def _ask(self, operation: str, ref: Any, timeout_s: float) -> Any:
        """What the actor answers (None if it died: the rollout runs again or ends).

        Raises:
            OperationTimeout: it did not answer within ``timeout_s``.
        """
        ray = load_ray()
        try:
            with anyio.fail_after(timeout_s):
                return await ref
        except TimeoutError:
            rid = self.ids.rollout_id
            raise OperationTimeout(
                f"the Ray actor running rollout {rid} did not answer within"
                f" {self._call_s:g} s (timeouts.ray_call_s); ask again",
                operation=operation,
                timeout_s=self._call_s,
                rollout_id=rid,
            ) from None
        except ray.exceptions.RayActorError:
            return None

    async def read_view(self, *, messages: bool = True) -> RolloutView:
        """Its view on the actor running it (the driver's once it ended there).

        Raises:
            OperationTimeout: the actor did not answer within ``timeouts.ray_call_s``.
        """
        view: RolloutView | None = None
        if self.sent:
            ref = self._worker.view.remote(self.ids.rollout_id, messages)
            view = await self._ask("view", ref, self._call_s)
        if view is None:
            return RolloutView(self.ids, self._task.key, self.phase, 0, (), self.result)
        if self.result is not None:  # the driver's (settled) result is the one that counts
            view = RolloutView(
                view.ids, view.task_key, view.phase, view.steps, view.messages, self.result
            )
        return view

    async def events(self, after: int, wait_s: float) -> EventPage:
        """Its live events on the actor running it (see :meth:`read_view`)."""
        page: EventPage | None = None
        if self.sent:
            ref = self._worker.events.remote(self.ids.rollout_id, after, wait_s)
            page = await self._ask("events", ref, self._call_s + wait_s)
        if page is None and self.result is not None:
            return ended_page(after, self.result)
        return page or EventPage((), 0, False)

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self._messages

    @property
    def redactor(self) -> Redactor:
        return Redactor()  # its messages were redacted on its actor


class RayExecutor:
    """Runs a pool's rollouts on Ray actors (see the module docstring).

    Made by :func:`ray_pool`, which starts the actors and the cluster's
    admission first (the pool's admission is the cluster's).
    """

    def __init__(
        self,
        settings: Settings,
        workers: list[Any],
        api_key: str | None,
        base_url: str | None,
        limiter: Any = None,
    ) -> None:
        self.settings = settings
        self.workers = workers
        #: The cluster's admission actor (:class:`~fleetroll.pool.ray.admission.AdmissionHost`).
        self.limiter = limiter
        self._api_key = api_key
        self._base_url = base_url
        #: Sweeps the actors' Fleet instances from this process (a dead actor's too).
        self._fleet: FleetProvider | None = None
        #: The Fleet tags of dead actors' runs already swept.
        self._swept: set[str] = set()
        #: Per actor, the run ids it ran rollouts of (a dead one's are swept at the end).
        self._ran: list[set[str]] = [set() for _ in workers]
        self._local = LocalExecutor(settings, api_key=api_key, base_url=base_url)
        self._next = itertools.cycle(range(len(workers)))
        #: Which actors still answer.
        self.alive = [True] * len(workers)
        #: Rollouts run again after their actor died: their started and completed
        #: events are passed on once (the dead actor may have shipped either).
        self._rerun: dict[str, set[str]] = {}
        #: Rollouts whose started event was passed on and completed one not yet.
        self._started: set[str] = set()
        self._events: Events | None = None
        self._gate: PolicyGate | None = None
        self._closing = False

    @property
    def capacity(self) -> float:
        # Each actor holds instance slots of its own (concurrency + creates).
        p = self.settings
        return len(self.workers) * (p.pool.concurrency + p.provisioning.max_concurrent_creates)

    def pick(self) -> int:
        """The next live actor, round robin (0 if none is: its call fails as lost)."""
        for _ in self.workers:
            n = next(self._next)
            if self.alive[n]:
                return n
        return 0

    def ran(self, index: int, run_id: str) -> None:
        """Actor ``index`` runs a rollout of ``run_id``."""
        self._ran[index].add(run_id)

    async def lost(self, index: int, ids: RolloutIds, run_id: str) -> int | None:
        """Actor ``index`` died under rollout ``ids``: the actor to run it again on, if any.

        Its places in the cluster's admission go back, and its instances of
        ``run_id`` (tagged :func:`actor_run_id`) are released, before the rerun.
        """
        tag = actor_run_id(run_id, index)
        if tag not in self._swept:
            self._swept.add(tag)
            if self._fleet is not None:
                await self._fleet.sweep(tag)  # shielded and bounded; never raises
        if self.alive[index]:
            self.alive[index] = False
            if self._events is not None:
                self._events.emit(
                    "fleet_worker_lost", level="error", batch_id=ids.batch_id, worker=index
                )
            if self.limiter is not None:
                # Its places in the cluster's admission (creates, instances) go back.
                with anyio.CancelScope(shield=True):
                    with anyio.move_on_after(self.settings.timeouts.ray_call_s):
                        await self.limiter.release_all.remote(holder(index))
        rid = ids.rollout_id
        self._rerun.setdefault(rid, {_ONCE[0]} if rid in self._started else set())
        live = [n for n, ok in enumerate(self.alive) if ok]
        return live[0] if live else None

    @asynccontextmanager
    async def open(self, context: ExecutorContext) -> AsyncIterator[None]:
        self._events, self._closing = context.events, False
        self._gate = context.policy_gate
        if self._api_key is not None:
            self._fleet = fleet_provider(
                self.settings, context.events, api_key=self._api_key, base_url=self._base_url
            )
        async with AsyncExitStack() as stack:
            if self._fleet is not None:
                stack.push_async_callback(self._fleet.aclose)
            await stack.enter_async_context(self._open(context))
            yield

    @asynccontextmanager
    async def _open(self, context: ExecutorContext) -> AsyncIterator[None]:
        async with self._local.open(context), anyio.create_task_group() as tg:
            for worker in self.workers:
                tg.start_soon(self._pass_events, worker, context.events, _TAKE_WAIT_S)
            mirror = anyio.CancelScope()
            tg.start_soon(self._mirror, context.policy_gate, mirror)
            try:
                yield
            finally:
                # A take cut short would lose what it took: each ends after the one
                # under way (bounded by ray_call_s).
                self._closing = True
                mirror.cancel()
        # Once more: the events of the last rollouts (shielded and bounded).
        dead = [n for n, ok in enumerate(self.alive) if not ok]
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.settings.timeouts.ray_call_s):
            for n, worker in enumerate(self.workers):
                if self.alive[n] and not await self._pass_events(
                    worker, context.events, 0.0, once=True
                ):
                    dead.append(n)
        # A dying actor may have made an instance after its batch's sweep: now
        # that it is dead for sure, the tags of every run it ran are swept again.
        if self._fleet is not None:
            for n in dead:
                for run_id in sorted(self._ran[n]):
                    await self._fleet.sweep(actor_run_id(run_id, n))

    async def _mirror(self, gate: PolicyGate, scope: anyio.CancelScope) -> None:
        with scope:
            await self._mirror_forever(gate)

    async def _mirror_forever(self, gate: PolicyGate) -> None:
        ray = load_ray()
        timeout_s = self.settings.timeouts.ray_call_s
        while True:
            seen = gate.generation
            with anyio.move_on_after(timeout_s) as scope:
                for n, worker in enumerate(self.workers):
                    if self.alive[n]:
                        # A dead actor's rollouts find out (and run again elsewhere).
                        with suppress(ray.exceptions.RayActorError):
                            await worker.mirror.remote(gate.version, gate.paused, gate.generation)
            if scope.cancelled_caught:
                # Each rollout sent carries the gate, and gate_synced waits for it.
                _log.warning(
                    "a Ray actor did not take the policy gate within %g s"
                    " (timeouts.ray_call_s); it gets it with its next rollout",
                    timeout_s,
                )
            if gate.generation == seen:
                await gate.changed()

    def gate_state(self) -> tuple[int, bool, int] | None:
        """The driver's policy gate now (version, paused, generation); None: not open."""
        gate = self._gate
        return None if gate is None else (gate.version, gate.paused, gate.generation)

    async def gate_synced(self) -> None:
        """Return once every live actor confirmed the driver's gate as it is now
        (a dead actor is skipped: its rollouts run again elsewhere).

        Raises:
            OperationTimeout: a live actor did not confirm within ``timeouts.ray_call_s``.
        """
        gate = self._gate
        if gate is None:
            return  # not open: no actor runs a rollout
        ray = load_ray()
        timeout_s = self.settings.timeouts.ray_call_s
        state = (gate.version, gate.paused, gate.generation)
        try:
            with anyio.fail_after(timeout_s):
                for n, worker in enumerate(self.workers):
                    if self.alive[n]:
                        with suppress(ray.exceptions.RayActorError):
                            await worker.mirror.remote(*state)
        except TimeoutError:
            raise OperationTimeout(
                f"a Ray actor did not confirm the policy {'pause' if state[1] else 'version'}"
                f" within {timeout_s:g} s (timeouts.ray_call_s); is the cluster overloaded?",
                operation="policy_gate",
                timeout_s=timeout_s,
            ) from None

    async def _pass_events(
        self, worker: Any, events: Events, wait_s: float, *, once: bool = False
    ) -> bool:
        """Pass on what ``worker`` emits (once, or until closing); False if it is dead."""
        ray = load_ray()
        while True:
            try:
                with anyio.fail_after(self.settings.timeouts.ray_call_s + wait_s):
                    taken = await worker.take_events.remote(wait_s)
            except ray.exceptions.RayActorError:
                return False  # a dead actor's rollouts find out, and say so
            except TimeoutError:
                return True
            self.pass_on(taken)
            if once or self._closing:
                return True

    def pass_on(self, taken: list[Event]) -> None:
        """Emit what an actor emitted (started and completed once per rollout)."""
        events = self._events
        assert events is not None
        for event in taken:
            rid = str(event.attributes.get("rollout_id"))
            seen = self._rerun.get(rid)
            if seen is not None and event.name in _ONCE:
                if event.name in seen:
                    continue
                seen.add(event.name)
            if event.name == _ONCE[0]:
                self._started.add(rid)
            elif event.name == _ONCE[1]:
                self._started.discard(rid)
                if seen is not None and len(seen) == len(_ONCE):
                    del self._rerun[rid]
            events.emit(event.name, level=event.level, **dict(event.attributes))

    @property
    def engine(self) -> RolloutEngine:
        """The engine of this process (sessions run on it; checks use its provider).

        Raises:
            RuntimeError: the executor is not open.
        """
        return self._local.engine

    def check_tasks(self, tasks: Sequence[TaskSpec]) -> None:
        require_fleet_key(tasks, self._api_key)

    def rollout(self, task: TaskSpec, ids: RolloutIds, *, run_id: str) -> RolloutHandle:
        return RayRollout(self, task, ids, run_id)

    async def sweep(self, run_id: str) -> None:
        # The actors' providers made the instances (this process's made none but
        # its sessions'): Fleet lists the run's for this process to release, those
        # of a dead actor included; a live actor sweeps its other providers' (MCP).
        await self._local.sweep(run_id)
        tags = [actor_run_id(run_id, n) for n in range(len(self.workers))]
        if self._fleet is not None:
            for tag in tags:
                await self._fleet.sweep(tag)
        ray = load_ray()
        with anyio.fail_after(self.settings.timeouts.ray_call_s):
            for n, worker in enumerate(self.workers):
                if self.alive[n]:
                    with suppress(ray.exceptions.RayActorError):
                        await worker.sweep.remote(tags[n])

    def session(
        self, task: TaskSpec, ids: RolloutIds, *, run_id: str
    ) -> AbstractAsyncContextManager[EnvSession]:
        # Sessions are driven from this process: they run here, under the pool's limits.
        return self._local.session(task, ids, run_id=run_id)


def planned_actors(num_actors: int | None, cluster_cpus: int = 0) -> int:
    """The actors to start: ``num_actors``, or one per CPU (a joined cluster's
    ``cluster_cpus``, or :func:`~fleetroll.pool.ray.actors.default_num_actors`)."""
    return num_actors or cluster_cpus or default_num_actors()


async def _close_workers(workers: list[Any], timeout_s: float) -> None:
    """Each live actor's end, before it is killed: it closes what it made (policies)."""
    ray = load_ray()
    with anyio.CancelScope(shield=True), anyio.move_on_after(timeout_s):
        for worker in workers:
            with suppress(ray.exceptions.RayActorError):
                await worker.close.remote()


@asynccontextmanager
async def ray_pool(
    settings: Settings,
    *,
    api_key: str | None,
    base_url: str | None = None,
    events: Events | None = None,
    num_actors: int | None = None,
    address: str | None = None,
    run_id: str | None = None,
) -> AsyncIterator[RolloutPool]:
    """One RolloutPool whose rollouts run on ``num_actors`` Ray actors.

    Args:
        num_actors: actors to start, each a LocalExecutor running up to
            ``pool.concurrency`` rollouts. None: one per CPU
            (:func:`~fleetroll.pool.ray.actors.default_num_actors` on a Ray started
            here, the cluster's CPUs when joining one).
        address: a Ray cluster to join (default: the one this process is in,
            or a local one started here).
        run_id: the process's run id (``RolloutPool.run_id``).

    Raises:
        ConfigError: Ray is not installed.
        ValueError: ``num_actors`` is below 1.
    """
    if num_actors is not None and num_actors < 1:
        raise ValueError("num_actors must be at least 1")
    ray = load_ray()
    async with AsyncExitStack() as stack:
        joined = ray.is_initialized()
        if not joined:
            ray.init(
                address=address,
                include_dashboard=False,
                log_to_driver=False,
                ignore_reinit_error=True,
            )
            stack.callback(ray.shutdown)
        cpus = int(ray.cluster_resources().get("CPU", 0)) if joined else 0
        num_actors = planned_actors(num_actors, cpus)
        limiter = ray.remote(num_cpus=0, max_concurrency=100_000)(AdmissionHost).remote(settings)
        worker_cls = ray.remote(num_cpus=0, max_concurrency=100_000)(ExecutorWorker)
        workers = [
            worker_cls.remote(settings, api_key, base_url, limiter, n) for n in range(num_actors)
        ]
        stack.callback(lambda: [ray.kill(a) for a in [*workers, limiter]])
        stack.push_async_callback(_close_workers, workers, settings.timeouts.ray_call_s)
        with anyio.fail_after(settings.timeouts.ray_call_s * 10):
            for worker in workers:
                await worker.start.remote()
        admission = RemoteAdmission(
            limiter,
            "driver",
            settings.timeouts.ray_call_s,
            limits=CreateLimits.from_settings(settings.provisioning),
        )
        events = events or Events()
        await stack.enter_async_context(admission.followed(events))
        pool = RolloutPool(
            settings,
            api_key=api_key,
            base_url=base_url,
            events=events,
            admission=admission,
            executor=RayExecutor(settings, workers, api_key, base_url, limiter),
            run_id=run_id,
        )
        yield await stack.enter_async_context(pool)

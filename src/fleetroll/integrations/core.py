"""The one core every trainer adapter uses: fleetroll opened, requests in, one row each out.

A trainer asks for rollouts as a list of requests, ``(task_key,
sample_index)``: a task's requests are its group (GRPO's G samples). The core
runs them as one batch (one per distinct set of sample indices: the usual
case of every task asking ``0 .. G-1`` is one batch), and answers **one row per
request, in the request order**, matched by ``(task_key, sample_index)``,
never by prompt text or by the order results arrive in::

    async with Rollouts(tasks, settings) as rollouts:
        rows = await rollouts.run([("ledger-001", 0), ("ledger-001", 1), ("ledger-002", 0), ...])
        ...                                          # the trainer's step
        model.save_pretrained(path)
        await rollouts.sync_weights(sync, path)      # paused, pushed, version bumped

Synchronous callers (TRL's ``rollout_func``) use :class:`BlockingRollouts`:
the same calls, on an event loop the core hosts on a thread of its own; it
closes with ``with``, with :meth:`BlockingRollouts.close`, or at interpreter
exit, without hanging.

Opening is what ``fleetroll run`` does (:func:`fleetroll.jobs.fleet.open_fleet`,
:func:`fleetroll.pool.batch_pool.open_batch_pool`): Fleet when
``FLEET_API_KEY`` or ``FLEET_BASE_URL`` is set, else the embedded emulator;
the policy of the settings, which must be ``policy.kind = "openai"`` (a model
server: rows need its token ids and logprobs, which the core asks for
whatever ``policy.return_token_ids`` and ``policy.logprobs`` say); telemetry
as ``fleetroll run`` has it (the local store, Logfire when configured), unless
``events`` is given; and the pre-flight checks (unless ``preflight=False``).

**Rows** (the contract every adapter reads; plain dicts): ``rollout_id``,
``group_id``, ``task_key``, ``sample_index`` (of the rollout that fills the
row: with oversampling, an extra may stand in for a failed sample),
``prompt_ids`` (turn 0's prompt as the server tokenized it),
``completion_ids`` (everything after it: the model's tokens and, between
turns, the tool answers), ``completion_mask`` (1 for the model's tokens),
``completion_logprobs`` (the server's, None where the mask is 0),
``completion_policy_versions`` (per token, None where the mask is 0),
``completion_token_versions`` (per token, the version of the weights that
produced it: None where the mask is 0 or it is not proven),
``reward`` (None for a failed rollout), ``advantage`` (group-normalised over
the scored rows; 0 for a failed one), ``status`` (``scored``, ``failed``, or
what else made the row: :data:`fleetroll.training.trajectory.ROW_STATUSES`),
``failure_reason``, ``dropped_tokens`` and ``drift``: the rows of
:func:`fleetroll.training_rows` with ``group_size`` (docs/results.md,
"Training rows"). A failed rollout is still a row, with its mask all 0, so the
trainer's group keeps its size; when no model call happened its
``prompt_ids`` and ``completion_ids`` are empty: :func:`fill_empty_row` fills
them with the trainer's tokenizer (the prompt, and one end token).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import queue
import threading
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, Self, TypeVar

import anyio
import anyio.to_thread
from anyio.from_thread import BlockingPortal

from fleetroll._internal.exit_stack import exit_transparently
from fleetroll.errors import ConfigError
from fleetroll.jobs.fleet import open_fleet, preflight_fleet
from fleetroll.policies import Policy
from fleetroll.pool.assembly import policy_from_settings
from fleetroll.pool.batch import rollout_id
from fleetroll.pool.batch_pool import open_batch_pool
from fleetroll.pool.rollout_pool import Batch, RolloutPool
from fleetroll.results import RolloutResult
from fleetroll.settings import Settings, load_settings
from fleetroll.tasks import TaskSpec, load_tasks, parse_tasks
from fleetroll.telemetry.events import Events
from fleetroll.training.trajectory import Drift, training_rows
from fleetroll.training.weight_sync import WeightSync, sync_weights

__all__ = [
    "BlockingRollouts",
    "Drift",
    "Request",
    "Rollouts",
    "Row",
    "fill_empty_row",
    "load_task_list",
    "outcome_of",
    "prompt_messages",
]

#: One trainer row (see the module's docstring for its keys).
Row = dict[str, Any]

_T = TypeVar("_T")


class Request(NamedTuple):
    """One sample a trainer asks for: a task (by key) and its sample index in its group."""

    task_key: str
    sample_index: int


def load_task_list(
    tasks: Sequence[TaskSpec] | Sequence[Mapping[str, Any]] | str | os.PathLike[str],
    settings: Settings,
) -> list[TaskSpec]:
    """Tasks from a task file's path, from task records (dicts), or as given.

    Raises:
        TaskFileError: the file or a record is invalid.
        ValueError: two tasks share a key, or there are none.
    """
    if isinstance(tasks, str | os.PathLike):
        loaded = load_tasks(Path(tasks), modalities=settings.modalities)
    elif all(isinstance(t, TaskSpec) for t in tasks):
        loaded = [t for t in tasks if isinstance(t, TaskSpec)]
    else:
        records = [t for t in tasks if isinstance(t, Mapping)]
        if len(records) != len(tasks):
            raise TypeError("tasks are TaskSpecs, task records (dicts) or a task file's path")
        loaded = parse_tasks(records, source="tasks", modalities=settings.modalities)
    if not loaded:
        raise ValueError("there are no tasks")
    seen: set[str] = set()
    for task in loaded:
        if task.key in seen:
            raise ValueError(f"two tasks share the key {task.key!r}: a key names one task")
        seen.add(task.key)
    return loaded


def prompt_messages(task: TaskSpec, system_prompt: str | None = None) -> list[dict[str, str]]:
    """The chat messages of ``task``'s turn 0 (``policy.system_prompt`` first, when set)."""
    messages = [{"role": "user", "content": task.prompt}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def fill_empty_row(row: Row, *, prompt_ids: Sequence[int], end_token_id: int) -> Row:
    """``row`` with what a trainer needs when no model call happened (its
    ``prompt_ids`` and ``completion_ids`` empty): ``prompt_ids`` (the trainer's
    tokenizer's rendering of the prompt) and one ``end_token_id`` as its
    completion, under mask 0. Any other row is returned as it is."""
    if row["completion_ids"] and row["prompt_ids"]:
        return row
    filled = dict(row)
    if not row["prompt_ids"]:
        filled["prompt_ids"] = list(prompt_ids)
    if not row["completion_ids"]:
        filled["completion_ids"] = [end_token_id]
        filled["completion_mask"] = [0]
        filled["completion_logprobs"] = [None]
        filled["completion_policy_versions"] = [None]
        if "completion_token_versions" in row:
            filled["completion_token_versions"] = [None]
    return filled


class Rollouts:
    """fleetroll for a trainer: an async context manager that runs requests and answers rows.

    Args:
        tasks: the tasks requests name (TaskSpecs, task records, or a task file's path).
        settings: fleetroll's settings (default: :func:`fleetroll.load_settings`).
            ``policy.kind`` must be ``"openai"`` (the trainer's model server).
        events: where telemetry goes (default: telemetry as ``fleetroll run`` has it).
        emulator_profile: the embedded emulator's fault profile (when no Fleet is set).
        preflight: check the environments and the policy servers on entering.
        drift: what a rollout whose chat template drifted becomes (:data:`Drift`).
        ray_address, ray_actors: run the rollouts on Ray actors (as ``fleetroll run --ray``).

    Raises:
        ConfigError: (on construction) ``policy.kind`` is not ``"openai"``.
        TaskFileError, ValueError: (on construction) as :func:`load_task_list`.
        PreflightError: (on entering) a pre-flight check failed.
        EmulatorError: (on entering) the emulator could not start.
    """

    def __init__(
        self,
        tasks: Sequence[TaskSpec] | Sequence[Mapping[str, Any]] | str | os.PathLike[str],
        settings: Settings | None = None,
        *,
        events: Events | None = None,
        emulator_profile: str | None = None,
        preflight: bool = True,
        drift: Drift = "first_segment",
        ray_address: str | None = None,
        ray_actors: int | None = None,
    ) -> None:
        settings = settings or load_settings()
        if settings.policy.kind != "openai":
            raise ConfigError(
                f'a trainer needs its model server: set policy.kind = "openai" and'
                f' policy.base_url (FLEETROLL_POLICY__KIND=openai), not "{settings.policy.kind}"'
            )
        training = {"return_token_ids": True, "logprobs": True}
        self.settings = settings.model_copy(
            update={"policy": settings.policy.model_copy(update=training)}
        )
        #: The tasks, by key.
        self.tasks: dict[str, TaskSpec] = {t.key: t for t in load_task_list(tasks, self.settings)}
        self.drift: Drift = drift
        self._events = events
        self._profile = emulator_profile
        self._preflight = preflight
        self._ray = (ray_address, ray_actors)
        self._pool: RolloutPool | None = None
        self._policy: Policy | None = None
        self._stack: AsyncExitStack | None = None

    @property
    def pool(self) -> RolloutPool:
        """The pool (its ``policy_version``, ``policy_paused()``, ``events``).

        Raises:
            RuntimeError: not open.
        """
        if self._pool is None:
            raise RuntimeError("fleetroll is not open: use `async with Rollouts(...)`")
        return self._pool

    @property
    def policy_version(self) -> int:
        """The policy version recorded on turns from now on (the pool's)."""
        return self.pool.policy_version

    async def __aenter__(self) -> Self:
        settings = self.settings
        async with AsyncExitStack() as stack:
            events = self._events
            if events is None:
                from fleetroll.telemetry import open_telemetry

                events = await stack.enter_async_context(
                    open_telemetry(
                        settings.telemetry,
                        secrets=settings.secrets(),
                        logfire_token=settings.logfire_token,
                    )
                )
            fleet = await open_fleet(stack, settings, self._profile)
            if self._preflight:
                await preflight_fleet(settings, fleet, list(self.tasks.values()))
            policy = policy_from_settings(settings)
            stack.push_async_callback(policy.aclose)
            address, actors = self._ray
            self._pool, _ = await open_batch_pool(
                stack, settings, fleet, events, ray_address=address, ray_actors=actors
            )
            self._policy = policy
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack, self._stack, self._pool, self._policy = self._stack, None, None, None
        if stack is not None:
            await exit_transparently(stack, exc_type, exc, tb)

    async def run(
        self,
        requests: Sequence[tuple[str, int]],
        *,
        batch_id: str | None = None,
        deadline_s: float | None = None,
    ) -> list[Row]:
        """Run ``requests`` and return one row per request, in their order.

        A task's requests are its group: its rows' advantages are normalised
        over them. Every request gets a row, a failed rollout's masked.

        Args:
            requests: ``(task_key, sample_index)`` pairs (:class:`Request`);
                a task's sample indices are distinct.
            batch_id: the batch's id (default: a new one; several distinct
                sets of sample indices run as batches ``{batch_id}-{n}``).
            deadline_s: cancel what is still running after this long (those
                samples come back as failed rows).

        Raises:
            KeyError: a request names a task the core was not given.
            ValueError: a task's sample index is asked twice, or is negative.
            PoolFullError: the pool has no room for the batch.
            RuntimeError: the core is not open.
        """
        wanted = _by_task(requests, self.tasks)
        pool = self.pool
        assert self._policy is not None  # open with the pool
        # One batch per distinct set of sample indices (usually one: 0 .. G-1 for every task).
        plans: dict[tuple[int, ...], list[TaskSpec]] = defaultdict(list)
        for key, indices in wanted.items():
            plans[tuple(sorted(indices))].append(self.tasks[key])
        base = batch_id or uuid.uuid4().hex[:12]
        policy = self._policy
        # Every batch is started before any is waited for: a refused one
        # (PoolFullError) is raised as itself, and the others are cancelled.
        batches: list[Batch] = []
        try:
            for number, (chosen, tasks) in enumerate(plans.items()):
                name = base if len(plans) == 1 else f"{base}-{number}"
                count = max(chosen) + 1
                only = None
                if chosen != tuple(range(count)):  # e.g. samples 2 and 5: just those
                    only = {rollout_id(name, t.key, i) for t in tasks for i in chosen}
                batches.append(
                    pool.run_batch(
                        tasks,
                        policy,
                        samples_per_task=count,
                        batch_id=name,
                        deadline_s=deadline_s,
                        only=only,
                        oversample=None if only is None else 0,
                    )
                )
        except Exception:
            for started in batches:
                started.cancel()
            raise
        results: list[RolloutResult] = []

        async def collect(batch: Batch) -> None:
            async with batch:
                results.extend(await batch.results())
            pool.forget(batch.batch_id)

        async with anyio.create_task_group() as tg:
            for batch in batches:
                tg.start_soon(collect, batch)
        by_task: dict[str, list[RolloutResult]] = defaultdict(list)
        for result in results:
            by_task[result.task_key].append(result)
        answered: dict[Request, Row] = {}
        for key, indices in wanted.items():
            group = sorted(by_task[key], key=lambda r: r.sample_index)
            rows = training_rows([group], group_size=len(indices), drift=self.drift)
            for index, row in zip(sorted(indices), rows, strict=True):
                answered[Request(key, index)] = row
        return [answered[Request(key, index)] for key, index in requests]

    async def sync_weights(self, sync: WeightSync, source: Any) -> int:
        """Push the weights in ``source`` with ``sync`` while new policy calls
        wait, then bump the policy version; return the new version
        (:func:`fleetroll.training.weight_sync.sync_weights`).

        Raises:
            WeightSyncError: a server did not take them (the version stays).
        """
        return await sync_weights(self.pool, sync, source)


def _by_task(
    requests: Sequence[tuple[str, int]], tasks: Mapping[str, TaskSpec]
) -> dict[str, set[int]]:
    wanted: dict[str, set[int]] = defaultdict(set)
    for key, index in requests:
        if key not in tasks:
            raise KeyError(f"no task {key!r} among the tasks fleetroll was given")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"a sample index is an int >= 0, not {index!r} (task {key!r})")
        if index in wanted[key]:
            raise ValueError(f"sample {index} of task {key!r} is asked twice")
        wanted[key].add(index)
    return dict(wanted)


class BlockingRollouts:
    """:class:`Rollouts` for synchronous code, on an event loop it hosts on a thread.

    ::

        with BlockingRollouts(tasks, settings) as rollouts:
            rows = rollouts.run(requests)
            rollouts.sync_weights(sync, path)

    It opens on ``with`` or on its first call; it closes when the ``with``
    block ends, on :meth:`close`, or at interpreter exit (what is still
    running is cancelled, every instance released), within
    ``close_timeout_s``, never hanging the exit: its loop's thread is a
    daemon. The arguments are :class:`Rollouts`'.
    """

    def __init__(
        self,
        tasks: Sequence[TaskSpec] | Sequence[Mapping[str, Any]] | str | os.PathLike[str],
        settings: Settings | None = None,
        *,
        close_timeout_s: float = 60.0,
        **options: Any,
    ) -> None:
        #: The async core (its ``tasks``, ``settings``); its calls go through :meth:`call`.
        self.core = Rollouts(tasks, settings, **options)
        self.close_timeout_s = close_timeout_s
        self._portal: BlockingPortal | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._exit_error: list[BaseException] = []
        self._lock = threading.Lock()

    def open(self) -> Self:
        """Start the loop's thread and open fleetroll on it (once; later calls return).

        Raises:
            As :class:`Rollouts` on entering; RuntimeError: it was closed.
        """
        with self._lock:
            if self._portal is not None:
                return self
            if self._closed.is_set():
                raise RuntimeError("this BlockingRollouts is closed")
            started: queue.Queue[BlockingPortal | BaseException] = queue.Queue()
            thread = threading.Thread(
                target=anyio.run, args=(self._host, started), name="fleetroll-loop", daemon=True
            )
            thread.start()
            outcome = started.get()
            if isinstance(outcome, BaseException):
                thread.join()
                raise outcome
            self._portal, self._thread = outcome, thread
            atexit.register(self.close)
        return self

    async def _host(self, started: queue.Queue[BlockingPortal | BaseException]) -> None:
        opened = False
        try:
            async with self.core:
                opened = True
                # Inside the core: the portal's cancellation (``close``) ends the
                # calls still running, never the core's own closing.
                async with BlockingPortal() as portal:
                    started.put(portal)
                    await portal.sleep_until_stopped()
        except Exception as exc:  # handed to the thread that waits for it
            if opened:
                self._exit_error.append(exc)
            else:
                started.put(exc)

    def call(self, fn: Callable[..., Awaitable[_T]], *args: Any) -> _T:
        """Run ``fn(*args)`` on the loop (opening it first) and return its result."""
        portal = self.open()._portal
        assert portal is not None
        return portal.call(fn, *args)

    def run(
        self,
        requests: Sequence[tuple[str, int]],
        *,
        batch_id: str | None = None,
        deadline_s: float | None = None,
    ) -> list[Row]:
        """:meth:`Rollouts.run`, blocking."""

        async def run() -> list[Row]:
            return await self.core.run(requests, batch_id=batch_id, deadline_s=deadline_s)

        return self.call(run)

    async def run_from_loop(
        self,
        requests: Sequence[tuple[str, int]],
        *,
        batch_id: str | None = None,
        deadline_s: float | None = None,
    ) -> list[Row]:
        """:meth:`Rollouts.run`, awaited from another asyncio loop (a trainer's:
        verl's agent-loop worker, SkyRL's generator, a verifiers environment)
        without blocking it; cancelling the awaiting task cancels the rollouts.
        The core opens on the first call (in a thread, so that loop goes on)."""
        if self._portal is None:
            await anyio.to_thread.run_sync(self.open)
        portal = self._portal
        if portal is None:
            raise RuntimeError("this BlockingRollouts is closed")

        async def run() -> list[Row]:
            return await self.core.run(requests, batch_id=batch_id, deadline_s=deadline_s)

        # The rows come back on the caller's loop; its cancellation reaches ours.
        return await asyncio.wrap_future(portal.start_task_soon(run))

    def sync_weights(self, sync: WeightSync, source: Any) -> int:
        """:meth:`Rollouts.sync_weights`, blocking."""
        return self.call(self.core.sync_weights, sync, source)

    def close(self) -> None:
        """Cancel what runs, close fleetroll and stop the loop; idempotent.

        Raises:
            What closing fleetroll raised (not at interpreter exit: logged there).
            TimeoutError: it took longer than ``close_timeout_s`` (the thread is left).
        """
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            portal, thread = self._portal, self._thread
            self._portal = None
        atexit.unregister(self.close)
        if portal is None or thread is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop already ended
            portal.call(portal.stop, True)
        thread.join(self.close_timeout_s)
        if thread.is_alive():
            raise TimeoutError(f"fleetroll did not close within {self.close_timeout_s:g} s")
        if self._exit_error:
            raise self._exit_error[0]

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


_SHARED: dict[str, BlockingRollouts] = {}
_SHARED_LOCK = threading.Lock()


def shared_rollouts(
    tasks: str | os.PathLike[str],
    settings: Settings | None = None,
    **options: Any,
) -> BlockingRollouts:
    """The process's one :class:`BlockingRollouts` for this task file, settings
    and options: for trainers that build their rollout object per sample (verl
    instantiates an agent loop per sample; verifiers calls an environment's
    ``rollout`` per sample), so every sample of a worker process shares one
    pool. It opens on its first call and closes at interpreter exit.

    Raises:
        As :class:`Rollouts` (on construction).
    """
    settings = settings or load_settings()
    key = "\0".join((os.fspath(tasks), settings.model_dump_json(), repr(sorted(options.items()))))
    with _SHARED_LOCK:
        found = _SHARED.get(key)
        if found is None or found._closed.is_set():
            found = _SHARED[key] = BlockingRollouts(tasks, settings, **options)
        return found


def outcome_of(row: Row) -> str:
    """How the row's rollout ended, for a trainer's own "why" field: ``completed``
    for a rollout that ended well, else its failure reason (``policy_error``,
    ``timeout``, ...), else the row's status (``padding``, ``drift_dropped``, ...)."""
    reason: str | None = row.get("failure_reason")
    if reason is not None:
        return reason
    return "completed" if row["status"] == "scored" else str(row["status"])


def turns_of(row: Row) -> int:
    """How many messages the row's conversation had after the prompt: each run
    of the model's tokens (mask 1) is an assistant message, each run of other
    tokens between them a tool answer (0 for a row with nothing under the mask)."""
    runs = 0
    previous = None
    for bit in row["completion_mask"]:
        if bit != previous:
            runs += 1
            previous = bit
    if not any(row["completion_mask"]):
        return 0
    return runs


def check_temperature(settings: Settings, wanted: float | None, *, trainer: str) -> None:
    """Refuse a trainer's sampling temperature ``wanted`` that is not fleetroll's
    ``policy.temperature`` (or a run without one): the trainer takes its logprobs
    at its own temperature, the server samples at fleetroll's. None: the trainer
    did not say, nothing to check.

    Raises:
        ConfigError: they differ, or ``policy.temperature`` is not set.
    """
    ours = settings.policy.temperature
    if wanted is None:
        return
    if ours is None:
        raise ConfigError(
            f"set policy.temperature to {trainer}'s temperature ({wanted:g}): without"
            " it the server samples at its own default (vLLM takes the model's"
            f" generation_config), and {trainer}'s logprobs would not be the sampler's"
        )
    if abs(float(wanted) - ours) > 1e-9:
        raise ConfigError(
            f"{trainer} samples at temperature {wanted:g} but fleetroll's"
            f" policy.temperature is {ours:g}: set them the same ({trainer}'s"
            " logprobs are taken at its own temperature)"
        )

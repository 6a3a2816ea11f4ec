"""The main job: a batch of rollouts from a task file, with a journal and progress.

``fleetroll run`` builds the settings, then calls :func:`run_job`; the job
picks its Fleet (the embedded emulator unless ``FLEET_API_KEY`` or
``FLEET_BASE_URL`` is set), streams results into the journal as they come,
shows progress, and returns every result of the batch.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import statistics
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskGroup
from rich.console import Console
from rich.table import Table

from fleetroll._internal.exit_stack import exit_transparently
from fleetroll.errors import ConfigError, JournalError
from fleetroll.policies import Policy
from fleetroll.pool.batch_pool import FleetTarget, RunningBatch, open_batch_pool, release_run
from fleetroll.pool.journal import (
    BatchIdentity,
    Journal,
    claim_journal,
    read_sampler_state,
    sampler_path,
    step_batch_id,
    write_sampler_state,
)
from fleetroll.pool.preflight import preflight_fleet
from fleetroll.pool.rollout_pool import Batch, RolloutPool
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout.machine import Phase
from fleetroll.settings import Settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Events
from fleetroll.training.groups import groups_of
from fleetroll.training.sampler import SamplerConfig, SamplerState, TaskSampler

if TYPE_CHECKING:
    from fleetroll.rollout.agent_process import AgentRecords

__all__ = [
    "FleetTarget",
    "JobReport",
    "SameFailures",
    "Steps",
    "cost_table",
    "open_fleet",
    "print_report",
    "run_command",
    "run_job",
    "summary_table",
]

_PLAIN_PROGRESS_EVERY_S = 10.0
_LIVE_EVERY_S = 0.5


@dataclass(frozen=True, slots=True)
class JobReport:
    batch_id: str
    results: list[RolloutResult]  # every result of the batch, resumed ones included
    resumed: int
    elapsed_s: float
    interrupted: bool
    backend: str
    journal: Path | None = None
    #: Why the batch was stopped early (pool.stop_after_same_failures), if it was.
    stopped: str | None = None
    #: A run of steps (``batch_id`` is then the run's id): the steps that ran to their end.
    steps: int | None = None

    def exit(self) -> None:
        """End the command as the job ended: 130 when interrupted, 1 when stopped early.

        Raises:
            SystemExit: it was interrupted, or stopped early.
        """
        if self.interrupted:
            raise SystemExit(130)
        if self.stopped is not None:
            raise SystemExit(1)


@dataclass(frozen=True, slots=True)
class Steps:
    """A run of steps (``--steps``, ``--batch-tasks``): ``count`` batches, each
    of the tasks the sampler draws next (:mod:`fleetroll.training.sampler`)."""

    count: int
    sampler: SamplerConfig


def run_command(
    settings: Settings,
    tasks: Sequence[TaskSpec],
    *,
    samples: int,
    out: Path | None,
    resume: bool,
    profile: str | None,
    preflight: bool,
    console: Console,
    agent_command: str | None = None,
    ray_address: str | None = None,
    ray_actors: int | None = None,
    groups_target: int | None = None,
    steps: Steps | None = None,
    policy_version: int | None = None,
) -> JobReport:
    """A command's job (``run``, ``eval``): :func:`run_job` with telemetry, the
    policy of the settings (or ``agent_command``'s gateway) and the signals.

    Raises:
        FleetrollError: as :func:`run_job` (a failed pre-flight, a journal in use).
        KeyboardInterrupt: a Ctrl-C before the job's signal handlers or after them.
    """
    from fleetroll.pool.rollout_pool import chat_policy_config, policy_from_settings
    from fleetroll.telemetry import open_telemetry

    async def job() -> JobReport:
        # Signals are ours until telemetry is flushed: a Ctrl-C during the
        # shutdown is then one more notice, never a KeyboardInterrupt half-way.
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with open_telemetry(
                settings.telemetry, secrets=settings.secrets(), logfire_token=settings.logfire_token
            ) as events:
                policy: Any
                records: AgentRecords | None = None
                if agent_command is not None:
                    from fleetroll.rollout.agent_command import CommandAgent
                    from fleetroll.rollout.agent_process import AgentRecords

                    if out is not None:
                        # Beside the journal: a start on it ends the agents a killed
                        # run on it left (the journal's own lock is taken later).
                        records = AgentRecords(out.parent / f"{out.name}.agents")
                        await anyio.to_thread.run_sync(records.open)
                    # Its gateway serves while the batch runs; closing it closes its policy.
                    policy = CommandAgent.from_config(
                        agent_command, chat_policy_config(settings), records=records
                    )
                    try:
                        await policy.__aenter__()
                    except BaseException:
                        if records is not None:
                            records.close()
                        raise
                else:
                    policy = policy_from_settings(settings)
                try:
                    return await run_job(
                        settings,
                        tasks,
                        policy,
                        samples=samples,
                        out=out,
                        resume=resume,
                        events=events,
                        emulator_profile=profile,
                        console=console,
                        ray_address=ray_address,
                        ray_actors=ray_actors,
                        signals=signals,
                        preflight=preflight,
                        groups_target=groups_target,
                        steps=steps,
                        policy_version=policy_version,
                    )
                finally:
                    if agent_command is not None:
                        await policy.__aexit__(None, None, None)
                        if records is not None:
                            records.close()
                    else:
                        await policy.aclose()

    return anyio.run(job)


async def _release_leftovers(
    settings: Settings, fleet: FleetTarget, run_id: str, events: Events, console: Console
) -> None:
    """Release what an interrupted run of ``run_id`` left running (the journal's
    batch id is the run id; its lock says no live run has it)."""
    left = await release_run(settings, fleet, run_id, events)
    if left:
        console.print(
            f"fleetroll: released {len(left)} instance(s) of run {run_id}"
            " that the interrupted run left running"
        )


@dataclass
class _StepRun:
    """``run --steps``: batches one after another, each drawn by the sampler."""

    pool: RolloutPool
    policy: Policy
    sampler: TaskSampler
    count: int
    samples: int
    out: Path | None
    backend: str
    console: Console

    async def steps(
        self,
        run_id: str,
        previous: Sequence[RolloutResult],
        current: _Current,
        drive: _Drive,
        interrupted: anyio.Event,
        *,
        groups_target: int | None,
        policy_version: int | None,
    ) -> int:
        """Run the steps left; the number of steps finished (the sampler's step)."""
        sampler, samples, out = self.sampler, self.samples, self.out
        finished = sampler.step
        while sampler.step < self.count:
            if interrupted.is_set() or drive.stopped is not None:
                return finished
            if out is not None:  # the state this step starts from: a resume draws it again
                await _keep_sampler_state(out, sampler.state(), drive)
            draw = sampler.draw()
            step_id = step_batch_id(run_id, draw.step)
            before = [r for r in previous if r.batch_id == step_id]
            batch = current.batch = self.pool.run_batch(
                draw.tasks,
                self.policy,
                samples_per_task=samples,
                batch_id=step_id,
                previous=before,
                groups_target=groups_target,
                policy_version=policy_version,
            )
            self.console.print(
                f"fleetroll: step {draw.step + 1}/{self.count} (epoch {draw.epoch}):"
                f" batch {step_id}: {batch.total} rollouts ({len(draw.tasks)} tasks × {samples})"
                f" on {self.backend}" + (f", {len(before)} already done" if before else "")
            )
            ended = await drive.batch(batch, step=draw.step, before=before)
            if interrupted.is_set() or drive.stopped is not None:
                return finished
            for group in groups_of(step_id, samples, ended):
                sampler.observe(group)
            finished = sampler.step
        if out is not None:  # where a longer resume goes on from
            await _keep_sampler_state(out, sampler.state(), drive)
        return finished


async def _keep_sampler_state(out: Path, state: SamplerState, drive: _Drive) -> None:
    """Raises: JournalError: the state could not be written beside the journal (a full disk)."""
    try:
        await anyio.to_thread.run_sync(write_sampler_state, out, state)
    except OSError as exc:
        written = drive.journal.written if drive.journal is not None else 0
        raise JournalError(sampler_path(out), exc, written) from None


async def run_job(
    settings: Settings,
    tasks: Sequence[TaskSpec],
    policy: Policy,
    *,
    samples: int = 1,
    out: Path | None = None,
    resume: bool = False,
    events: Events | None = None,
    emulator_profile: str | None = None,
    console: Console | None = None,
    batch_id: str | None = None,
    ray_address: str | None = None,
    ray_actors: int | None = None,
    signals: AsyncIterator[int] | None = None,
    preflight: bool = True,
    groups_target: int | None = None,
    steps: Steps | None = None,
    policy_version: int | None = None,
) -> JobReport:
    """Run one batch to its end (or to an interrupt), journaling every result.

    ``groups_target``: stop the rollouts of every other group once this many
    groups are complete (``RolloutPool.run_batch``).

    Unless ``preflight`` is False, :func:`fleetroll.pool.preflight.preflight`
    runs first, before the journal is claimed and before any create.

    With ``steps``, it runs ``steps.count`` batches one after the other, each
    of the tasks a :class:`~fleetroll.training.sampler.TaskSampler` draws from
    ``tasks`` (its batch id :func:`~fleetroll.pool.journal.step_batch_id` of
    the run's id, its results' ``step`` set), and the sampler observes each
    step's groups once the step has ended. The sampler's state is saved beside
    the journal as each step starts; a resume restores it and goes on from the
    step it was interrupted in (a larger ``count`` runs more steps).

    When each of the first ``pool.stop_after_same_failures`` rollouts to
    finish failed the same way, the batch is cancelled there (the report's
    ``stopped`` says why); every rollout still gets a result.

    On resume, every rollout whose last journaled result is ``cancelled`` runs
    again, with those never journaled; the others are kept.

    ``policy_version`` tags every result of the batch (an evaluation's).

    The first SIGINT or SIGTERM cancels the batch: every rollout still gets
    its result, every instance is released. Later ones change nothing but say
    so: they never interrupt the shutdown. ``signals`` are those signals as
    ``anyio.open_signal_receiver`` delivers them; a caller with work of its own
    after this job (a telemetry flush) opens the receiver around both, so
    that a Ctrl-C then is not a ``KeyboardInterrupt`` either. Without it, the
    job opens its own.

    Raises:
        PreflightError: a pre-flight check failed; nothing was provisioned.
        ConfigError: the journal cannot be used: not a regular file, in use
            by another run, it exists and ``resume`` was not asked, or it
            belongs to another batch (other tasks or samples); or the sampler
            cannot draw from ``tasks`` or its saved state is not this run's.
        JournalError: a write to the journal failed (a full disk): the batch
            was stopped there, and the journal holds every result but those
            not written (a resume runs them).
    """
    console = console or Console(stderr=True)
    events = events or Events()
    if resume and out is None:
        raise ConfigError("--resume needs --out (the journal to resume)")
    if not settings.uses_emulator:
        settings.require_fleet_api_key()  # a missing key fails here, before the journal
    batch_id = batch_id or uuid.uuid4().hex[:12]
    batch_tasks = steps.sampler.batch_tasks if steps is not None else None
    previous: list[RolloutResult] = []
    journaled = False  # the journal held results (cancelled ones too) when claimed
    async with _resume_hint(), AsyncExitStack() as stack:
        if signals is None:
            signals = stack.enter_context(anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM))
        fleet = await open_fleet(stack, settings, emulator_profile)
        if preflight:
            # Before the journal is claimed and before any create: a typo
            # leaves nothing behind to clean up or --resume.
            await preflight_fleet(settings, fleet, tasks)
        if out is not None:
            identity = await anyio.to_thread.run_sync(
                BatchIdentity.of, batch_id, tasks, samples, settings.pool.oversample, batch_tasks
            )
            claim = await anyio.to_thread.run_sync(
                functools.partial(claim_journal, out, identity, resume=resume)
            )
            stack.callback(claim.close)  # the lock is held until the journal is closed
            batch_id, previous, journaled = claim.batch_id, claim.done, bool(claim.previous)
            if resume and not settings.uses_emulator:
                await _release_leftovers(settings, fleet, batch_id, events, console)
        sampler = None
        if steps is not None:
            sampler = await anyio.to_thread.run_sync(
                open_sampler, tasks, steps.sampler, out if journaled else None
            )
        # The journal's writer and the signal watcher outlive the pool: results
        # delivered while it shuts down are journaled, and a Ctrl-C meanwhile
        # is handled, never a KeyboardInterrupt.
        background = await stack.enter_async_context(_Background())
        journal_failed = anyio.Event()  # a write failed: the batch stops (nothing more is kept)
        journal = None
        if out is not None:
            journal = Journal(out, background, on_failed=lambda _: journal_failed.set())
            await stack.enter_async_context(journal)
        pool, backend = await open_batch_pool(
            stack, settings, fleet, events, ray_address=ray_address, ray_actors=ray_actors
        )
        started = time.monotonic()
        interrupted = anyio.Event()
        current = _Current()
        background.start_soon(_watch_signals, signals, current, interrupted, console, settings)
        drive = _Drive(journal, list(previous), console, settings, journal_failed)
        if sampler is None:
            # The pool counts them in their groups: an oversampled group runs only
            # what it still lacks (on Ray as here).
            batch = current.batch = pool.run_batch(
                tasks,
                policy,
                samples_per_task=samples,
                batch_id=batch_id,
                previous=previous,
                groups_target=groups_target,
                policy_version=policy_version,
            )
            console.print(
                f"fleetroll: batch {batch.batch_id}: {batch.total} rollouts "
                f"({len(tasks)} tasks × {samples}) on {backend}"
                + (f", {len(previous)} already done" if previous else "")
            )
            await drive.batch(batch)
        finished = 0
        if sampler is not None:
            assert steps is not None
            run = _StepRun(pool, policy, sampler, steps.count, samples, out, backend, console)
            finished = await run.steps(
                batch_id,
                previous,
                current,
                drive,
                interrupted,
                groups_target=groups_target,
                policy_version=policy_version,
            )
    return JobReport(
        batch_id=batch_id,
        results=drive.results,
        resumed=len(previous),
        elapsed_s=time.monotonic() - started,
        interrupted=interrupted.is_set(),
        backend=backend,
        journal=out,
        stopped=drive.stopped,
        steps=None if sampler is None else finished,
    )


def open_sampler(tasks: Sequence[TaskSpec], config: SamplerConfig, out: Path | None) -> TaskSampler:
    """The run's task sampler: new, or as saved beside the journal ``out`` (a resume).

    Blocking file I/O: call it from a worker thread.

    Raises:
        ConfigError: ``config`` cannot be met by ``tasks``, or ``out`` has
            results but no sampler state, or one saved for other tasks or settings.
    """
    if out is None:
        return TaskSampler(tasks, config)
    state = read_sampler_state(out)
    if state is None:
        raise ConfigError(f"cannot resume {out} with --steps: {sampler_path(out)} is missing")
    try:
        return TaskSampler(tasks, config, state)
    except ConfigError as exc:
        raise ConfigError(f"cannot resume {out}: {exc}") from None


class _Current:
    """The batch running now, for the signal watcher (a run of steps has many)."""

    batch: RunningBatch | None = None


class _Drive:
    """Runs batches of a job one at a time: journals and keeps their results,
    shows their progress, and stops the job early when its first rollouts all
    failed the same way."""

    def __init__(
        self,
        journal: Journal | None,
        results: list[RolloutResult],
        console: Console,
        settings: Settings,
        journal_failed: anyio.Event | None = None,
    ) -> None:
        self.journal = journal
        self.journal_failed = journal_failed
        self.results = results
        self.console = console
        self.settings = settings
        self.same = SameFailures(settings.pool.stop_after_same_failures)
        self.stopped: str | None = None

    async def batch(
        self,
        batch: RunningBatch,
        *,
        step: int | None = None,
        before: Sequence[RolloutResult] = (),
    ) -> list[RolloutResult]:
        """Drive ``batch`` to its end; its results, ``before`` (a resume's) first."""
        ended = list(before)
        async with _Background() as foreground:
            foreground.start_soon(
                _show_progress, batch, self.console, time.monotonic(), self.settings
            )
            if self.journal is not None and self.journal_failed is not None:
                foreground.start_soon(self._stop_when_the_journal_fails, batch)
            async for result in batch:
                if step is not None:
                    result = result.model_copy(update={"step": step})
                if self.journal:
                    result = self.journal.append(result)  # as journaled (result_error)
                self.results.append(result)
                ended.append(result)
                if self.stopped is None and (stopped := self.same.add(result)) is not None:
                    self.stopped = stopped
                    self.console.print(f"fleetroll: stopping the batch early: {stopped}")
                    batch.cancel()  # the rest still deliver their (cancelled) results
        return ended

    async def _stop_when_the_journal_fails(self, batch: RunningBatch) -> None:
        """A failed journal write stops the batch: what it runs now could not be kept."""
        assert self.journal is not None and self.journal_failed is not None
        await self.journal_failed.wait()
        if self.stopped is None:
            self.stopped = f"the journal {self.journal.path} cannot be written"
        self.console.print(
            f"fleetroll: writing the journal {self.journal.path} failed"
            f" ({_strerror(self.journal.error)}): stopping the batch"
        )
        batch.cancel()


def _strerror(error: OSError | None) -> str:
    return "" if error is None else error.strerror or str(error)


@asynccontextmanager
async def _resume_hint() -> AsyncIterator[None]:
    """A journal that could not be written ends the job with what to do about it."""
    try:
        yield
    except JournalError as exc:
        hint = (
            f" ({exc.written} results of this run were journaled, the others not kept):"
            " make room, then run the same command with --resume to run what it lacks"
        )
        raise JournalError(exc.path, exc.error, exc.written, hint) from None


#: Digits and hex ids vary between rollouts that failed the same way.
_VARYING = re.compile(r"\b[0-9a-f]{8,}\b|\d+(?:\.\d+)?")


class SameFailures:
    """Whether the first ``n`` rollouts to finish all failed the same way.

    The same way: unscored (``reward`` null), with the same ``failure_reason``
    and the same error text once numbers and hex ids are set aside. Cancelled
    rollouts never count (a cancel is not the batch's failure). ``n = 0``
    never says so.
    """

    def __init__(self, n: int) -> None:
        self._n = n
        self._seen = 0
        self._first: RolloutResult | None = None
        self._kind: tuple[str | None, str] | None = None
        self._same = True

    @staticmethod
    def _kind_of(result: RolloutResult) -> tuple[str | None, str]:
        reason = result.failure_reason.value if result.failure_reason else None
        return reason, _VARYING.sub("#", result.error or "")[:300]

    def add(self, result: RolloutResult) -> str | None:
        """Count one finished rollout; the reason to stop once the n-th makes it so."""
        if not self._n or self._seen >= self._n or result.failure_reason is FailureReason.CANCELLED:
            return None
        self._seen += 1
        kind = self._kind_of(result)
        if result.status != "failed" or result.reward is not None:
            self._same = False  # a scored rollout (max_steps, stale) is data, not a breakage
        elif self._first is None:
            self._first, self._kind = result, kind
        elif kind != self._kind:
            self._same = False
        if self._seen < self._n or not self._same or self._first is None:
            return None
        first = self._first
        reason = first.failure_reason.value if first.failure_reason else "failed"
        return (
            f"the first {self._n} rollouts to finish all failed with {reason}: {first.error}; "
            "the rest were cancelled (--resume runs them; "
            "pool.stop_after_same_failures = 0 runs a batch to its end regardless)"
        )


class _Background:
    """A task group whose tasks live as long as its block, cancelled when it ends.

    An exception of the block itself leaves as it was raised, not in a group.
    """

    async def __aenter__(self) -> TaskGroup:
        self._stack = AsyncExitStack()
        tg = await self._stack.enter_async_context(anyio.create_task_group())
        self._stack.callback(tg.cancel_scope.cancel)
        return tg

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await exit_transparently(self._stack, exc_type, exc, tb)


async def open_fleet(
    stack: AsyncExitStack, settings: Settings, emulator_profile: str | None = None
) -> FleetTarget:
    """The Fleet to use; starts the embedded emulator (on ``stack``) when none is set.

    Raises:
        ConfigError: an unknown emulator profile.
        EmulatorError: the emulator could not start.
    """
    if settings.uses_emulator:
        from fleetroll.emulator import Emulator

        emu = await stack.enter_async_context(
            Emulator(
                settings.emulator.fault_profile(emulator_profile),
                verifier_limits=settings.emulator.verifier_limits(),
                verifier_max_parallel=settings.emulator.verifier_max_parallel,
                keep_ended_instances=settings.emulator.keep_ended_instances,
                keep_ended_s=settings.emulator.keep_ended_s,
            )
        )
        return FleetTarget(emu.api_key, emu.base_url, f"emulator {emu.base_url}")
    return FleetTarget(
        settings.require_fleet_api_key(),
        settings.fleet_base_url,
        settings.fleet_base_url or "Fleet",
    )


async def _watch_signals(
    signals: AsyncIterator[int],
    current: _Current,
    interrupted: anyio.Event,
    console: Console,
    settings: Settings,
) -> None:
    """First SIGINT/SIGTERM: cancel the batch. Later ones: say what is left to do.

    Never a ``KeyboardInterrupt``: that would stop a rollout's release or the
    journal's last write half-way.
    """
    async for _ in signals:
        if not interrupted.is_set():
            interrupted.set()
            console.print(
                "fleetroll: interrupted: cancelling unfinished rollouts and releasing "
                "their instances (their results are journaled as cancelled)"
            )
            if current.batch is not None:
                await current.batch.aclose()
        else:
            console.print(
                "fleetroll: already stopping: instances still held are being released "
                f"(each within {settings.timeouts.release_s:g} s) and every result "
                "delivered is being journaled"
            )


#: An unfinished rollout older than this many times the mean duration of the
#: finished ones is overdue: it may take any time yet (a hung create, a stuck
#: tool), so the ETA becomes a lower bound, or unknown when they dominate.
_OVERDUE_FACTOR = 2.0
#: Until this many rollout durations have passed, the batch is still filling its
#: slots and the completions so far say little about its pace (see :func:`_eta_s`).
_RAMP_DURATIONS = 3.0


@dataclass(frozen=True, slots=True)
class Progress:
    """One look at a running batch, for the live line.

    ``acting`` counts rollouts holding an active slot (resetting, connecting,
    acting), at most ``pool.concurrency``; None when the pool cannot tell
    (Ray: the phases live in the actors), and then ``in_flight`` is all there is.
    """

    total: int
    done: int
    failed: int
    in_flight: int = 0  # started and not finished: every phase below
    queued: int = 0  # not started
    provisioning: int = 0  # creating an instance
    waiting: int = 0  # instance ready, waiting for an active slot
    acting: int | None = None
    finishing: int = 0  # verifying or releasing, slot given back
    concurrency: int = 0
    mean_s: float | None = None  # mean duration of the finished rollouts
    overdue: int = 0  # in flight for over _OVERDUE_FACTOR x mean_s
    age_s: float | None = None  # mean age of the rollouts in flight
    first_done_s: float | None = None  # seconds from the start to the first one finished

    @property
    def finished(self) -> int:
        return self.done + self.failed


class _Watch:
    """Looks at a batch now and then; remembers when each rollout started."""

    def __init__(self, batch: RunningBatch, concurrency: int, started: float = 0.0) -> None:
        self._batch = batch
        self._concurrency = concurrency
        self._started: dict[str, float] = {}
        self._since = started
        self._first_done: float | None = None

    def look(self, now: float) -> Progress:
        batch = self._batch
        if not isinstance(batch, Batch):
            c = batch.counts()
            return Progress(
                total=c.total,
                done=c.done,
                failed=c.failed,
                in_flight=c.running,
                queued=c.queued,
                first_done_s=self._first_seen(now, c.done + c.failed),
            )
        phases: Counter[Phase] = Counter()
        durations: list[float] = []
        ages: list[float] = []
        failed = 0
        for rollout in batch.rollouts:
            result = rollout.result
            if result is not None:
                durations.append(result.timings.total_s)
                failed += result.status == "failed"
                continue
            phases[rollout.phase] += 1
            if rollout.phase is not Phase.PENDING:
                ages.append(now - self._started.setdefault(rollout.ids.rollout_id, now))
        mean = statistics.fmean(durations) if durations else None
        return Progress(
            age_s=statistics.fmean(ages) if ages else None,
            first_done_s=self._first_seen(now, len(durations)),
            total=batch.total,
            done=len(durations) - failed,
            failed=failed,
            in_flight=len(ages),
            queued=phases[Phase.PENDING],
            provisioning=phases[Phase.PROVISIONING],
            waiting=phases[Phase.WAITING],
            acting=phases[Phase.RESETTING] + phases[Phase.CONNECTING] + phases[Phase.ACTING],
            finishing=phases[Phase.VERIFYING] + phases[Phase.RELEASING],
            concurrency=self._concurrency,
            mean_s=mean,
            overdue=0 if mean is None else sum(a > _OVERDUE_FACTOR * mean for a in ages),
        )

    def _first_seen(self, now: float, finished: int) -> float | None:
        if self._first_done is None and finished:
            self._first_done = now - self._since
        return self._first_done


def _duration(seconds: float) -> str:
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _eta_s(p: Progress, elapsed: float) -> float | None:
    """Seconds until the batch is done, by the pace it keeps; None: no pace yet.

    While the batch fills its slots (before ``_RAMP_DURATIONS`` rollout
    durations have passed) the completions so far are the fastest few and
    the time before any could finish weighs on any rate taken from them, so
    the pace comes from Little's law instead: ``in_flight`` rollouts, each in
    flight for about ``w`` seconds, finish ``in_flight / w`` a second. ``w``
    is the mean duration of those finished, or the mean age of those in
    flight when that is longer (they have not finished yet). After that, the
    pace is the completions' rate since the first one.
    """
    left = p.total - p.finished
    if left <= 0:
        return 0.0
    if p.finished == 0 or elapsed <= 0:
        return None
    w = max(p.mean_s or 0.0, p.age_s or 0.0)
    if p.mean_s is not None and p.in_flight and elapsed < _RAMP_DURATIONS * w:
        return left * w / p.in_flight
    since = elapsed - (p.first_done_s or 0.0)
    rate = p.finished / since if since >= w and since > 0 else p.finished / elapsed
    return left / rate


def _eta(p: Progress, elapsed: float) -> str:
    seconds = _eta_s(p, elapsed)
    if seconds == 0.0:
        return "ETA 0s"
    if seconds is None:
        return "ETA ?"  # no rate to go by yet
    left = p.total - p.finished
    estimate = _duration(seconds)
    if p.overdue and 2 * p.overdue >= left:
        return f"ETA ? ({p.overdue} overdue)"
    if p.overdue:
        return f"ETA >{estimate} ({p.overdue} overdue)"
    return f"ETA {estimate}"


#: The live line's parts, most important first: on a narrow terminal the
#: last ones go first (see :func:`_describe`).
_KEEP_FIRST = ("done", "eta", "failed", "rate", "acting", "in_flight", "queued",
               "provisioning", "waiting", "finishing")  # fmt: skip


def _describe(p: Progress, elapsed: float, width: int | None = None) -> str:
    """The live line; with ``width``, the least important parts left out until it fits."""
    rate = p.finished / elapsed if elapsed > 0 else 0.0
    parts = {"done": f"{p.finished}/{p.total} done"}
    if p.acting is None:
        parts["in_flight"] = f"{p.in_flight} in flight"
    else:
        parts |= {
            "acting": f"{p.acting} acting (max {p.concurrency})",
            "finishing": f"{p.finishing} finishing",
            "provisioning": f"{p.provisioning} provisioning",
            "waiting": f"{p.waiting} waiting for a slot",
            "queued": f"{p.queued} queued",
        }
    parts |= {"failed": f"{p.failed} failed", "rate": f"{rate:.1f}/s", "eta": _eta(p, elapsed)}
    shown = list(parts)
    line = " · ".join(parts.values())
    for name in reversed(_KEEP_FIRST):
        if width is None or len(line) <= width or len(shown) == 1:
            break
        if name in shown:
            shown.remove(name)
            line = " · ".join(parts[n] for n in shown)
    return line


async def _show_progress(
    batch: RunningBatch, console: Console, started: float, settings: Settings
) -> None:
    watch = _Watch(batch, settings.pool.concurrency, started)

    def line(width: int | None = None) -> str:
        now = time.monotonic()
        return _describe(watch.look(now), now - started, width)

    if console.is_terminal:
        with console.status("starting…") as status:
            while not batch.finished.is_set():
                # One line beside the spinner: cut by importance, never mid-word at the end.
                status.update(line(console.width - 2))
                await anyio.sleep(_LIVE_EVERY_S)
        return
    printed = time.monotonic()
    while not batch.finished.is_set():
        with anyio.move_on_after(_LIVE_EVERY_S):
            await batch.finished.wait()
        text = line()  # looked at often, so that the ages of rollouts are right
        if batch.finished.is_set() or time.monotonic() - printed >= _PLAIN_PROGRESS_EVERY_S:
            console.print(f"fleetroll: {text}")
            printed = time.monotonic()


def summary_table(results: Sequence[RolloutResult]) -> Table:
    """Rollouts by env and outcome, with the mean reward of those scored."""
    by_env: dict[str, list[RolloutResult]] = defaultdict(list)
    for r in results:
        by_env[f"{r.env_key}:{r.env_version}" if r.env_version else r.env_key].append(r)
    reasons = sorted({r.failure_reason.value for r in results if r.failure_reason})
    table = Table(title="rollouts by environment and outcome")
    table.add_column("env")
    table.add_column("rollouts", justify="right")
    table.add_column("completed", justify="right")
    for reason in reasons:
        table.add_column(reason, justify="right")
    table.add_column("reward mean", justify="right")
    for env, rows in sorted(by_env.items()):
        outcome = Counter(r.failure_reason.value if r.failure_reason else "completed" for r in rows)
        rewards = [r.reward for r in rows if r.reward is not None]
        table.add_row(
            env,
            str(len(rows)),
            str(outcome["completed"]),
            *(str(outcome[reason]) for reason in reasons),
            f"{statistics.fmean(rewards):.3f}" if rewards else "—",
        )
    return table


def cost_table(results: Sequence[RolloutResult]) -> Table:
    """The results' ``cost`` summed per env, with a ``total`` row (the batch) under them."""
    by_env: dict[str, list[RolloutResult]] = defaultdict(list)
    for r in results:
        by_env[f"{r.env_key}:{r.env_version}" if r.env_version else r.env_key].append(r)
    table = Table(title="cost by environment")
    table.add_column("env", no_wrap=True)
    for heading in ("instance s", "prompt tokens", "completion tokens", "policy calls"):
        table.add_column(heading, justify="right")
    table.add_column("tool calls", justify="right")
    groups = [*sorted(by_env.items()), ("total", list(results))]
    for i, (env, rows) in enumerate(groups):
        table.add_row(
            env,
            f"{sum(r.cost.instance_s for r in rows):.1f}",
            str(sum(r.cost.prompt_tokens for r in rows)),
            str(sum(r.cost.completion_tokens for r in rows)),
            str(sum(r.cost.policy_calls for r in rows)),
            str(sum(r.cost.tool_calls for r in rows)),
            end_section=i == len(groups) - 2,  # a rule above the total
        )
    return table


def print_report(
    report: JobReport, console: Console, settings: Settings | None = None, *, tables: bool = True
) -> None:
    """The closing tables (unless ``tables`` is False), the batch's totals, and where
    results and telemetry went."""
    if tables:
        console.print(summary_table(report.results))
        console.print(cost_table(report.results))
    # A cancelled rollout (Ctrl-C, an early stop) did not fail: it was not let finish.
    ran = [r for r in report.results if r.failure_reason is not FailureReason.CANCELLED]
    cancelled = len(report.results) - len(ran)
    failed = [r for r in ran if r.status == "failed"]
    common = Counter(r.error for r in failed).most_common(1)
    if failed and len(failed) == len(ran) and common:
        # Every rollout failed, most often in one way: say it plainly (a wrong
        # API key or an unknown environment looks like this).
        error, count = common[0]
        every = "every rollout that ran to its end" if cancelled else "every rollout"
        console.print(f"fleetroll: {every} failed; {count} of them with: {error}")
    if report.stopped is not None:
        console.print(f"fleetroll: stopped early: {report.stopped}")
    new = len(report.results) - report.resumed
    rate = new / report.elapsed_s if report.elapsed_s > 0 else 0.0
    what = f"batch {report.batch_id}"
    if report.steps is not None:
        what = f"run {report.batch_id} ({report.steps} steps done)"
    console.print(
        f"fleetroll: {what}: {len(report.results)} results "
        f"({new} this run, {rate:.1f}/s over {report.elapsed_s:.1f}s)"
        + (f", {cancelled} cancelled" if cancelled else "")
        + (
            " — interrupted: unfinished rollouts were cancelled; --resume runs them"
            if report.interrupted
            else (" (--resume runs them)" if cancelled else "")
        )
    )
    if report.journal is not None:
        console.print(f"fleetroll: results: {report.journal} (one JSON line per rollout)")
    else:
        console.print("fleetroll: results: not kept (pass --out FILE to journal them)")
    if settings is not None:
        batch = report.batch_id if report.steps is None else None  # a run of steps has many
        console.print(f"fleetroll: telemetry: {_telemetry_where(settings, batch)}")


def _telemetry_where(settings: Settings, batch_id: str | None) -> str:
    db = settings.telemetry.db_path
    where = (
        "local store off (telemetry.db_path is the null device)"
        if str(db) == os.devnull
        else f"{db} (fleetroll stats --db {db}"
        + (f" --batch {batch_id})" if batch_id is not None else ")")
    )
    if settings.logfire_token is not None and settings.telemetry.send_to_logfire:
        where += ", and Logfire"
    return where

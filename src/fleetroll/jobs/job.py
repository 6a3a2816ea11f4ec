"""The job: a batch of rollouts from a task file (or a run of steps), on the
Fleet it picks, with a journal, until its end or an interrupt.

``fleetroll run`` and ``fleetroll eval`` call :func:`run_job` (through
:func:`fleetroll.jobs.command.run_policy_job`); it picks its Fleet (the
embedded emulator unless ``FLEET_API_KEY`` or ``FLEET_BASE_URL`` is set),
streams results into the journal as they come, has their progress shown, and
returns every result of the batch.
"""

from __future__ import annotations

import functools
import shlex
import signal
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from anyio.abc import TaskGroup

from fleetroll.errors import ConfigError, JournalError
from fleetroll.jobs.drive import Background, Current, Drive, watch_signals
from fleetroll.jobs.fleet import open_fleet, preflight_fleet, release_leftovers
from fleetroll.jobs.output import JobOutput, Quiet
from fleetroll.jobs.report import JobReport
from fleetroll.jobs.steps import StepRun, Steps, open_sampler
from fleetroll.policies import Policy
from fleetroll.pool.batch_pool import open_batch_pool
from fleetroll.pool.journal import BatchIdentity, Journal, claim_journal
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import RolloutResult
from fleetroll.settings import Settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry.events import Events

__all__ = ["run_job"]


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
    output: JobOutput | None = None,
    batch_id: str | None = None,
    ray_address: str | None = None,
    ray_actors: int | None = None,
    signals: AsyncIterator[int] | None = None,
    preflight: bool = True,
    groups_target: int | None = None,
    steps: Steps | None = None,
    policy_version: int | None = None,
    command: Sequence[str] | None = None,
) -> JobReport:
    """Run one batch to its end (or to an interrupt), journaling every result.

    ``output`` hears the job's notices and watches each batch's progress (the
    CLI's console); without it the job runs quietly.

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

    ``command`` is the command line that resumes the job (the CLI's, with
    ``--resume``): once the batch is claimed, ``fleet_job_started`` records it
    with the journal, so ``fleetroll stats --check`` can say how to run the
    rollouts a killed run lost.

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
    output = output or Quiet()
    events = events or Events()
    if resume and out is None:
        raise ConfigError("--resume needs --out (the journal to resume)")
    if not settings.uses_emulator:
        settings.require_fleet_api_key()  # a missing key fails here, before the journal
    plan = _Plan(tasks, policy, samples, groups_target, policy_version, steps)
    async with _resume_hint(), AsyncExitStack() as stack:
        if signals is None:
            signals = stack.enter_context(anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM))
        fleet = await open_fleet(stack, settings, emulator_profile)
        if preflight:
            # Before the journal is claimed and before any create: a typo
            # leaves nothing behind to clean up or --resume.
            await preflight_fleet(settings, fleet, tasks)
        claimed = _Claimed(batch_id or uuid.uuid4().hex[:12])
        if out is not None:
            claimed = await _claim(stack, settings, plan, out, claimed.batch_id, resume=resume)
            if resume and not settings.uses_emulator:
                await release_leftovers(settings, fleet, claimed.batch_id, events, output)
        journal = None if out is None else str(await anyio.Path(out).absolute())
        events.emit(
            "fleet_job_started",
            batch_id=claimed.batch_id,
            journal=journal,
            # Without a journal there is nothing to resume: the batch runs again whole.
            resume_command=None if command is None or out is None else shlex.join(command),
        )
        sampler = None
        if steps is not None:
            sampler = await anyio.to_thread.run_sync(
                open_sampler, tasks, steps.sampler, out if claimed.journaled else None
            )
        # The journal's writer and the signal watcher outlive the pool: results
        # delivered while it shuts down are journaled, and a Ctrl-C meanwhile
        # is handled, never a KeyboardInterrupt.
        background = await stack.enter_async_context(Background())
        drive = await _open_drive(stack, background, settings, out, claimed, output)
        pool, backend = await open_batch_pool(
            stack, settings, fleet, events, ray_address=ray_address, ray_actors=ray_actors
        )
        started = time.monotonic()
        interrupted = anyio.Event()
        current = Current()
        release_s = settings.timeouts.release_s
        background.start_soon(watch_signals, signals, current, interrupted, output, release_s)
        finished = None
        if sampler is None:
            await _one_batch(pool, plan, claimed, current, drive, backend, output)
        else:
            run = StepRun(pool, policy, sampler, plan.count, samples, out, backend, output)
            finished = await run.steps(
                claimed.batch_id,
                claimed.previous,
                current,
                drive,
                interrupted,
                groups_target=groups_target,
                policy_version=policy_version,
            )
    return JobReport(
        batch_id=claimed.batch_id,
        results=drive.results,
        resumed=len(claimed.previous),
        elapsed_s=time.monotonic() - started,
        interrupted=interrupted.is_set(),
        backend=backend,
        journal=out,
        stopped=drive.stopped,
        steps=finished,
    )


@dataclass(frozen=True, slots=True)
class _Plan:
    """What the job runs: its tasks, its policy, and how its batches are drawn."""

    tasks: Sequence[TaskSpec]
    policy: Policy
    samples: int
    groups_target: int | None
    policy_version: int | None
    steps: Steps | None

    @property
    def count(self) -> int:
        return self.steps.count if self.steps is not None else 1

    @property
    def batch_tasks(self) -> int | None:
        return self.steps.sampler.batch_tasks if self.steps is not None else None


@dataclass(frozen=True, slots=True)
class _Claimed:
    """The job's batch as its journal has it: its id, the results it keeps
    (``previous``), and whether it held any (cancelled ones too) when claimed."""

    batch_id: str
    previous: list[RolloutResult] = field(default_factory=list)
    journaled: bool = False


async def _claim(
    stack: AsyncExitStack,
    settings: Settings,
    plan: _Plan,
    out: Path,
    batch_id: str,
    *,
    resume: bool,
) -> _Claimed:
    """Claim the journal ``out`` for this batch; its lock is held until ``stack`` closes."""
    identity = await anyio.to_thread.run_sync(
        BatchIdentity.of,
        batch_id,
        plan.tasks,
        plan.samples,
        settings.pool.oversample,
        plan.batch_tasks,
    )
    claim = await anyio.to_thread.run_sync(
        functools.partial(claim_journal, out, identity, resume=resume)
    )
    stack.callback(claim.close)  # the lock is held until the journal is closed
    return _Claimed(claim.batch_id, claim.done, bool(claim.previous))


async def _open_drive(
    stack: AsyncExitStack,
    background: TaskGroup,
    settings: Settings,
    out: Path | None,
    claimed: _Claimed,
    output: JobOutput,
) -> Drive:
    """The job's drive, with its journal (written in ``background``) when ``out`` is set."""
    journal_failed = anyio.Event()  # a write failed: the batch stops (nothing more is kept)
    journal = None
    if out is not None:
        journal = Journal(
            out,
            background,
            on_failed=lambda _: journal_failed.set(),
            images=settings.policy.image_store,
        )
        await stack.enter_async_context(journal)
    stop_after = settings.pool.stop_after_same_failures
    return Drive(journal, list(claimed.previous), output, stop_after, journal_failed)


async def _one_batch(
    pool: RolloutPool,
    plan: _Plan,
    claimed: _Claimed,
    current: Current,
    drive: Drive,
    backend: str,
    output: JobOutput,
) -> None:
    """The job's one batch (no steps), driven to its end."""
    previous = claimed.previous
    # The pool counts them in their groups: an oversampled group runs only
    # what it still lacks (on Ray as here).
    batch = current.batch = pool.run_batch(
        plan.tasks,
        plan.policy,
        samples_per_task=plan.samples,
        batch_id=claimed.batch_id,
        previous=previous,
        groups_target=plan.groups_target,
        policy_version=plan.policy_version,
    )
    output.say(
        f"fleetroll: batch {batch.batch_id}: {batch.total} rollouts "
        f"({len(plan.tasks)} tasks × {plan.samples}) on {backend}"
        + (f", {len(previous)} already done" if previous else "")
    )
    await drive.batch(batch)


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

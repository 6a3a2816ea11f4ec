"""A run of steps (``run --steps``): batches one after another, each of the
tasks a :class:`~fleetroll.training.sampler.TaskSampler` draws next, with the
sampler's state kept beside the journal so that a resume goes on from it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio

from fleetroll.errors import ConfigError, JournalError
from fleetroll.jobs.drive import Current, Drive
from fleetroll.jobs.output import JobOutput
from fleetroll.policies import Policy
from fleetroll.pool.journal import (
    read_sampler_state,
    sampler_path,
    step_batch_id,
    write_sampler_state,
)
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import RolloutResult
from fleetroll.tasks import TaskSpec
from fleetroll.training.groups import groups_of
from fleetroll.training.sampler import SamplerConfig, SamplerState, TaskSampler

__all__ = ["StepRun", "Steps", "open_sampler"]


@dataclass(frozen=True, slots=True)
class Steps:
    """A run of steps (``--steps``, ``--batch-tasks``): ``count`` batches, each
    of the tasks the sampler draws next (:mod:`fleetroll.training.sampler`)."""

    count: int
    sampler: SamplerConfig


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


@dataclass
class StepRun:
    """``run --steps``: batches one after another, each drawn by the sampler."""

    pool: RolloutPool
    policy: Policy
    sampler: TaskSampler
    count: int
    samples: int
    out: Path | None
    backend: str
    output: JobOutput

    async def steps(
        self,
        run_id: str,
        previous: Sequence[RolloutResult],
        current: Current,
        drive: Drive,
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
            self.output.say(
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


async def _keep_sampler_state(out: Path, state: SamplerState, drive: Drive) -> None:
    """Raises: JournalError: the state could not be written beside the journal (a full disk)."""
    try:
        await anyio.to_thread.run_sync(write_sampler_state, out, state)
    except OSError as exc:
        written = drive.journal.written if drive.journal is not None else 0
        raise JournalError(sampler_path(out), exc, written) from None

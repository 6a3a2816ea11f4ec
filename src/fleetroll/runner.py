"""The main job: a batch of rollouts from a task file, with a journal and progress.

``fleetroll run`` builds the settings, then calls :func:`run_job`; the job
picks its Fleet (the embedded emulator unless ``FLEET_API_KEY`` or
``FLEET_BASE_URL`` is set), streams results into the journal as they come,
shows progress, and returns every result of the batch.
"""

from __future__ import annotations

import signal
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Collection, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import anyio
from rich.console import Console
from rich.table import Table

from fleetroll.batch_pool import RunningBatch, open_batch_pool
from fleetroll.errors import ConfigError, TaskFileError
from fleetroll.journal import Journal, read_journal
from fleetroll.policies import Policy
from fleetroll.pool import BatchCounts
from fleetroll.results import RolloutResult
from fleetroll.settings import Settings
from fleetroll.tasks import TaskSpec, load_tasks
from fleetroll.telemetry.events import Events

__all__ = [
    "FleetTarget",
    "JobReport",
    "load_task_paths",
    "open_fleet",
    "run_job",
    "summary_table",
]

_PLAIN_PROGRESS_EVERY_S = 10.0


@dataclass(frozen=True, slots=True)
class JobReport:
    batch_id: str
    results: list[RolloutResult]  # every result of the batch, resumed ones included
    resumed: int
    elapsed_s: float
    interrupted: bool
    backend: str


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
    ray_actors: int = 2,
) -> JobReport:
    """Run one batch to its end (or to an interrupt), journaling every result.

    Raises:
        ConfigError: the journal cannot be resumed (it belongs to other tasks
            or another batch), or it exists and ``resume`` was not asked.
    """
    console = console or Console(stderr=True)
    events = events or Events()
    previous = _previous_results(out, resume, tasks)
    if previous:
        batch_id = previous[0].batch_id
    async with AsyncExitStack() as stack:
        fleet = await open_fleet(stack, settings, emulator_profile)
        pool, backend = await open_batch_pool(
            stack, settings, fleet, events, ray_address=ray_address, ray_actors=ray_actors
        )
        tg = await stack.enter_async_context(anyio.create_task_group())
        journal = await stack.enter_async_context(Journal(out, tg)) if out else None
        started = time.monotonic()
        batch = pool.run_batch(
            tasks,
            policy,
            samples_per_task=samples,
            batch_id=batch_id,
            skip={r.rollout_id for r in previous},
        )
        console.print(
            f"fleetroll: batch {batch.batch_id}: {batch.total} rollouts "
            f"({len(tasks)} tasks × {samples}) on {backend}"
            + (f", {len(previous)} already done" if previous else "")
        )
        interrupted = anyio.Event()
        tg.start_soon(_watch_signals, batch, interrupted)
        tg.start_soon(_show_progress, batch, console, started)
        results = list(previous)
        async for result in batch:
            if journal:
                journal.append(result)
            results.append(result)
        tg.cancel_scope.cancel()
    return JobReport(
        batch_id=batch.batch_id,
        results=results,
        resumed=len(previous),
        elapsed_s=time.monotonic() - started,
        interrupted=interrupted.is_set(),
        backend=backend,
    )


@dataclass(frozen=True, slots=True)
class FleetTarget:
    """Where instances come from: Fleet, a Fleet at FLEET_BASE_URL, or the emulator."""

    api_key: str
    base_url: str | None
    description: str


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
                verifier_memory_mb=settings.emulator.verifier_memory_mb,
            )
        )
        return FleetTarget(emu.api_key, emu.base_url, f"emulator {emu.base_url}")
    key = settings.fleet_api_key
    # A standalone emulator (FLEET_BASE_URL only) takes any key.
    return FleetTarget(
        key.get_secret_value() if key else "fleetroll-no-key",
        settings.fleet_base_url,
        settings.fleet_base_url or "Fleet",
    )


def load_task_paths(paths: Sequence[Path], modalities: Collection[str]) -> list[TaskSpec]:
    """Tasks from files and folders (a folder means its ``*.jsonl`` and ``*.json``).

    Raises:
        TaskFileError: a file is invalid, a folder holds no task file, or a key
            appears in two files.
    """
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".json"))
            if not found:
                raise TaskFileError("no .jsonl or .json task file in this folder", path=str(path))
            files += found
        else:
            files.append(path)
    tasks: list[TaskSpec] = []
    seen: dict[str, Path] = {}
    for file in files:
        for task in load_tasks(file, modalities=modalities):
            if task.key in seen:
                raise TaskFileError(
                    f"duplicate key {task.key!r}, also in {seen[task.key]}",
                    path=str(file),
                    field="key",
                )
            seen[task.key] = file
            tasks.append(task)
    return tasks


def _previous_results(
    out: Path | None, resume: bool, tasks: Sequence[TaskSpec]
) -> list[RolloutResult]:
    if out is None or not out.exists() or out.stat().st_size == 0:
        if resume and out is None:
            raise ConfigError("--resume needs --out (the journal to resume)")
        return []
    if not resume:
        raise ConfigError(
            f"{out} already exists: pass --resume to continue that batch, or choose another --out"
        )
    try:
        previous = read_journal(out)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    batches = {r.batch_id for r in previous}
    if len(batches) > 1:
        raise ConfigError(f"{out} holds results of several batches ({', '.join(batches)})")
    unknown = {r.task_key for r in previous} - {t.key for t in tasks}
    if unknown:
        raise ConfigError(
            f"{out} holds results for tasks not in this task file: {', '.join(sorted(unknown)[:5])}"
        )
    return previous


async def _watch_signals(batch: RunningBatch, interrupted: anyio.Event) -> None:
    """First SIGINT/SIGTERM: cancel the batch cleanly. Second: stop waiting."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            if interrupted.is_set():
                raise KeyboardInterrupt
            interrupted.set()
            await batch.aclose()


def _describe(counts: BatchCounts, elapsed: float) -> str:
    rate = counts.finished / elapsed if elapsed > 0 else 0.0
    left = counts.total - counts.finished
    eta = f"{left / rate:.0f}s" if rate > 0 else "?"
    return (
        f"{counts.finished}/{counts.total} done · {counts.running} running · "
        f"{counts.provisioning} provisioning · {counts.queued} queued · "
        f"{counts.failed} failed · {rate:.1f}/s · ETA {eta}"
    )


async def _show_progress(batch: RunningBatch, console: Console, started: float) -> None:
    if console.is_terminal:
        with console.status("starting…") as status:
            while not batch.finished.is_set():
                status.update(_describe(batch.counts(), time.monotonic() - started))
                await anyio.sleep(0.5)
        return
    while not batch.finished.is_set():
        with anyio.move_on_after(_PLAIN_PROGRESS_EVERY_S):
            await batch.finished.wait()
        console.print(f"fleetroll: {_describe(batch.counts(), time.monotonic() - started)}")


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


def print_report(report: JobReport, console: Console, out: TextIO = sys.stderr) -> None:
    console.print(summary_table(report.results))
    failed = [r for r in report.results if r.status == "failed"]
    common = Counter(r.error for r in failed).most_common(1)
    if failed and len(failed) == len(report.results) and common:
        # Every rollout failed, most often in one way: say it plainly (a wrong
        # API key or an unknown environment looks like this).
        error, count = common[0]
        console.print(f"fleetroll: every rollout failed; {count} of them with: {error}")
    new = len(report.results) - report.resumed
    rate = new / report.elapsed_s if report.elapsed_s > 0 else 0.0
    console.print(
        f"fleetroll: batch {report.batch_id}: {len(report.results)} results "
        f"({new} this run, {rate:.1f}/s over {report.elapsed_s:.1f}s)"
        + (" — interrupted: unfinished rollouts were cancelled" if report.interrupted else "")
    )

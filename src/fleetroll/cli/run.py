"""``fleetroll run``'s and ``fleetroll eval``'s console: the job's notices, its
live progress line, the closing tables, and the exit code of how it ended.

The job itself is the engine's (:mod:`fleetroll.jobs`): :func:`run_command`
runs :func:`fleetroll.jobs.command.run_policy_job` with a
:class:`ConsoleOutput`, which prints what the job says and shows each batch's
progress (:mod:`fleetroll.jobs.progress`) as a live line.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from rich.console import Console
from rich.table import Table

from fleetroll.jobs.command import run_policy_job
from fleetroll.jobs.progress import Progress, Watch, eta_s
from fleetroll.jobs.report import JobReport
from fleetroll.jobs.steps import Steps
from fleetroll.pool.batch_pool import RunningBatch
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.settings import Settings
from fleetroll.tasks import TaskSpec

__all__ = [
    "ConsoleOutput",
    "cost_table",
    "exit_as_ended",
    "print_report",
    "run_command",
    "summary_table",
]

_PLAIN_PROGRESS_EVERY_S = 10.0
_LIVE_EVERY_S = 0.5


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
    command: Sequence[str] | None = None,
) -> JobReport:
    """A command's job (``run``, ``eval``): :func:`~fleetroll.jobs.command.run_policy_job`,
    its notices and progress on ``console``.

    Raises:
        FleetrollError: as :func:`~fleetroll.jobs.job.run_job` (a failed pre-flight,
            a journal in use).
        KeyboardInterrupt: a Ctrl-C before the job's signal handlers or after them.
    """
    job = functools.partial(
        run_policy_job,
        settings,
        tasks,
        samples=samples,
        out=out,
        resume=resume,
        profile=profile,
        preflight=preflight,
        output=ConsoleOutput(console, settings.pool.concurrency),
        agent_command=agent_command,
        ray_address=ray_address,
        ray_actors=ray_actors,
        groups_target=groups_target,
        steps=steps,
        policy_version=policy_version,
        command=command,
    )
    return anyio.run(job)


def exit_as_ended(report: JobReport) -> None:
    """End the command as the job ended: 130 when interrupted, 1 when stopped early.

    Raises:
        SystemExit: it was interrupted, or stopped early.
    """
    if report.interrupted:
        raise SystemExit(130)
    if report.stopped is not None:
        raise SystemExit(1)


class JsonConsole(Console):
    """A job's console when ``telemetry.console = "json"``: every line one JSON object.

    Notices, progress and the closing summary lines are events (``level``,
    ``event``: the text, ``logger``: ``fleetroll.cli``); the closing tables are
    left out (their numbers are in the results and telemetry). Never a
    terminal, so progress is a line every so often, never a spinner.
    """

    def __init__(self) -> None:
        super().__init__(stderr=True, soft_wrap=True, force_terminal=False)

    @property
    def is_terminal(self) -> bool:
        return False

    def print(self, *objects: Any, **_: Any) -> None:
        from fleetroll.telemetry.console import json_line

        out = sys.stderr
        for thing in objects:
            if isinstance(thing, str):
                text = thing.removeprefix("fleetroll: ")
                out.write(json_line("info", text, logger="fleetroll.cli") + "\n")
        out.flush()


def job_console(settings: Settings) -> Console:
    """The console of ``fleetroll run`` and ``fleetroll eval`` (stderr), as
    ``telemetry.console`` asks: for people, or one JSON object a line."""
    if settings.telemetry.console == "json":
        return JsonConsole()
    return Console(stderr=True, soft_wrap=True)


@dataclass(frozen=True, slots=True)
class ConsoleOutput:
    """A job's :class:`~fleetroll.jobs.output.JobOutput` on a console: its notices
    printed, each batch's progress a live line (``concurrency``: the pool's)."""

    console: Console
    concurrency: int

    def say(self, line: str) -> None:
        self.console.print(line)

    async def watch(self, batch: RunningBatch, started: float) -> None:
        await _show_progress(batch, self.console, started, self.concurrency)


def _duration(seconds: float) -> str:
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _eta(p: Progress, elapsed: float) -> str:
    seconds = eta_s(p, elapsed)
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
_KEEP_FIRST = ("done", "eta", "failed", "rate", "cancelled", "acting", "in_flight", "queued",
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
    parts["failed"] = f"{p.failed} failed"
    if p.cancelled:  # after a Ctrl-C or an early stop: they did not fail
        parts["cancelled"] = f"{p.cancelled} cancelled"
    parts |= {"rate": f"{rate:.1f}/s", "eta": _eta(p, elapsed)}
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
    batch: RunningBatch, console: Console, started: float, concurrency: int
) -> None:
    """The live line: beside a spinner on a terminal, else a line every so often."""
    watch = Watch(batch, concurrency, started)

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

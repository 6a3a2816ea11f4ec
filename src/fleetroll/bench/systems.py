"""The harness around every measured run, and fleetroll's own run.

Each run gets a fresh emulator process with the scenario's profile (same
profile, same seed, so every system meets the same platform), a watchdog
measuring event-loop lag, and CPU/RSS readings of this process and of the
emulator. The run itself is a :data:`System`: an async function from a
:class:`RunContext` to an :class:`Outcome`, bounded by the scenario's wall
limit whatever the system does.
"""

from __future__ import annotations

import gc
import io
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from fleetroll.bench.measure import (
    CpuClock,
    LoopLag,
    machine_cpu_s,
    peak_rss_mb,
    percentile,
    process_tree_cpu_s,
    reset_peak_rss,
)
from fleetroll.bench.records import (
    BUSY_CORES,
    PHASES,
    Percentiles,
    RunRecord,
    Sample,
    load_average,
)
from fleetroll.bench.scenarios import Scenario
from fleetroll.emulator.process import EmulatorProcess
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import RolloutResult
from fleetroll.settings import Settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry import open_telemetry
from fleetroll.telemetry.events import Events

__all__ = ["Outcome", "RunContext", "System", "measure_run", "run_fleetroll"]

#: Past their deadline budget by more than this counts as "past deadline".
DEADLINE_SLACK_S = 5.0
#: How long after a run the ledger is read (lets a cut-off run's last closes land).
_SETTLE_S = 1.0


@dataclass(frozen=True, slots=True)
class RunContext:
    """What a system gets for one run."""

    scenario: Scenario
    concurrency: int
    tasks: Sequence[TaskSpec]
    samples_per_task: int
    settings: Settings
    base_url: str
    api_key: str

    @property
    def requested(self) -> int:
        return len(self.tasks) * self.samples_per_task

    def policy(self) -> ScriptedPolicy:
        return ScriptedPolicy(think_time_s=self.scenario.think_s)


@dataclass
class Outcome:
    """What a system's run produced."""

    samples: list[Sample]
    returned: int
    finished_on_its_own: bool
    notes: list[str] = field(default_factory=list)
    #: Called after the ledger is read: stops whatever the run left running.
    cleanup: Callable[[], Awaitable[None]] | None = None


System = Callable[[RunContext], Awaitable[Outcome]]


def deadline_budget_s(settings: Settings) -> float:
    """The longest a rollout may take by its deadlines: provisioning, acting,
    verification and release, each bounded on its own."""
    t = settings.timeouts
    return t.provision_total_s + t.rollout_s + t.verifier_s + t.release_s


async def run_fleetroll(ctx: RunContext) -> Outcome:
    """One batch through :class:`RolloutPool`, as a training loop would run it."""
    scenario = ctx.scenario
    policy = ctx.policy()
    async with (
        _telemetry(ctx.settings, on=scenario.telemetry, tool_calls=scenario.tool_calls) as events,
        RolloutPool(
            ctx.settings, api_key=ctx.api_key, base_url=ctx.base_url, events=events
        ) as pool,
    ):
        batch = pool.run_batch(
            ctx.tasks,
            policy,
            samples_per_task=ctx.samples_per_task,
            deadline_s=scenario.wall_limit_s,
        )
        # The batch deadline cancels what is left; every result still comes,
        # after releases that are bounded by release_s.
        t = ctx.settings.timeouts
        with anyio.fail_after(scenario.wall_limit_s + t.release_s + t.verifier_s + 30):
            results = await batch.results()
        cut = batch.scope.cancel_called  # read before the pool's exit cancels every batch
    notes = ["the batch deadline (wall limit) cancelled it"] if cut else []
    # The output contract: no reward means a failure_reason says why.
    silent = [r for r in results if r.reward is None and r.failure_reason is None]
    if silent:
        r = silent[0]
        notes.append(
            f"{len(silent)} result(s) with neither a reward nor a failure_reason "
            f"(first: status={r.status}, steps={r.steps}, error={r.error!r}, "
            f"verifier={r.verifier.model_dump() if r.verifier else None})"
        )
    return Outcome(
        samples=[_sample(r) for r in results],
        returned=len(results),
        finished_on_its_own=not cut,
        notes=notes,
    )


@asynccontextmanager
async def _telemetry(
    settings: Settings, *, on: bool, tool_calls: bool = True
) -> AsyncIterator[Events]:
    """The telemetry ``fleetroll run`` sets up (its store in a temporary folder, its
    console's lines dropped), or none: what a user's run costs, or the floor.
    ``tool_calls``: ``telemetry.tool_calls``."""
    if not on:
        yield Events()
        return
    with tempfile.TemporaryDirectory(prefix="fleetroll-bench-") as folder:
        telemetry = settings.telemetry.model_copy(
            update={"db_path": Path(folder) / "t.db", "tool_calls": tool_calls}
        )
        local = settings.model_copy(update={"telemetry": telemetry})
        async with open_telemetry(
            local.telemetry,
            secrets=local.secrets(),
            logfire_token=local.logfire_token,
            console=_Discard(),
        ) as events:
            yield events


class _Discard(io.StringIO):
    """A console whose lines are formatted (their cost counts) and dropped."""

    def write(self, text: str) -> int:
        return len(text)


async def _guarded(system: System, ctx: RunContext) -> Outcome:
    """The system's outcome; a crash of the system is reported, not raised."""
    try:
        return await system(ctx)
    except Exception as exc:  # the run's boundary: the report says what broke
        return Outcome(
            samples=[],
            returned=0,
            finished_on_its_own=False,
            notes=[f"the run raised {type(exc).__name__}: {str(exc)[:300]}"],
        )


def _percentiles(values: Sequence[float]) -> Percentiles:
    def at(q: float) -> float | None:
        value = percentile(values, q)
        return None if value is None else round(value, 4)

    return Percentiles(p50=at(50), p95=at(95), p99=at(99))


def _sample(result: RolloutResult) -> Sample:
    reason = result.failure_reason.value if result.failure_reason else None
    return Sample(reward=result.reward, failure=reason, timings=result.timings)


async def measure_run(
    name: str,
    system: System,
    *,
    scenario: Scenario,
    concurrency: int | None,
    tasks: Sequence[TaskSpec],
    samples_per_task: int,
    settings: Settings,
    ideal_s: float | None,
) -> RunRecord:
    """Run ``system`` once against a fresh emulator and measure it.

    ``concurrency`` None means the system has no limit of its own (it then
    gets the number of rollouts, which it ignores).
    """
    load = load_average()
    requested = len(tasks) * samples_per_task
    async with EmulatorProcess(scenario.profile) as emu:
        assert emu.pid is not None
        ctx = RunContext(
            scenario=scenario,
            concurrency=concurrency or requested,
            tasks=tasks,
            samples_per_task=samples_per_task,
            settings=settings,
            base_url=emu.base_url,
            api_key=emu.api_key,
        )
        gc.collect()
        rss_of_run = reset_peak_rss()
        emulator_cpu_before = process_tree_cpu_s(emu.pid)
        machine_cpu_before = machine_cpu_s()
        lag = LoopLag()
        async with anyio.create_task_group() as tg:
            await tg.start(lag.run)
            cpu_before = CpuClock.now()
            began = time.perf_counter()
            outcome = await _guarded(system, ctx)
            makespan = time.perf_counter() - began
            cpu = CpuClock.now().since(cpu_before)
            tg.cancel_scope.cancel()
        rss = peak_rss_mb()
        machine_cpu = machine_cpu_s()
        emulator_cpu_after = process_tree_cpu_s(emu.pid)
        await anyio.sleep(_SETTLE_S)
        with anyio.fail_after(30):
            ledger = await emu.ledger()
        leaked_after_cleanup = None
        if outcome.cleanup is not None:
            with anyio.fail_after(60):
                await outcome.cleanup()
            await anyio.sleep(_SETTLE_S)
            with anyio.fail_after(30):
                leaked_after_cleanup = int((await emu.ledger()).get("running", 0))
    machine_cpu = (
        machine_cpu - machine_cpu_before
        if machine_cpu is not None and machine_cpu_before is not None
        else None
    )
    emulator_cpu = (
        emulator_cpu_after - emulator_cpu_before
        if emulator_cpu_after is not None and emulator_cpu_before is not None
        else None
    )
    return _record(
        name,
        scenario=scenario,
        concurrency=concurrency,
        requested=requested,
        settings=settings,
        outcome=outcome,
        makespan=makespan,
        ideal_s=ideal_s,
        lag=lag,
        rss=rss,
        rss_of_run=rss_of_run,
        cpu=cpu,
        emulator_cpu=emulator_cpu,
        machine_cpu=machine_cpu,
        ledger=ledger,
        leaked_after_cleanup=leaked_after_cleanup,
        load=load,
    )


def _record(
    name: str,
    *,
    scenario: Scenario,
    concurrency: int | None,
    requested: int,
    settings: Settings,
    outcome: Outcome,
    makespan: float,
    ideal_s: float | None,
    lag: LoopLag,
    rss: float,
    rss_of_run: bool,
    cpu: float,
    emulator_cpu: float | None,
    machine_cpu: float | None,
    ledger: dict[str, Any],
    leaked_after_cleanup: int | None,
    load: float | None,
) -> RunRecord:
    samples = outcome.samples
    budget = deadline_budget_s(settings)
    over = sum(1 for s in samples if s.timings.total_s > budget + DEADLINE_SLACK_S)
    unfinished = requested - len(samples)
    notes = list(outcome.notes)
    if unfinished:
        notes.append(f"{unfinished} rollouts never ended (cut off by the wall limit)")
        if scenario.wall_limit_s > budget + DEADLINE_SLACK_S:
            over += unfinished
    scored = sum(1 for s in samples if s.reward is not None)
    failures = Counter(s.failure or "none" for s in samples)
    if unfinished:
        failures["never ended"] += unfinished
    phases = {phase: _percentiles([getattr(s.timings, phase) for s in samples]) for phase in PHASES}
    others = None if machine_cpu is None else max(0.0, machine_cpu - cpu - (emulator_cpu or 0.0))
    return RunRecord(
        scenario=scenario.name,
        system=name,
        concurrency=concurrency,
        requested=requested,
        returned=outcome.returned,
        scored=scored,
        failures=dict(failures),
        finished_on_its_own=outcome.finished_on_its_own,
        makespan_s=round(makespan, 3),
        ideal_s=None if ideal_s is None else round(ideal_s, 3),
        overhead=None if not ideal_s else round(makespan / ideal_s, 4),
        rollouts_per_s=round(scored / makespan, 3) if makespan > 0 else 0.0,
        phases=phases,
        loop_lag_p99_ms=lag.p99_ms(),
        loop_lag_max_ms=lag.max_ms(),
        peak_rss_mb=round(rss, 1),
        peak_rss_of_run=rss_of_run,
        cpu_s=round(cpu, 3),
        cpu_ms_per_rollout=round(cpu / requested * 1000, 2) if requested else 0.0,
        cpu_utilisation=round(cpu / makespan, 3) if makespan > 0 else 0.0,
        emulator_cpu_s=None if emulator_cpu is None else round(emulator_cpu, 3),
        emulator_cpu_utilisation=(
            None if emulator_cpu is None or makespan <= 0 else round(emulator_cpu / makespan, 3)
        ),
        leaked=int(ledger.get("running", 0)),
        leaked_after_cleanup=leaked_after_cleanup,
        past_deadline=over,
        deadline_budget_s=budget,
        load_average_before=load,
        other_cpu_utilisation=None if others is None else round(others / makespan, 3),
        provisional=others is None or others / makespan > BUSY_CORES,
        ledger={
            k: ledger.get(k)
            for k in (
                "created",
                "deleted",
                "running",
                "peak_running",
                "peak_concurrent_creates",
                "tool_calls",
                "creates_by_outcome",
                "tool_calls_by_outcome",
                "verifier_runs",
            )
        },
        notes=notes,
    )

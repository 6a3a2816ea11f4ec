"""One scenario, end to end: every system at every concurrency, then the report."""

from __future__ import annotations

import logging
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime

from fleetroll.bench.baselines import BASELINE_SYSTEMS
from fleetroll.bench.ideal import IdealModel, ideal_makespan
from fleetroll.bench.policy_turn import policy_turn_bench
from fleetroll.bench.records import Machine, RunRecord, ScenarioReport, SystemSummary, summarize
from fleetroll.bench.scenarios import Scenario, bench_tasks, fleetroll_settings
from fleetroll.bench.systems import measure_run, run_fleetroll
from fleetroll.bench.toolcall import tool_call_bench
from fleetroll.settings import Settings, load_settings
from fleetroll.tasks import TaskSpec

__all__ = ["quiet_libraries", "run_scenario", "with_overrides"]

_UNLIMITED_RATE = 1e9


#: Library loggers silenced during runs (see :func:`quiet_libraries`).
_NOISY_LOGGERS = ("httpx_retries", "mcp")


@contextmanager
def quiet_libraries() -> Iterator[None]:
    """Silence library log lines during runs: the SDK retry transport's line
    per retry, and the mcp client's tracebacks when a
    session is cancelled (the naive baseline's clean-up).

    Under chaos they print thousands of console lines, whose cost would be
    charged to whichever system is running; retries and failures are counted
    elsewhere (results, the emulator's ledger).
    """
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _ideal(
    scenario: Scenario, settings: Settings, rollouts: int, limit: int | None
) -> float | None:
    if scenario.faulty:
        return None  # failures and retries have no ideal
    p = settings.provisioning
    model = IdealModel.of(
        scenario.profile,
        rollouts=rollouts,
        concurrency=limit or rollouts,
        max_creates=p.max_concurrent_creates if limit else rollouts,
        creates_per_second=p.creates_per_second if limit else _UNLIMITED_RATE,
        steps=scenario.steps,
        think_s=scenario.think_s,
    )
    return ideal_makespan(model)


def _summary(run: RunRecord) -> str:
    overhead = f"{run.overhead:.3f}x ideal" if run.overhead else "no ideal"
    return (
        f"  {run.system:<23} C={run.concurrency or 'inf':<5} "
        f"{run.returned}/{run.requested} returned, {run.scored} scored, "
        f"{run.makespan_s:.1f} s ({overhead}), {run.rollouts_per_s:.2f}/s, "
        f"lag p99 {run.loop_lag_p99_ms or 0:.0f} ms, leaked {run.leaked}, "
        f"{'finished' if run.finished_on_its_own else 'DID NOT FINISH on its own'}"
    )


async def run_scenario(
    scenario: Scenario,
    *,
    baselines: Sequence[str],
    config_file: str | None = None,
    echo: Callable[[str], None] = print,
) -> ScenarioReport:
    """Run ``scenario`` for fleetroll and each baseline; the report holds every run.

    Raises:
        ConfigError: the settings (or the scenario's overrides) are invalid.
        EmulatorError: an emulator process did not start.
    """
    report = ScenarioReport(
        scenario=scenario.name,
        description=scenario.description,
        command=shlex.join(["fleetroll", "bench", *sys.argv[2:]])
        if len(sys.argv) > 1 and sys.argv[1] == "bench"
        else f"fleetroll bench --scenario {scenario.name}",
        started_at=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        machine=Machine.here(),
        parameters={
            "rollouts": scenario.rollouts,
            "concurrency": list(scenario.concurrency),
            "steps": scenario.steps,
            "think_s": scenario.think_s,
            "profile": scenario.profile_name or scenario.profile.model_dump(exclude_defaults=True),
            "timeouts": dict(scenario.timeouts),
            "baselines": list(baselines),
            "discovery_wait_s": scenario.discovery_wait_s,
            "wall_limit_s": scenario.wall_limit_s,
            "telemetry": (
                "both"
                if scenario.telemetry_off_too
                else "tool-calls"
                if scenario.tool_calls_off_too
                else ("on" if scenario.telemetry else "off")
            ),
            # The CLI's (fleetroll._internal.gc_policy): the process's collector.
            "gc_policy": load_settings(config_file).pool.gc_policy,
            "warm_up_rollouts": WARM_UP_ROLLOUTS,
            "repeat": scenario.repeat,
        },
    )
    if scenario.kind == "tool-call":
        settings = fleetroll_settings(scenario, 1, config_file)
        echo(f"{scenario.name}: {scenario.rollouts} calls per client, interleaved")
        report.tool_calls = await tool_call_bench(scenario, scenario.rollouts, settings)
        r = report.tool_calls
        echo(f"  fleetroll / bare: {r.ratio_mean:.3f}x mean, {r.ratio_p50:.3f}x median")
        return report
    if scenario.kind == "policy-turn":
        echo(f"{scenario.name}: {scenario.rollouts} rollouts of {scenario.steps} turns")
        report.policy_turns = await policy_turn_bench(
            turns=scenario.steps, screenshot_kb=scenario.screenshot_kb, repeat=scenario.rollouts
        )
        first, last = report.policy_turns.rows[0], report.policy_turns.rows[-1]
        echo(
            f"  build, encoded once: {first.encoded_ms:.2f} ms at turn 1, "
            f"{last.encoded_ms:.2f} ms at turn {last.turn} "
            f"(whole: {first.whole_ms:.2f} -> {last.whole_ms:.2f} ms)"
        )
        return report

    if scenario.kind == "weight-update":
        from fleetroll.bench.weight_updates import weight_update_bench  # needs torch

        echo(f"{scenario.name}: {scenario.rollouts} rollouts per mode, {scenario.description}")
        report.weight_updates = await weight_update_bench(
            scenario, config_file=config_file, echo=echo
        )
        return report

    tasks, samples = bench_tasks(scenario.rollouts, scenario.steps, scenario.samples_per_task)
    n = len(tasks) * samples
    echo(f"{scenario.name}: {n} rollouts ({len(tasks)} tasks x {samples}), {scenario.description}")
    await _warm_up(scenario, tasks, config_file, echo)
    for concurrency in scenario.concurrency:
        settings = fleetroll_settings(scenario, concurrency, config_file)
        ideal = _ideal(scenario, settings, n, concurrency)
        systems = [("fleetroll", run_fleetroll, scenario)]
        if scenario.telemetry_off_too:
            bare = replace(scenario, telemetry=False)
            systems.append(("fleetroll-telemetry-off", run_fleetroll, bare))
        if scenario.tool_calls_off_too:
            fewer = replace(scenario, tool_calls=False)
            systems.append(("fleetroll-tool-calls-off", run_fleetroll, fewer))
        for name in ("fresh-session", "cpu-floor"):
            if name in baselines:
                systems.append((name, BASELINE_SYSTEMS[name], scenario))
        for round_ in range(1, scenario.repeat + 1):
            if scenario.repeat > 1:
                echo(f"  round {round_} of {scenario.repeat}")
            # Each round starts with the next system: none always runs first.
            turn = (round_ - 1) % len(systems)
            for name, system, as_run in systems[turn:] + systems[:turn]:
                run = await measure_run(
                    name,
                    system,
                    scenario=as_run,
                    concurrency=concurrency,
                    tasks=tasks,
                    samples_per_task=samples,
                    settings=settings,
                    ideal_s=ideal,
                )
                run.round = round_
                report.runs.append(run)
                echo(_summary(run))
    if "naive-gather" in baselines:
        # No limit of its own: one run, whatever the concurrency list says.
        settings = fleetroll_settings(scenario, max(scenario.concurrency), config_file)
        run = await measure_run(
            "naive-gather",
            BASELINE_SYSTEMS["naive-gather"],
            scenario=scenario,
            concurrency=None,
            tasks=tasks,
            samples_per_task=samples,
            settings=settings,
            ideal_s=_ideal(scenario, settings, n, None),
        )
        report.runs.append(run)
        echo(_summary(run))
    report.summary = summarize(report.runs)
    if scenario.repeat > 1:
        echo(f"medians over {scenario.repeat} rounds:")
        for row in report.summary:
            echo(_median_line(row))
    return report


def _median_line(row: SystemSummary) -> str:
    floor = f" ({row.cpu_vs_floor:.2f}x cpu-floor)" if row.cpu_vs_floor is not None else ""
    overhead = f"{row.overhead:.3f}x ideal" if row.overhead else "no ideal"
    return (
        f"  {row.system:<23} C={row.concurrency or 'inf':<5} "
        f"CPU {row.cpu_ms_per_rollout:.1f} ms/rollout{floor}, {overhead}, "
        f"lag p99 {row.loop_lag_p99_ms or 0:.0f} ms, peak RSS {row.peak_rss_mb:.0f} MiB, "
        f"scored {row.scored}/{row.requested} (fewest), leaked {row.leaked}"
    )


#: Rollouts of the unmeasured warm-up batch (see :func:`_warm_up`).
WARM_UP_ROLLOUTS = 8


async def _warm_up(
    scenario: Scenario,
    tasks: Sequence[TaskSpec],
    config_file: str | None,
    echo: Callable[[str], None],
) -> None:
    """One small batch through fleetroll, not measured, before the measured runs.

    A process's first batch pays for what it does once (lazy imports, TLS
    contexts, compiled validators and models): charged to whichever system
    ran first, it made the order of the runs part of their CPU per rollout.
    """
    count = min(WARM_UP_ROLLOUTS, len(tasks))
    warm = replace(scenario, think_s=0.0, telemetry=True)
    settings = fleetroll_settings(warm, count, config_file)
    run = await measure_run(
        "warm-up",
        run_fleetroll,
        scenario=warm,
        concurrency=count,
        tasks=tasks[:count],
        samples_per_task=1,
        settings=settings,
        ideal_s=None,
    )
    echo(f"  warm-up: {run.returned}/{run.requested} rollouts through fleetroll, not measured")


def with_overrides(
    scenario: Scenario,
    settings: Settings,
    *,
    rollouts: int | None,
    concurrency: Sequence[int] | None,
    profile: str | None,
    discovery_wait_s: float | None,
    wall_limit_s: float | None,
    telemetry: bool | None = None,
    telemetry_off_too: bool = False,
    tool_calls_off_too: bool = False,
    repeat: int = 1,
) -> Scenario:
    """``scenario`` with the command line's overrides applied.

    Raises:
        ConfigError: ``profile`` names no profile of the settings.
    """
    scenario = scenario.with_profile(settings, profile)
    return replace(
        scenario,
        rollouts=scenario.rollouts if rollouts is None else rollouts,
        concurrency=tuple(concurrency) if concurrency else scenario.concurrency,
        discovery_wait_s=(
            scenario.discovery_wait_s if discovery_wait_s is None else discovery_wait_s
        ),
        wall_limit_s=scenario.wall_limit_s if wall_limit_s is None else wall_limit_s,
        telemetry=scenario.telemetry if telemetry is None else telemetry,
        telemetry_off_too=telemetry_off_too,
        tool_calls_off_too=tool_calls_off_too,
        repeat=repeat,
    )

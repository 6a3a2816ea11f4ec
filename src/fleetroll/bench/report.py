"""Reports: the JSON record, a markdown summary and (with matplotlib) a PNG plot."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from fleetroll.bench.records import (
    BUSY_CORES,
    PHASES,
    PolicyTurnRecord,
    RunRecord,
    ScenarioReport,
    SystemSummary,
    ToolCallRecord,
    WeightUpdateRecord,
)

__all__ = [
    "MIN_ROUNDS",
    "PLOT_HINT",
    "PlotData",
    "Point",
    "markdown",
    "plot",
    "plot_data",
    "write_report",
]

PLOT_HINT = "PNG plots need matplotlib: pip install 'fleetroll[bench]' (or pip install matplotlib)"


def _num(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def _concurrency(run: RunRecord) -> str:
    return "∞" if run.concurrency is None else str(run.concurrency)


def _leaks(run: RunRecord) -> str:
    if run.leaked_after_cleanup is None:
        return str(run.leaked)
    return f"{run.leaked} ({run.leaked_after_cleanup} after cancelling)"


def _emulator_ms(run: RunRecord) -> float | None:
    if run.emulator_cpu_s is None or not run.requested:
        return None
    return run.emulator_cpu_s / run.requested * 1000


def _runs_table(runs: list[RunRecord]) -> list[str]:
    lines = [
        "| system | C | returned / requested | scored | makespan s | ideal s | overhead "
        "| rollouts/s | loop lag p99 / max ms | peak RSS MiB | CPU ms / rollout "
        "| emulator CPU ms / rollout "
        "| fleetroll-process CPU (cores) | emulator CPU (cores) | others' CPU (cores) "
        "| leaked | past deadline + 5 s | finished on its own | provisional | round |",
        "|" + "---|" * 20,
    ]
    for r in runs:
        rss = _num(r.peak_rss_mb, 0) + ("" if r.peak_rss_of_run else " (process)")
        lines.append(
            f"| {r.system} | {_concurrency(r)} | {r.returned} / {r.requested} | {r.scored} "
            f"| {_num(r.makespan_s)} | {_num(r.ideal_s)} | {_num(r.overhead, 3)} "
            f"| {_num(r.rollouts_per_s)} "
            f"| {_num(r.loop_lag_p99_ms, 1)} / {_num(r.loop_lag_max_ms, 1)} | {rss} "
            f"| {_num(r.cpu_ms_per_rollout, 1)} | {_num(_emulator_ms(r), 1)} "
            f"| {_num(r.cpu_utilisation)} "
            f"| {_num(r.emulator_cpu_utilisation)} | {_num(r.other_cpu_utilisation)} "
            f"| {_leaks(r)} | {r.past_deadline} | {'yes' if r.finished_on_its_own else 'NO'} "
            f"| {'yes' if r.provisional else 'no'} | {r.round} |"
        )
    return lines


def _summary_table(rows: list[SystemSummary]) -> list[str]:
    lines = [
        "| system | C | rounds | scored (fewest) | CPU ms / rollout | CPU / cpu-floor "
        "| makespan / ideal | loop lag p99 ms | peak RSS MiB (largest) | leaked (all rounds) |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        ratio = "–" if r.cpu_vs_floor is None else f"{r.cpu_vs_floor:.2f}x"
        concurrency = "∞" if r.concurrency is None else str(r.concurrency)
        lines.append(
            f"| {r.system} | {concurrency} | {r.rounds} | {r.scored} / {r.requested} "
            f"| {_num(r.cpu_ms_per_rollout, 1)} | {ratio} | {_num(r.overhead, 3)} "
            f"| {_num(r.loop_lag_p99_ms, 1)} | {_num(r.peak_rss_mb, 0)} | {r.leaked} |"
        )
    return lines


def _phases_table(runs: list[RunRecord]) -> list[str]:
    names = [p.removesuffix("_s") for p in PHASES]
    lines = [
        "| system | C | " + " | ".join(names) + " |",
        "|" + "---|" * (len(names) + 2),
    ]
    for r in runs:
        cells = []
        for phase in PHASES:
            p = r.phases[phase]
            cells.append(f"{_num(p.p50)} / {_num(p.p95)} / {_num(p.p99)}")
        lines.append(f"| {r.system} | {_concurrency(r)} | " + " | ".join(cells) + " |")
    return lines


def _tool_call_table(record: ToolCallRecord) -> list[str]:
    lines = [
        "| client | calls | wall mean ms | wall p50 ms | wall p95 ms | CPU mean ms |",
        "|---|---|---|---|---|---|",
    ]
    for c in record.clients:
        lines.append(
            f"| {c.client} | {c.calls} | {_num(c.wall_mean_ms, 3)} | {_num(c.wall_p50_ms, 3)} "
            f"| {_num(c.wall_p95_ms, 3)} | {_num(c.cpu_mean_ms, 3)} |"
        )
    lines += [
        "",
        f"fleetroll / bare: **{record.ratio_mean:.3f}x** (mean), "
        f"**{record.ratio_p50:.3f}x** (median); target <= 1.2x. "
        f"Others' CPU during the run: {_num(record.other_cpu_utilisation)} cores"
        f"{' (provisional: the machine was busy)' if record.provisional else ''}.",
    ]
    return lines


def _policy_turn_table(record: PolicyTurnRecord) -> list[str]:
    lines = [
        f"{record.turns}-turn computer_use rollout, a {record.screenshot_kb} KB screenshot "
        f"per turn; CPU on the loop's thread, median of {record.repeat} fresh rollouts.",
        "",
        "| turn | request (all images) | build, encoded once | build, whole | act |"
        " act, max_images=3 (request) |",
        "|---|---|---|---|---|---|",
    ]
    shown = {1, 2, 5, 10, 15, 20, 25, record.turns}
    for r in record.rows:
        if r.turn in shown:
            lines.append(
                f"| {r.turn} | {r.request_mb:.2f} MB | {r.encoded_ms:.2f} ms | {r.whole_ms:.2f} ms"
                f" | {r.act_ms:.2f} ms | {r.capped_act_ms:.2f} ms ({r.capped_request_mb:.2f} MB) |"
            )
    return lines


def _weight_update_table(record: WeightUpdateRecord) -> list[str]:
    lines = [
        f"{record.rollouts} rollouts per mode at C={record.concurrency}, max_tokens"
        f" {record.max_tokens}, new weights every {record.update_every_s:g} s.",
        "",
        "| policy.weight_update | wall | tokens/s | server idle | updates (s each) | aborted"
        " (tokens kept) | turns spanning 2 versions | stale |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in record.rows:
        lines.append(
            f"| {r.mode} | {r.wall_s:.1f} s | {r.tokens_per_s:.0f} | {r.idle_share:.0%} |"
            f" {r.updates} ({r.update_s:.2f}) | {r.aborted} ({r.kept_tokens}) |"
            f" {r.straddling_turns} | {r.stale} |"
        )
    return lines


def markdown(report: ScenarioReport) -> str:
    """A markdown summary of one scenario's report."""
    m = report.machine
    lines = [
        f"## {report.scenario}: {report.description}",
        "",
        f"`{report.command}`",
        "",
        f"{report.started_at}; {m.nproc} cores ({m.cpu_model}), Python {m.python}.",
        "",
    ]
    if any(row.rounds > 1 for row in report.summary):
        lines += [
            f"Medians over {report.parameters.get('repeat')} rounds, each started by the next"
            " system; CPU / cpu-floor pairs each round's runs, then takes the median.",
            "",
            *_summary_table(report.summary),
            "",
        ]
    if report.runs:
        lines += ["Phase latencies below are p50 / p95 / p99 in seconds.", ""]
        lines += [*_runs_table(report.runs), "", *_phases_table(report.runs), ""]
        lines += ["| system | C | outcomes | notes |", "|---|---|---|---|"]
        for r in report.runs:
            outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(r.failures.items()))
            lines.append(
                f"| {r.system} | {_concurrency(r)} | {outcomes} | {'; '.join(r.notes) or ''} |"
            )
        lines.append("")
    if report.tool_calls is not None:
        lines += [*_tool_call_table(report.tool_calls), ""]
    if report.policy_turns is not None:
        lines += [*_policy_turn_table(report.policy_turns), ""]
    if report.weight_updates is not None:
        lines += [*_weight_update_table(report.weight_updates), ""]
    return "\n".join(lines)


#: The fewest rounds (``--repeat``) of each system at each concurrency for a plot
#: that is not provisional: fewer leave too little to say how much a number varies.
MIN_ROUNDS = 3


@dataclass(frozen=True, slots=True)
class Point:
    """One system at one concurrency: the median of its rounds and their range."""

    x: int
    median: float
    low: float
    high: float
    rounds: int


@dataclass(frozen=True, slots=True)
class PlotData:
    """What :func:`plot` draws, by system: throughput and overhead against concurrency.

    Each point is the median of the system's rounds at that concurrency, its
    error bar their range (min to max). Both axes start at 0 (``ylim``). The
    plot is provisional (``provisional`` says why, else None) when a run was
    (the machine busy with others: above :data:`~fleetroll.bench.records.BUSY_CORES`
    cores of their CPU during it) or a point has fewer than :data:`MIN_ROUNDS` rounds.
    """

    throughput: dict[str, list[Point]]
    overhead: dict[str, list[Point]]
    throughput_ylim: tuple[float, float]
    overhead_ylim: tuple[float, float]
    provisional: str | None


def _point(x: int, values: list[float]) -> Point:
    return Point(x, statistics.median(values), min(values), max(values), len(values))


def _ylim(series: dict[str, list[Point]], least_top: float) -> tuple[float, float]:
    """From 0 to a little over the highest error bar (``least_top`` at least)."""
    top = max((p.high for points in series.values() for p in points), default=0.0)
    return 0.0, max(top * 1.1, least_top)


def plot_data(report: ScenarioReport) -> PlotData:
    """The points, axes and provisional mark of ``report``'s plot (see :class:`PlotData`)."""
    groups: dict[str, dict[int, list[RunRecord]]] = {}
    for r in report.runs:
        x = r.concurrency or r.requested
        groups.setdefault(r.system, {}).setdefault(x, []).append(r)
    throughput: dict[str, list[Point]] = {}
    overhead: dict[str, list[Point]] = {}
    for system, by_x in groups.items():
        throughput[system] = [
            _point(x, [r.rollouts_per_s for r in runs]) for x, runs in sorted(by_x.items())
        ]
        overheads = [
            _point(x, known)
            for x, runs in sorted(by_x.items())
            if (known := [r.overhead for r in runs if r.overhead])
        ]
        if overheads:
            overhead[system] = overheads
    reasons = []
    busy = sum(r.provisional for r in report.runs)
    if busy:
        reasons.append(
            f"{busy} of {len(report.runs)} runs on a busy machine"
            f" (others' CPU over {BUSY_CORES} cores)"
        )
    fewest = min((p.rounds for points in throughput.values() for p in points), default=0)
    if fewest < MIN_ROUNDS:
        reasons.append(f"{fewest} round(s) at a point, fewer than {MIN_ROUNDS} (--repeat)")
    return PlotData(
        throughput=throughput,
        overhead=overhead,
        throughput_ylim=_ylim(throughput, least_top=1.0),
        overhead_ylim=_ylim(overhead, least_top=1.2),
        provisional="; ".join(reasons) or None,
    )


def plot(report: ScenarioReport, path: Path) -> bool:
    """Throughput and overhead against concurrency, one line per system (:func:`plot_data`).

    A provisional plot says so, and why, under its title and in the PNG's
    ``Description``. Returns False (and draws nothing) when matplotlib is not
    installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    data = plot_data(report)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.4), constrained_layout=True)
    for ax, series in ((left, data.throughput), (right, data.overhead)):
        for system, points in series.items():
            ax.errorbar(
                [p.x for p in points],
                [p.median for p in points],
                yerr=[
                    [p.median - p.low for p in points],
                    [p.high - p.median for p in points],
                ],
                marker="o",
                capsize=4,
                label=system,
            )
    left.set(xlabel="concurrency", ylabel="scored rollouts / s", title="throughput")
    right.set(xlabel="concurrency", ylabel="makespan / ideal", title="overhead")
    left.set_ylim(*data.throughput_ylim)
    right.set_ylim(*data.overhead_ylim)
    right.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    title = f"fleetroll bench: {report.scenario} (median of rounds, bars: min to max)"
    description = title
    if data.provisional is not None:
        mark = f"PROVISIONAL: {data.provisional}"
        title += "\n" + mark
        description += ". " + mark
        fig.suptitle(title, color="firebrick")
    else:
        fig.suptitle(title)
    fig.savefig(path, dpi=90, metadata={"Description": description})
    plt.close(fig)
    return True


def write_report(report: ScenarioReport, out: Path, *, with_plot: bool = True) -> list[Path]:
    """Write ``<scenario>.json``, ``<scenario>.md`` and (maybe) ``<scenario>.png`` to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    json_path = out / f"{report.scenario}.json"
    json_path.write_text(report.model_dump_json(indent=2) + "\n", encoding="utf-8")
    written.append(json_path)
    md_path = out / f"{report.scenario}.md"
    md_path.write_text(markdown(report) + "\n", encoding="utf-8")
    written.append(md_path)
    if with_plot and report.runs:
        png_path = out / f"{report.scenario}.png"
        if plot(report, png_path):
            written.append(png_path)
    return written

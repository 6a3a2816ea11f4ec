"""Reports: the JSON record, a markdown summary and (with matplotlib) a PNG plot."""

from __future__ import annotations

from pathlib import Path

from fleetroll.bench.records import (
    PHASES,
    PolicyTurnRecord,
    RunRecord,
    ScenarioReport,
    SystemSummary,
    ToolCallRecord,
    WeightUpdateRecord,
)

__all__ = ["PLOT_HINT", "markdown", "plot", "write_report"]

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


def plot(report: ScenarioReport, path: Path) -> bool:
    """Throughput and overhead against concurrency, one line per system.

    Returns False (and draws nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = report.runs
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for system in dict.fromkeys(r.system for r in runs):
        mine = sorted(
            (r for r in runs if r.system == system), key=lambda r: r.concurrency or r.requested
        )
        xs = [r.concurrency or r.requested for r in mine]
        left.plot(xs, [r.rollouts_per_s for r in mine], marker="o", label=system)
        overheads = [(x, r.overhead) for x, r in zip(xs, mine, strict=True) if r.overhead]
        if overheads:
            right.plot(*zip(*overheads, strict=True), marker="o", label=system)
    left.set(xlabel="concurrency", ylabel="scored rollouts / s", title="throughput")
    right.set(xlabel="concurrency", ylabel="makespan / ideal", title="overhead")
    right.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(f"fleetroll bench: {report.scenario}")
    fig.savefig(path, dpi=90)
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

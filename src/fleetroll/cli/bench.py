"""``fleetroll bench``: run benchmark scenarios and write their reports."""

from __future__ import annotations

from pathlib import Path

import anyio
import click

from fleetroll.bench.scenarios import BASELINES, SCENARIOS
from fleetroll.cli.options import CONFIG_OPTION, Failed
from fleetroll.errors import FleetrollError
from fleetroll.settings import load_settings

__all__ = ["bench"]


#: Where reports go without --out (relative to the working directory).
_DEFAULT_OUT = Path(".fleetroll") / "bench"


def _concurrency(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int]:
    if not value:
        return []
    try:
        levels = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter("a comma-separated list of integers, e.g. 100,500,1000") from None
    if not levels or min(levels) < 1:
        raise click.BadParameter("concurrency levels must be at least 1")
    return levels


def _baselines(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str] | None:
    if value is None:
        return None
    if value.strip() == "none":
        return []
    names = [part.strip() for part in value.split(",") if part.strip()]
    unknown = sorted(set(names) - set(BASELINES))
    if unknown:
        raise click.BadParameter(
            f"unknown baseline(s) {', '.join(unknown)}; known: {', '.join(BASELINES)} or none"
        )
    return names


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@click.command()
@click.option(
    "--scenario",
    "scenario_names",
    multiple=True,
    type=click.Choice(sorted(SCENARIOS)),
    help="Scenario to run (repeatable; default: smoke). See --list.",
)
@click.option("--list", "list_only", is_flag=True, help="List the scenarios and exit.")
@click.option(
    "--rollouts", type=click.IntRange(min=1), default=None, help="Rollouts (calls for tool-call)."
)
@click.option(
    "--concurrency",
    callback=_concurrency,
    default=None,
    help="Comma-separated concurrency levels, e.g. 100,500,1000.",
)
@click.option("--profile", default=None, help="Emulator fault profile instead of the scenario's.")
@click.option(
    "--baselines",
    callback=_baselines,
    default=None,
    help="fresh-session,naive-gather,cpu-floor (default: the scenario's) or none.",
)
@click.option(
    "--discovery-wait",
    type=click.FloatRange(min=0),
    default=None,
    help="fresh-session's fixed wait before tool discovery, seconds (reference: 8).",
)
@click.option(
    "--wall-limit",
    type=click.FloatRange(min=1),
    default=None,
    help="Stop any run after this many seconds (default: the scenario's).",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder for <scenario>.json, .md and .png [default: .fleetroll/bench].",
)
@click.option(
    "--telemetry",
    type=click.Choice(["on", "off", "both", "tool-calls"]),
    default="on",
    show_default=True,
    help=(
        "fleetroll with the telemetry `fleetroll run` sets up (store, console), or none;"
        " both: each run twice, the second as fleetroll-telemetry-off; tool-calls: each"
        " run twice, the second as fleetroll-tool-calls-off (telemetry on, no"
        " fleet_tool_call records): what the per-call records cost."
    ),
)
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help=(
        "Rounds of every system at each concurrency, each round started by the next system;"
        " the report adds each system's medians (CPU ratio to cpu-floor paired per round)."
    ),
)
@click.option("--no-plot", is_flag=True, help="Skip the PNG plot.")
@CONFIG_OPTION
def bench(
    scenario_names: tuple[str, ...],
    list_only: bool,
    rollouts: int | None,
    concurrency: list[int],
    profile: str | None,
    baselines: list[str] | None,
    discovery_wait: float | None,
    wall_limit: float | None,
    out: Path | None,
    telemetry: str,
    repeat: int,
    no_plot: bool,
    config_file: Path | None,
) -> None:
    """Benchmark fleetroll against the baselines on the embedded emulator.

    Every run gets a fresh emulator in its own process (its CPU is reported
    apart from fleetroll's) and stops on its own: runs are bounded by the
    scenario's wall limit. Loopback only.
    """
    if list_only:
        click.echo(_scenario_table())
        return
    # Imported here: `fleetroll --help` and `--list` should not pay for the SDK and MCP imports.
    from fleetroll._internal.gc_policy import gc_policy
    from fleetroll.bench.report import PLOT_HINT, write_report
    from fleetroll.bench.runner import quiet_libraries, run_scenario, with_overrides

    config = str(config_file) if config_file is not None else None
    try:
        settings = load_settings(config)
        scenarios = [
            with_overrides(
                SCENARIOS[name],
                settings,
                rollouts=rollouts,
                concurrency=concurrency,
                profile=profile,
                discovery_wait_s=discovery_wait,
                wall_limit_s=wall_limit,
                telemetry=telemetry != "off",
                telemetry_off_too=telemetry == "both",
                tool_calls_off_too=telemetry == "tool-calls",
                repeat=repeat,
            )
            for name in scenario_names or ("smoke",)
        ]
    except FleetrollError as exc:
        raise Failed(str(exc)) from None
    plots = not no_plot
    if plots and not _has_matplotlib():
        click.echo(PLOT_HINT + "; writing JSON and markdown only.", err=True)
        plots = False

    def echo(line: str) -> None:
        click.echo(line, err=True)

    # Not the working tree's top level: .fleetroll/ is where fleetroll keeps
    # what it writes (telemetry store too), and projects ignore it.
    out = out if out is not None else _DEFAULT_OUT
    echo(f"fleetroll bench: reports go to {out.absolute()}")

    async def main() -> None:
        for scenario in scenarios:
            chosen = scenario.baselines if baselines is None else baselines
            report = await run_scenario(scenario, baselines=chosen, config_file=config, echo=echo)
            for path in write_report(report, out, with_plot=plots):
                click.echo(str(path))

    try:
        with quiet_libraries(), gc_policy(settings.pool.gc_policy):
            anyio.run(main)
    except FleetrollError as exc:
        raise Failed(str(exc)) from None


def _scenario_table() -> str:
    """One line per scenario, its columns as wide as their widest entry."""
    rows = [
        (s.name, str(s.rollouts), ",".join(str(c) for c in s.concurrency), s.description)
        for s in SCENARIOS.values()
    ]
    name, rollouts, levels = (max(len(row[i]) for row in rows) for i in range(3))
    return "\n".join(f"{n:<{name}}  {r:>{rollouts}} x C={c:<{levels}}  {d}" for n, r, c, d in rows)

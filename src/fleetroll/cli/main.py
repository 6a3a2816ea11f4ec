"""The ``fleetroll`` command line.

Subcommands build the settings once (``--config`` plus environment) and pass
them down. Bad input or configuration ends with a one-line message and exit
code 2; never a traceback.
"""

from __future__ import annotations

import importlib
import os
import signal
from pathlib import Path
from typing import Any, ClassVar

import anyio
import click

from fleetroll._internal.pydantic_plugins import skip_unused_pydantic_plugins
from fleetroll.cli.options import CONFIG_OPTION, Failed, load_command_settings, ray_options
from fleetroll.errors import FleetrollError
from fleetroll.telemetry.console import configure_console_logging

__all__ = ["main"]


class _LazyGroup(click.Group):
    """Subcommands imported when run, not when the command line is built.

    ``fleetroll --help`` and every command then pay only for what they use
    (the service alone pulls in starlette and uvicorn).
    """

    #: name -> ("module:attribute", one-line help for the command list)
    lazy: ClassVar[dict[str, tuple[str, str]]] = {
        "bench": (
            "fleetroll.cli.bench:bench",
            "Benchmark fleetroll against the baselines on the embedded emulator.",
        ),
        "dashboard": (
            "fleetroll.cli.telemetry:dashboard",
            "Serve the live dashboard of the telemetry store until Ctrl-C.",
        ),
        "emulator": (
            "fleetroll.emulator.cli:emulator",
            "Run the Fleet-compatible emulator until interrupted.",
        ),
        "gc": (
            "fleetroll.cli.gc:gc",
            "Release the running instances of a run id (and of its batches and Ray actors).",
        ),
        "query": (
            "fleetroll.cli.telemetry:query",
            "Run SQL on the telemetry records, the same SQL as on Logfire.",
        ),
        "rescore": (
            "fleetroll.cli.rescore:rescore",
            "Compute again the judges and checks of stored results, into a new file.",
        ),
        "serve": (
            "fleetroll.cli.serve:serve",
            "Serve the HTTP API (and MCP tools at /mcp) for remote training controllers.",
        ),
        "stats": (
            "fleetroll.cli.telemetry:stats",
            "Rollouts per environment: outcomes, failure reasons, reward, provisioning time.",
        ),
    }

    def main(self, *args: Any, **kwargs: Any) -> Any:
        skip_unused_pydantic_plugins(os.environ)  # before any model is built
        return super().main(*args, **kwargs)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy:
            module, _, attribute = self.lazy[name][0].partition(":")
            command = getattr(importlib.import_module(module), attribute)
            assert isinstance(command, click.Command)
            return command
        return super().get_command(ctx, name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, self.lazy[name][1]) for name in self.lazy]
        rows += [
            (name, command.get_short_help_str(limit=formatter.width))
            for name, command in self.commands.items()
        ]
        with formatter.section("Commands"):
            formatter.write_dl(sorted(rows))


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fleetroll")
def main() -> None:
    """fleetroll: rollout orchestration for RL training on Fleet environments."""
    # Library log records (the mcp client's tracebacks under faults) only at
    # debug, and every line above a live display; the config may lower it.
    configure_console_logging("info")


@main.command()
@click.argument(
    "tasks_paths", metavar="TASKS...", nargs=-1, required=True, type=click.Path(path_type=Path)
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Journal: results as JSON Lines, appended as rollouts end.",
)
@click.option(
    "--samples",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Rollouts per task (a group, for GRPO-style training).",
)
@click.option(
    "--policy",
    "policy_kind",
    type=click.Choice(["scripted", "openai"]),
    default=None,
    help="Default from config: scripted.",
)
@click.option("--model", default=None, help="Model name for --policy openai.")
@click.option(
    "--base-url",
    "base_urls",
    multiple=True,
    help="OpenAI-compatible endpoint for --policy openai (…/v1); repeat it for many"
    " servers (policy.base_urls): each rollout sticks to one.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=None,
    help="Rollouts acting at once (default from config).",
)
@click.option(
    "--profile", default=None, help="Emulator fault profile, when running on the embedded emulator."
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=None,
    help="Run this many batches one after the other, each of --batch-tasks tasks drawn"
    " from TASKS by the task sampler ([sampling]); with --resume, the steps in all.",
)
@click.option(
    "--batch-tasks",
    type=click.IntRange(min=1),
    default=None,
    help="Tasks per step with --steps (each run --samples times).",
)
@click.option("--resume", is_flag=True, help="Continue the batch (or steps) journaled in --out.")
@click.option(
    "--no-preflight",
    is_flag=True,
    help="Skip the checks before the batch (env versions exist, key accepted, policy answers).",
)
@click.option(
    "--agent-command",
    default=None,
    metavar="CMD",
    help="Run CMD as each rollout's agent instead of fleetroll's loop (needs --policy openai):"
    " it gets OPENAI_BASE_URL/OPENAI_API_KEY (a gateway to the policy servers),"
    " FLEETROLL_MCP_URL, FLEETROLL_TASK_FILE and FLEETROLL_ANSWER_FILE.",
)
@click.option(
    "--groups",
    "groups_target",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Straggler cut-off by whole groups: once N groups (tasks) are complete, stop every"
    " rollout of the others (superseded; those groups come with cut: true). Start more"
    " tasks than N. Bias: groups whose episodes run faster are kept.",
)
@ray_options
@CONFIG_OPTION
def run(
    tasks_paths: tuple[Path, ...],
    out: Path | None,
    samples: int,
    policy_kind: str | None,
    model: str | None,
    base_urls: tuple[str, ...],
    concurrency: int | None,
    profile: str | None,
    steps: int | None,
    batch_tasks: int | None,
    resume: bool,
    no_preflight: bool,
    agent_command: str | None,
    groups_target: int | None,
    ray_address: str | None,
    ray_actors: int | None,
    config_file: Path | None,
) -> None:
    """Run every task in TASKS (files: JSON Lines or a JSON array; or folders) and report.

    Runs on the embedded emulator unless FLEET_API_KEY or FLEET_BASE_URL is
    set. Before anything is provisioned, a pre-flight checks that every
    environment version exists, the key is accepted and the policy endpoint
    answers (--no-preflight skips it). Exit code 0 when the batch ran (failed
    rollouts are data); 1 when it stopped early because its first rollouts all
    failed the same way (pool.stop_after_same_failures); 2 for bad input or
    configuration, a failed pre-flight included; 130 when interrupted.

    With --steps N --batch-tasks M, it runs N batches of M tasks each, drawn
    by the task sampler (settings [sampling]: weights and minimums per
    environment, a seed, the difficulty filter); results carry their `step`,
    and the sampler's state is kept beside --out, so --resume goes on with
    the same sequence of tasks.
    """
    from fleetroll.tasks import load_task_paths

    if (steps is None) != (batch_tasks is None):
        raise Failed("--steps and --batch-tasks go together: give both (or neither)")
    overrides: dict[str, Any] = {}
    if concurrency is not None:
        overrides["pool"] = {"concurrency": concurrency}
    policy_overrides: dict[str, Any] = {
        k: v for k, v in (("kind", policy_kind), ("model", model)) if v is not None
    }
    if base_urls:  # they replace both policy.base_url and policy.base_urls
        if len({url.rstrip("/") for url in base_urls}) < len(base_urls):
            raise Failed("--base-url names the same policy server twice: give each once")
        policy_overrides.update(base_url=base_urls[0], base_urls=list(base_urls))
    settings = load_command_settings(config_file, **overrides)
    if policy_overrides:
        settings = settings.model_copy(
            update={"policy": settings.policy.model_copy(update=policy_overrides)}
        )
    try:
        if agent_command is not None:
            _check_agent_command(agent_command, settings)
        tasks = load_task_paths(tasks_paths, settings.modalities)
        per_batch = batch_tasks if batch_tasks is not None else len(tasks)
        if groups_target is not None and groups_target > per_batch:
            given = "--batch-tasks" if batch_tasks is not None else "tasks (groups) given"
            raise Failed(
                f"--groups {groups_target} is more than the {per_batch} {given}:"
                " start more tasks than the groups you need"
            )
        from fleetroll.scoring.judge import missing_judge

        problem = missing_judge(tasks, settings)
        if problem is not None:
            raise Failed(problem)
        # A user's mistakes are said before the slow imports and before anything starts.
        if settings.uses_emulator:
            settings.emulator.fault_profile(profile)  # an unknown name
        else:
            settings.require_fleet_api_key()
        sampling = None
        if batch_tasks is not None:
            from fleetroll.training.sampler import SamplerConfig, TaskSampler

            sampling = SamplerConfig.from_settings(settings.sampling, batch_tasks)
            TaskSampler(tasks, sampling)  # a config these tasks cannot meet, said now
        if out is not None:
            from fleetroll.pool.journal import BatchIdentity, check_journal

            oversample = settings.pool.oversample
            identity = BatchIdentity.of("", tasks, samples, oversample, batch_tasks)
            check_journal(out, identity, resume=resume)
    except FleetrollError as exc:
        raise Failed(str(exc)) from None
    # Imported once the input is known good: a bad task file costs no more.
    from rich.console import Console

    from fleetroll.cli.run import Steps, print_report, run_job
    from fleetroll.policies import policy_from_settings

    plan = Steps(steps, sampling) if steps is not None and sampling is not None else None

    console = Console(stderr=True, soft_wrap=True)

    async def job() -> Any:
        from fleetroll.telemetry import open_telemetry

        # Signals are ours until telemetry is flushed: a Ctrl-C during the
        # shutdown is then one more notice, never a KeyboardInterrupt half-way.
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with open_telemetry(settings) as events:
                policy: Any
                if agent_command is not None:
                    from fleetroll.rollout.agent_command import CommandAgent

                    # Its gateway serves while the batch runs; closing it closes its policy.
                    policy = CommandAgent.from_settings(agent_command, settings)
                    await policy.__aenter__()
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
                        preflight=not no_preflight,
                        groups_target=groups_target,
                        steps=plan,
                    )
                finally:
                    if agent_command is not None:
                        await policy.__aexit__(None, None, None)
                    else:
                        await policy.aclose()

    try:
        report = anyio.run(job)
        print_report(report, console, settings)
    except FleetrollError as exc:
        raise Failed(str(exc)) from None
    except KeyboardInterrupt:
        # A Ctrl-C outside the job (before its signal handlers, or while the
        # report prints): everything was already released and journaled.
        raise SystemExit(130) from None
    if report.interrupted:
        raise SystemExit(130)
    if report.stopped is not None:
        raise SystemExit(1)


def _check_agent_command(command: str, settings: Any) -> None:
    """What --agent-command needs, said before anything starts."""
    import shlex

    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise Failed(f"--agent-command {command!r} cannot be split into words: {exc}") from None
    if not argv:
        raise Failed("--agent-command is empty: give the command that runs your agent")
    if settings.policy.kind != "openai":
        raise Failed(
            "--agent-command needs --policy openai (its gateway forwards the agent's calls"
            " to the policy servers): add --policy openai --base-url URL --model NAME"
        )

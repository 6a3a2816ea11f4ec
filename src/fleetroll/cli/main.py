"""The ``fleetroll`` command line.

Subcommands build the settings once (``--config`` plus environment) and pass
them down. Bad input or configuration ends with a one-line message and exit
code 2; never a traceback.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, ClassVar

import click

from fleetroll._internal.pydantic_plugins import skip_unused_pydantic_plugins
from fleetroll.cli.jobs import job_options, job_settings, job_tasks, reported
from fleetroll.cli.options import CONFIG_OPTION, Failed, ray_options, resume_command
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
            "fleetroll.cli.emulator:emulator",
            "Run the Fleet-compatible emulator until interrupted.",
        ),
        "eval": (
            "fleetroll.cli.eval:eval_command",
            "Evaluate a policy (pass@1 … pass@K per task and overall), or compare two.",
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
@job_options
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
@click.option(
    "--branch-at",
    type=click.IntRange(min=1),
    default=None,
    metavar="K",
    help="Branching rollouts: per task, one rollout to step K, then --width branches that"
    " replay its first K steps (answers checked: replay_diverged if they differ) and go on.",
)
@click.option(
    "--width",
    type=click.IntRange(min=1),
    default=None,
    metavar="W",
    help="Branches per branch point with --branch-at [default: 4].",
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
    branch_at: int | None,
    width: int | None,
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
    if (steps is None) != (batch_tasks is None):
        raise Failed("--steps and --batch-tasks go together: give both (or neither)")
    if width is not None and branch_at is None:
        raise Failed("--width is the branches of --branch-at K: give --branch-at too")
    if branch_at is not None:
        _check_tree_options(
            samples=samples, steps=steps, resume=resume, agent=agent_command, groups=groups_target
        )
    settings = job_settings(
        config_file,
        policy_kind=policy_kind,
        model=model,
        base_urls=base_urls,
        concurrency=concurrency,
    )
    with reported():
        if agent_command is not None:
            _check_agent_command(agent_command, settings)
        tasks = job_tasks(
            settings,
            tasks_paths,
            profile=profile,
            out=out,
            samples=samples,
            resume=resume,
            batch_tasks=batch_tasks,
        )
        per_batch = batch_tasks if batch_tasks is not None else len(tasks)
        if groups_target is not None and groups_target > per_batch:
            given = "--batch-tasks" if batch_tasks is not None else "tasks (groups) given"
            raise Failed(
                f"--groups {groups_target} is more than the {per_batch} {given}:"
                " start more tasks than the groups you need"
            )
        if branch_at is not None:
            _run_trees(
                settings,
                tasks,
                branch_at=branch_at,
                width=width or 4,
                out=out,
                profile=profile,
                preflight=not no_preflight,
                ray_address=ray_address,
                ray_actors=ray_actors,
            )
            return
        sampling = None
        if batch_tasks is not None:
            from fleetroll.training.sampler import SamplerConfig, TaskSampler

            sampling = SamplerConfig.from_settings(settings.sampling, batch_tasks)
            TaskSampler(tasks, sampling)  # a config these tasks cannot meet, said now
    # Imported once the input is known good: a bad task file costs no more.
    from fleetroll._internal.gc_policy import gc_policy
    from fleetroll.cli.run import exit_as_ended, job_console, print_report, run_command
    from fleetroll.jobs.steps import Steps

    plan = Steps(steps, sampling) if steps is not None and sampling is not None else None
    console = job_console(settings)
    # This process is ours: the collector's policy too (pool.gc_policy).
    with reported(), gc_policy(settings.pool.gc_policy):
        report = run_command(
            settings,
            tasks,
            samples=samples,
            out=out,
            resume=resume,
            profile=profile,
            preflight=not no_preflight,
            console=console,
            agent_command=agent_command,
            ray_address=ray_address,
            ray_actors=ray_actors,
            groups_target=groups_target,
            steps=plan,
            command=resume_command(click.get_current_context()),
        )
        print_report(report, console, settings)
    exit_as_ended(report)


def _check_tree_options(
    *, samples: int, steps: int | None, resume: bool, agent: str | None, groups: int | None
) -> None:
    """What --branch-at does not go with, said before anything starts."""
    clashes = {
        "--samples": samples != 1,
        "--steps": steps is not None,
        "--resume": resume,
        "--agent-command": agent is not None,
        "--groups": groups is not None,
    }
    if given := [name for name, clash in clashes.items() if clash]:
        raise Failed(
            f"--branch-at runs one tree per task and does not take {', '.join(given)}"
            " (--width sets the branches per tree)"
        )


def _run_trees(
    settings: Any,
    tasks: Any,
    *,
    branch_at: int,
    width: int,
    out: Path | None,
    profile: str | None,
    preflight: bool,
    ray_address: str | None,
    ray_actors: int | None,
) -> None:
    """``run --branch-at``: one tree per task, then the closing tables."""
    import functools

    import anyio
    from rich.console import Console

    from fleetroll.cli.run import cost_table, summary_table
    from fleetroll.jobs.tree import run_tree_job, tree_results

    job = functools.partial(
        run_tree_job,
        settings,
        tasks,
        branch_at=branch_at,
        width=width,
        out=out,
        profile=profile,
        preflight=preflight,
        ray_address=ray_address,
        ray_actors=ray_actors,
    )
    console = Console(stderr=True, soft_wrap=True)
    with reported():
        trees = anyio.run(job)
    results = tree_results(trees)
    console.print(summary_table(results))
    console.print(cost_table(results))
    branched = sum(1 for tree in trees if tree.branches)
    console.print(
        f"fleetroll: {len(trees)} trees ({branched} reached step {branch_at} and branched),"
        f" {len(results)} results"
    )
    where = f"{out} (each root, then its branches)" if out else "not kept (pass --out FILE)"
    console.print(f"fleetroll: results: {where}")


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

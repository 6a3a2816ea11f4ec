"""``fleetroll eval``: pass@k of a policy on a task set, or two results files compared.

``fleetroll eval TASKS --k K`` runs K samples of every task (no oversampling:
a sample the platform fails is counted apart, never replaced) as ``fleetroll
run`` runs a batch (the embedded emulator unless Fleet is configured, the
pre-flight, progress, ``--out`` as a journal) and prints the evaluation
(:mod:`fleetroll.evaluation`) on stdout: Markdown tables, or JSON with
``--json``. ``fleetroll eval --compare A.jsonl B.jsonl`` compares two results
files (two policy versions) at pass@k and says which differences are beyond
noise. Progress and closing lines go to stderr.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import click

from fleetroll.cli.jobs import job_options, job_settings, job_tasks, reported
from fleetroll.cli.options import CONFIG_OPTION, Failed

__all__ = ["eval_command"]


@click.command("eval")
@click.argument("tasks_paths", metavar="[TASKS]...", nargs=-1, type=click.Path(path_type=Path))
@click.option(
    "--k",
    "k",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Samples per task, and the largest j of pass@j (with --compare: the pass@k compared).",
)
@click.option(
    "--compare",
    nargs=2,
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    metavar="A.jsonl B.jsonl",
    help="Compare two results files (e.g. two policy versions) instead of running TASKS.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of Markdown tables.")
@click.option(
    "--success-threshold",
    type=float,
    default=1.0,
    show_default=True,
    help="A sample is a success when its reward is at least this.",
)
@click.option(
    "--alpha",
    type=click.FloatRange(min=0, max=1, min_open=True, max_open=True),
    default=0.05,
    show_default=True,
    help="With --compare: a difference is beyond noise when its p-value is below this.",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Journal: the raw results as JSON Lines (as fleetroll run --out).",
)
@click.option(
    "--policy-version",
    type=click.IntRange(min=0),
    default=None,
    help="The version of the policy evaluated: recorded on every result and on the report.",
)
@job_options
@click.option(
    "--no-preflight",
    is_flag=True,
    help="Skip the checks before the batch (env versions exist, key accepted, policy answers).",
)
@CONFIG_OPTION
def eval_command(
    tasks_paths: tuple[Path, ...],
    k: int,
    compare: tuple[Path, Path] | None,
    as_json: bool,
    success_threshold: float,
    alpha: float,
    out: Path | None,
    policy_version: int | None,
    policy_kind: str | None,
    model: str | None,
    base_urls: tuple[str, ...],
    concurrency: int | None,
    profile: str | None,
    no_preflight: bool,
    config_file: Path | None,
) -> None:
    """Evaluate a policy (pass@1 … pass@K per task and overall), or compare two.

    Runs K samples of every task in TASKS (no oversampling) and prints, per
    task, its successes of its scored samples, pass@1 … pass@K (the unbiased
    estimator) and its mean reward; per environment and overall, the mean over
    tasks with 95% intervals. A sample without a reward (an
    infrastructure failure) is counted apart, never as a failure of the policy.
    With --compare A.jsonl B.jsonl, compares two results files instead.

    Exit code 0 when the evaluation ran; 1 when its batch stopped early
    (pool.stop_after_same_failures); 2 for bad input or configuration; 130
    when interrupted (the report of what ran is printed first).
    """
    if compare is not None:
        if tasks_paths or out is not None or policy_version is not None:
            raise Failed(
                "--compare reads two results files: give no TASKS, --out or --policy-version"
            )
        _compare(compare, k=k, alpha=alpha, success_threshold=success_threshold, as_json=as_json)
        return
    if not tasks_paths:
        raise Failed("give TASKS to evaluate (task files or folders), or --compare A.jsonl B.jsonl")
    settings = job_settings(
        config_file,
        policy_kind=policy_kind,
        model=model,
        base_urls=base_urls,
        concurrency=concurrency,
        pool={"oversample": 0},  # K samples, none extra: a lost sample is not replaced
    )
    with reported():
        tasks = job_tasks(settings, tasks_paths, profile=profile, out=out, samples=k, resume=False)
    from fleetroll.cli.run import exit_as_ended, job_console, print_report, run_command
    from fleetroll.evaluation import evaluate, report_markdown

    console = job_console(settings)
    with reported():
        job = run_command(
            settings,
            tasks,
            samples=k,
            out=out,
            resume=False,
            profile=profile,
            preflight=not no_preflight,
            console=console,
            policy_version=policy_version,
        )
        report = evaluate(
            job.results, k=k, success_threshold=success_threshold, policy_version=policy_version
        )
        click.echo(json.dumps(report.to_json(), indent=2) if as_json else report_markdown(report))
        print_report(job, console, settings, tables=False)
    exit_as_ended(job)


def _compare(
    paths: tuple[Path, Path], *, k: int, alpha: float, success_threshold: float, as_json: bool
) -> None:
    from fleetroll.evaluation import compare, comparison_markdown, evaluate
    from fleetroll.pool.journal import read_journal

    reports = []
    for path in paths:
        if not path.exists():
            raise Failed(f"{path}: no such results file")
        try:
            results = read_journal(path, strict=True)
        except ValueError as exc:  # its first line names the file and line
            raise Failed(
                f"{str(exc).splitlines()[0]} (a results file holds one rollout result a line,"
                " as --out writes them)"
            ) from None
        if not results:
            raise Failed(f"{path}: no results in it")
        most = max(Counter(r.task_key for r in results).values())
        if k > most:
            raise Failed(f"--k {k}: no task in {path} has more than {most} samples")
        reports.append(evaluate(results, k=most, success_threshold=success_threshold))
    comparison = compare(reports[0], reports[1], k=k, alpha=alpha)
    if not comparison.tasks:
        raise Failed(
            f"no task has pass@{k} in both {paths[0]} and {paths[1]} (the same task keys,"
            f" each with at least {k} scored samples): compare at a smaller --k"
        )
    if as_json:
        click.echo(json.dumps(comparison.to_json(), indent=2))
    else:
        click.echo(comparison_markdown(comparison, paths[0].name, paths[1].name))

"""``fleetroll rescore``: judges and checks of stored results, computed again."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from fleetroll.cli.options import CONFIG_OPTION, Failed, load_command_settings

if TYPE_CHECKING:
    from fleetroll.results import RolloutResult

__all__ = ["rescore"]


@click.command()
@click.argument("results_path", metavar="RESULTS", type=click.Path(path_type=Path))
@click.option(
    "--tasks",
    "tasks_paths",
    multiple=True,
    required=True,
    type=click.Path(path_type=Path),
    help="The task file(s) or folder(s) the results were run from (their 'rewards'); repeatable.",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where to write the re-scored results (JSON Lines); never RESULTS itself.",
)
@CONFIG_OPTION
def rescore(
    results_path: Path, tasks_paths: tuple[Path, ...], out: Path, config_file: Path | None
) -> None:
    """Compute again the judges and checks of stored results, into a new file.

    The results in RESULTS are re-scored with the current settings and written
    to --out; RESULTS is left untouched. Each result's task (by its task_key,
    from --tasks) says its reward components: judges and checks are computed
    again from the stored transcript, final answer and steps; a verifier
    component keeps its stored value; the reward is summed again. Results of
    tasks without 'rewards', or never scored, are copied as they are. One
    result per rollout (a resumed journal's last line).
    """
    from fleetroll.errors import FleetrollError
    from fleetroll.pool.journal import read_journal, rebased_images, write_results
    from fleetroll.tasks import load_task_paths

    settings = load_command_settings(config_file)
    if not results_path.is_file():
        raise Failed(f"{results_path}: no such results file")
    if out.exists() and out.resolve() == results_path.resolve():
        raise Failed(f"--out {out} is RESULTS itself: rescore never changes its input")
    try:
        tasks = {t.key: t for t in load_task_paths(tasks_paths, settings.modalities)}
        results = read_journal(results_path, strict=True)
    except (FleetrollError, ValueError) as exc:
        raise Failed(str(exc)) from None
    unknown = next((r for r in results if r.task_key not in tasks), None)
    if unknown is not None:
        raise Failed(
            f"{results_path}: the task {unknown.task_key!r} of rollout {unknown.rollout_id}"
            " is in none of the --tasks given"
        )
    import anyio

    from fleetroll.pool.assembly import judge_config
    from fleetroll.scoring import Judge, Scorer
    from fleetroll.scoring.judge import missing_judge

    problem = missing_judge(tasks.values(), settings.judge)
    if problem is not None:
        raise Failed(problem)
    from fleetroll.scoring.rescore import rescorable, rescore_all
    from fleetroll.telemetry.events import Redactor

    async def job() -> list[RolloutResult]:
        async with Judge(judge_config(settings)) as judge:
            return await rescore_all(
                results,
                tasks,
                Scorer(judge),
                redact=Redactor(settings.secrets()),
                concurrency=settings.judge.max_concurrent,
            )

    rescored = anyio.run(job)
    # Image files (policy.image_store = "files") stay beside RESULTS: --out names them.
    kept = [rebased_images(r, results_path.parent, out.parent) for r in rescored]
    try:
        write_results(out, kept)
    except OSError as exc:
        raise Failed(f"{out}: cannot write: {exc.strerror or exc}") from None
    touched = sum(rescorable(r, tasks[r.task_key]) for r in results)
    changed = sum(a.reward != b.reward for a, b in zip(results, rescored, strict=True))
    unscored = sum(r.reward is None for r in rescored)
    click.echo(
        f"rescored {touched} of {len(results)} results ({changed} rewards changed,"
        f" {unscored} without a reward); written to {out}"
    )

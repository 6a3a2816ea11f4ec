"""What the commands that run tasks share (``run``, ``eval``): their options, their
settings, the checks of their input, and how their errors reach the user.

Only click is imported at load time, so that a command's mistakes (a bad task
file, an unknown fault profile) are said before anything slow is imported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from fleetroll.cli.options import Failed, load_command_settings

if TYPE_CHECKING:
    from fleetroll.settings import Settings
    from fleetroll.tasks import TaskSpec

__all__ = ["job_options", "job_settings", "job_tasks", "reported"]

F = TypeVar("F", bound=Callable[..., Any])


def job_options(command: F) -> F:
    """The options of a command that runs tasks (``run``, ``eval``): the policy,
    its servers, the concurrency, the emulator's fault profile.

    They reach the command as ``policy_kind``, ``model``, ``base_urls``,
    ``concurrency`` and ``profile`` (see :func:`job_settings`).
    """
    options = [
        click.option(
            "--policy",
            "policy_kind",
            type=click.Choice(["scripted", "openai"]),
            default=None,
            help="Default from config: scripted.",
        ),
        click.option("--model", default=None, help="Model name for --policy openai."),
        click.option(
            "--base-url",
            "base_urls",
            multiple=True,
            help="OpenAI-compatible endpoint for --policy openai (…/v1); repeat it for many"
            " servers (policy.base_urls): each rollout sticks to one.",
        ),
        click.option(
            "--concurrency",
            type=click.IntRange(min=1),
            default=None,
            help="Rollouts acting at once (default from config).",
        ),
        click.option(
            "--profile",
            default=None,
            help="Emulator fault profile, when running on the embedded emulator.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def job_settings(
    config_file: Path | None,
    *,
    policy_kind: str | None,
    model: str | None,
    base_urls: Sequence[str],
    concurrency: int | None,
    pool: dict[str, Any] | None = None,
) -> Settings:
    """The settings of a job: ``--config`` and the environment, then the job's options.

    Raises:
        Failed: the configuration is bad, or ``--base-url`` names a server twice.
    """
    pool = dict(pool or {})
    if concurrency is not None:
        pool["concurrency"] = concurrency
    overrides: dict[str, Any] = {"pool": pool} if pool else {}
    policy: dict[str, Any] = {
        k: v for k, v in (("kind", policy_kind), ("model", model)) if v is not None
    }
    if base_urls:  # they replace both policy.base_url and policy.base_urls
        if len({url.rstrip("/") for url in base_urls}) < len(base_urls):
            raise Failed("--base-url names the same policy server twice: give each once")
        policy.update(base_url=base_urls[0], base_urls=list(base_urls))
    settings = load_command_settings(config_file, **overrides)
    if policy:
        settings = settings.model_copy(update={"policy": settings.policy.model_copy(update=policy)})
    return settings


def job_tasks(
    settings: Settings,
    tasks_paths: Sequence[Path],
    *,
    profile: str | None,
    out: Path | None,
    samples: int,
    resume: bool,
    batch_tasks: int | None = None,
) -> list[TaskSpec]:
    """The job's tasks, once every mistake a user can make is said (before anything starts):
    a bad task file, a judged task without a judge, an unknown fault profile, no Fleet
    key for a Fleet URL, a journal that belongs to another batch.

    Raises:
        FleetrollError: one of those, with its one-line message.
        Failed: a judged task and no ``judge.base_url``.
    """
    from fleetroll.scoring.judge import missing_judge
    from fleetroll.tasks import load_task_paths

    tasks = load_task_paths(tasks_paths, settings.modalities)
    problem = missing_judge(tasks, settings.judge)
    if problem is not None:
        raise Failed(problem)
    # A user's mistakes are said before the slow imports and before anything starts.
    if settings.uses_emulator:
        settings.emulator.fault_profile(profile)  # an unknown name
    else:
        settings.require_fleet_api_key()
    if out is not None:
        from fleetroll.pool.journal import BatchIdentity, check_journal

        identity = BatchIdentity.of("", tasks, samples, settings.pool.oversample, batch_tasks)
        check_journal(out, identity, resume=resume)
    return tasks


class _Stopped(Failed):
    """The job stopped early (its journal could not be written): exit code 1."""

    exit_code = 1


@contextmanager
def reported() -> Iterator[None]:
    """A job's errors as a user sees them: one line and exit code 2 (1 when the
    journal could not be written: the batch stopped early), or 130 for a Ctrl-C.

    Raises:
        Failed: a ``FleetrollError`` was raised (its message is the line).
        SystemExit: (130) a ``KeyboardInterrupt`` (outside the job's own signal
            handling, once everything was released and journaled).
    """
    from fleetroll.errors import FleetrollError, JournalError

    try:
        yield
    except JournalError as exc:
        raise _Stopped(str(exc)) from None
    except FleetrollError as exc:
        raise Failed(str(exc)) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None

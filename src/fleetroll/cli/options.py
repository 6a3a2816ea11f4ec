"""What the commands share: options, the error that ends one, loading settings.

Every command module (:mod:`fleetroll.cli.main`, and the ``cli`` modules of the
emulator, the service, telemetry and bench) imports these from here, at the
bottom of the layers, never from another command's module. Only click is
imported at load time, so that building the command line (``fleetroll
--help``) loads nothing else.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from fleetroll.settings import Settings
    from fleetroll.tasks import TaskSpec

__all__ = [
    "CONFIG_OPTION",
    "Failed",
    "job_options",
    "job_settings",
    "job_tasks",
    "load_command_settings",
    "ray_options",
    "reported",
    "until_signalled",
]

F = TypeVar("F", bound=Callable[..., Any])

CONFIG_OPTION = click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A TOML file merged over the shipped defaults.",
)


class Failed(click.ClickException):
    """Bad input or configuration: a clear message and exit code 2."""

    exit_code = 2


def load_command_settings(config_file: Path | None, **overrides: Any) -> Settings:
    """The settings (``--config`` plus environment), and the console logging they ask for.

    Raises:
        Failed: the configuration is bad (its one-line message says where).
    """
    from fleetroll.errors import FleetrollError
    from fleetroll.settings import load_settings
    from fleetroll.telemetry.console import configure_console_logging

    try:
        settings = load_settings(config_file, **overrides)
    except FleetrollError as exc:
        raise Failed(str(exc)) from None
    configure_console_logging(settings.telemetry.console_level)
    return settings


async def until_signalled() -> None:
    """Return on SIGINT or SIGTERM, so servers stop cleanly either way."""
    import anyio

    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return


def ray_options(command: F) -> F:
    """The options ``--ray [ADDRESS]`` and ``--ray-actors N`` of a click command.

    They reach the command as ``ray_address`` (None, ``"local"``, or an
    address) and ``ray_actors``.
    """
    command = click.option(
        "--ray-actors",
        type=click.IntRange(min=1),
        default=None,
        help="Ray actors, each running its own pool (with --ray) [default: one per CPU].",
    )(command)
    return click.option(
        "--ray",
        "ray_address",
        is_flag=False,
        flag_value="local",
        default=None,
        metavar="[ADDRESS]",
        help="Shard batches over Ray actors (a local Ray, or the cluster at ADDRESS).",
    )(command)


def job_options(command: F) -> F:
    """The options of a command that runs tasks (``run``, ``eval``): the policy,
    its servers, the concurrency, the emulator's fault profile, the pre-flight.

    They reach the command as ``policy_kind``, ``model``, ``base_urls``,
    ``concurrency``, ``profile`` and ``no_preflight`` (see :func:`job_settings`).
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
) -> list[TaskSpec]:
    """The job's tasks, once every mistake a user can make is said (before anything starts):
    a bad task file, an unknown fault profile, no Fleet key for a Fleet URL, a journal
    that belongs to another batch.

    Raises:
        FleetrollError: one of those, with its one-line message.
    """
    from fleetroll.tasks import load_task_paths

    tasks = load_task_paths(tasks_paths, settings.modalities)
    if settings.uses_emulator:
        settings.emulator.fault_profile(profile)  # an unknown name
    else:
        settings.require_fleet_api_key()
    if out is not None:
        from fleetroll.pool.journal import BatchIdentity, check_journal

        identity = BatchIdentity.of("", tasks, samples, settings.pool.oversample)
        check_journal(out, identity, resume=resume)
    return tasks


@contextmanager
def reported() -> Iterator[None]:
    """A job's errors as a user sees them: one line and exit code 2, or 130 for a Ctrl-C.

    Raises:
        Failed: a ``FleetrollError`` was raised (its message is the line).
        SystemExit: (130) a ``KeyboardInterrupt`` (outside the job's own signal
            handling, once everything was released and journaled).
    """
    from fleetroll.errors import FleetrollError

    try:
        yield
    except FleetrollError as exc:
        raise Failed(str(exc)) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None

"""What the commands share: options, the error that ends one, loading settings.

Every command module (:mod:`fleetroll.cli.main`, and the ``cli`` modules of the
emulator, the service, telemetry and bench) imports these from here, at the
bottom of the layers, never from another command's module. Only click is
imported at load time, so that building the command line (``fleetroll
--help``) loads nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from fleetroll.settings import Settings

__all__ = ["CONFIG_OPTION", "Failed", "load_command_settings", "ray_options"]

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
    from fleetroll._internal.proxies import Proxies
    from fleetroll.errors import FleetrollError
    from fleetroll.settings import load_settings
    from fleetroll.telemetry.console import configure_console_logging

    try:
        settings = load_settings(config_file, **overrides)
    except FleetrollError as exc:
        raise Failed(str(exc)) from None
    try:  # a proxy the HTTP clients cannot use: said once, before anything starts
        Proxies.from_environment()
    except ValueError as exc:
        raise Failed(str(exc)) from None
    configure_console_logging(settings.telemetry.console_level)
    return settings


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

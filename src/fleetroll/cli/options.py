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

__all__ = ["CONFIG_OPTION", "Failed", "load_command_settings", "ray_options", "resume_command"]

F = TypeVar("F", bound=Callable[..., Any])

CONFIG_OPTION = click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A TOML file merged over the shipped defaults.",
)


def resume_command(ctx: click.Context) -> list[str]:
    """The command line that resumes the job of the command ``ctx`` runs: its arguments
    and the options given (paths made absolute, so it runs from anywhere), and
    ``--resume``. ``fleetroll stats --check`` shows it for the batch's lost rollouts."""
    from click.core import ParameterSource

    words = ["fleetroll", ctx.info_name or ctx.command.name or "run"]

    def word(param: click.Parameter, value: Any) -> str:
        if isinstance(param.type, click.Path) and value is not None:
            return str(Path(value).absolute())
        return str(value)

    for param in ctx.command.params:
        name = param.name or ""
        value = ctx.params.get(name)
        if name == "resume" or value is None:
            continue
        if isinstance(param, click.Argument):
            words += [
                word(param, v) for v in (value if param.multiple or param.nargs != 1 else [value])
            ]
            continue
        if not isinstance(param, click.Option) or ctx.get_parameter_source(name) in (
            ParameterSource.DEFAULT,
            ParameterSource.DEFAULT_MAP,
        ):
            continue
        if param.is_flag:
            if value:
                words.append(param.opts[0])
        elif param.multiple:
            for v in value:
                words += [param.opts[0], word(param, v)]
        else:
            words += [param.opts[0], word(param, value)]
    return [*words, "--resume"]


class Failed(click.ClickException):
    """Bad input or configuration: a clear message and exit code 2."""

    exit_code = 2
    #: Said as one JSON line (``telemetry.console = "json"``, once the settings are read).
    as_json = False

    def show(self, file: Any = None) -> None:
        if not type(self).as_json:
            super().show(file)
            return
        from fleetroll.telemetry.console import json_line

        click.echo(json_line("error", self.format_message()), file=file, err=True)


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
    as_json = settings.telemetry.console == "json"
    configure_console_logging(settings.telemetry.console_level, as_json=as_json)
    Failed.as_json = as_json
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

"""The ``fleetroll`` command line.

Subcommands build the settings once (``--config`` plus environment) and pass
them down. Bad input or configuration ends with a one-line message and exit
code 2; never a traceback.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import anyio
import click

from fleetroll.errors import FleetrollError
from fleetroll.settings import Settings, load_settings

__all__ = ["main"]

_CONFIG_OPTION = click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A TOML file merged over the shipped defaults.",
)


class Failed(click.ClickException):
    """Bad input or configuration: a clear message and exit code 2."""

    exit_code = 2


def _settings(config_file: Path | None, **overrides: Any) -> Settings:
    try:
        return load_settings(config_file, **overrides)
    except FleetrollError as exc:
        raise Failed(str(exc)) from None


async def _until_signalled() -> None:
    """Return on SIGINT or SIGTERM, so servers stop cleanly either way."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fleetroll")
def main() -> None:
    """fleetroll: rollout orchestration for RL training on Fleet environments."""


@main.command()
@click.option("--host", default=None, help="Address to listen on (default from config).")
@click.option("--port", type=int, default=None, help="Port (default from config; 0 = free).")
@click.option("--profile", default=None, help="Fault profile: clean, realistic, chaos, ...")
@click.option("--seed", type=int, default=None, help="Override the profile's RNG seed.")
@_CONFIG_OPTION
def emulator(
    host: str | None,
    port: int | None,
    profile: str | None,
    seed: int | None,
    config_file: Path | None,
) -> None:
    """Run the Fleet-compatible emulator until interrupted.

    Point the Fleet SDK (or `fleetroll run`) at it with FLEET_BASE_URL and
    any non-empty FLEET_API_KEY.
    """
    from fleetroll.emulator import Emulator

    settings = _settings(config_file)
    emu_settings = settings.emulator
    try:
        fault_profile = emu_settings.fault_profile(profile)
    except FleetrollError as exc:
        raise Failed(str(exc)) from None
    if seed is not None:
        fault_profile = fault_profile.model_copy(update={"seed": seed})
    emu = Emulator(
        fault_profile,
        host=host or emu_settings.host,
        port=emu_settings.port if port is None else port,
        verifier_memory_mb=emu_settings.verifier_memory_mb,
    )

    async def run() -> None:
        async with emu:
            click.echo(
                f"fleetroll emulator listening on {emu.base_url} "
                f"(profile {profile or emu_settings.profile})"
            )
            click.echo(f"  export FLEET_BASE_URL={emu.base_url} FLEET_API_KEY=local")
            click.echo(f"  ledger: {emu.base_url}/_emulator/ledger   (Ctrl-C to stop)")
            await _until_signalled()
        click.echo("emulator stopped")

    try:
        anyio.run(run)
    except FleetrollError as exc:
        raise Failed(str(exc)) from None

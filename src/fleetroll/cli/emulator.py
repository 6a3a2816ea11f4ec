"""``fleetroll emulator``: the Fleet-compatible emulator until interrupted.

Registered lazily on the ``fleetroll`` group by :mod:`fleetroll.cli.main`. It
parses and checks its options, then runs
:func:`fleetroll.emulator.main.serve_until_signalled`.
"""

from __future__ import annotations

from pathlib import Path

import click

from fleetroll.cli.options import CONFIG_OPTION, Failed, load_command_settings
from fleetroll.errors import FleetrollError

__all__ = ["emulator"]


@click.command()
@click.option("--host", default=None, help="Address to listen on (default from config: loopback).")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Port (default from config; 0 = free).",
)
@click.option(
    "--allow-remote",
    is_flag=True,
    help="Allow a --host other than loopback (anyone who has the key can run code here).",
)
@click.option(
    "--public-url",
    default=None,
    metavar="URL",
    help="Base of the URLs it hands out (instances' MCP URLs), when a reverse proxy fronts it.",
)
@click.option("--profile", default=None, help="Fault profile: clean, realistic, chaos, ...")
@click.option("--seed", type=int, default=None, help="Override the profile's RNG seed.")
@CONFIG_OPTION
def emulator(
    host: str | None,
    port: int | None,
    allow_remote: bool,
    public_url: str | None,
    profile: str | None,
    seed: int | None,
    config_file: Path | None,
) -> None:
    """Run the Fleet-compatible emulator until interrupted.

    It prints the FLEET_BASE_URL and FLEET_API_KEY to point the Fleet SDK
    (or `fleetroll run`) at it. The key is FLEETROLL_EMULATOR_API_KEY when
    set, else generated. Verifiers of the tasks run on this host, sandboxed.
    """
    from fleetroll._internal.guard import is_loopback
    from fleetroll.emulator.main import serve_until_signalled

    settings = load_command_settings(config_file)
    emu_settings = settings.emulator
    try:
        fault_profile = emu_settings.fault_profile(profile)
    except FleetrollError as exc:
        raise Failed(str(exc)) from None
    if seed is not None:
        fault_profile = fault_profile.model_copy(update={"seed": seed})
    host = host or emu_settings.host
    if not is_loopback(host):
        if not allow_remote:
            raise Failed(
                f"refusing to listen on {host}: the emulator runs task verifiers on this host;"
                " pass --allow-remote to serve beyond loopback anyway"
            )
        click.echo(
            f"warning: the emulator listens on {host}, beyond loopback: anyone who reaches it"
            " with the key can run code on this host as this user",
            err=True,
        )
    key = settings.emulator_api_key
    try:
        serve_until_signalled(
            fault_profile,
            emu_settings,
            profile_name=profile or emu_settings.profile,
            host=host,
            port=emu_settings.port if port is None else port,
            api_key=key.get_secret_value() if key else None,
            public_url=public_url,
            say=click.echo,
        )
    except FleetrollError as exc:
        raise Failed(str(exc)) from None

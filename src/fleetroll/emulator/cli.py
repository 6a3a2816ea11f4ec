"""``fleetroll emulator``: the Fleet-compatible emulator until interrupted.

Registered lazily on the ``fleetroll`` group by :mod:`fleetroll.cli.main`; an
:class:`~fleetroll.emulator.process.EmulatorProcess` runs this command in a
child forked from its zygote.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import click

from fleetroll.cli.options import CONFIG_OPTION, Failed, load_command_settings, until_signalled
from fleetroll.errors import FleetrollError

__all__ = ["emulator"]


def _loop_options() -> dict[str, bool]:
    """uvloop's event loop where it is installed (a dependency but on Windows).

    The emulator's process is its own, so its loop is its choice: under a
    thousand rollouts' bursts of requests, uvloop's transports cost it 12%
    less CPU per rollout than asyncio's.
    """
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}


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
@click.option(
    "--profile-json",
    default=None,
    hidden=True,
    help="A whole fault profile as JSON (used by EmulatorProcess).",
)
@CONFIG_OPTION
def emulator(
    host: str | None,
    port: int | None,
    allow_remote: bool,
    public_url: str | None,
    profile: str | None,
    seed: int | None,
    profile_json: str | None,
    config_file: Path | None,
) -> None:
    """Run the Fleet-compatible emulator until interrupted.

    It prints the FLEET_BASE_URL and FLEET_API_KEY to point the Fleet SDK
    (or `fleetroll run`) at it. The key is FLEETROLL_EMULATOR_API_KEY when
    set, else generated. Verifiers of the tasks run on this host, sandboxed.
    """
    from fleetroll._internal.guard import is_loopback
    from fleetroll.emulator import Emulator, FaultProfile

    settings = load_command_settings(config_file)
    emu_settings = settings.emulator
    try:
        if profile_json is not None:
            fault_profile = FaultProfile.model_validate_json(profile_json)
        else:
            fault_profile = emu_settings.fault_profile(profile)
    except (FleetrollError, ValueError) as exc:
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
    emu = Emulator(
        fault_profile,
        host=host,
        port=emu_settings.port if port is None else port,
        api_key=key.get_secret_value() if key else None,
        verifier_limits=emu_settings.verifier_limits(),
        verifier_max_parallel=emu_settings.verifier_max_parallel,
        keep_ended_instances=emu_settings.keep_ended_instances,
        keep_ended_s=emu_settings.keep_ended_s,
        public_url=public_url,
    )

    async def run() -> None:
        async with emu:
            click.echo(
                f"fleetroll emulator listening on {emu.base_url} "
                f"(profile {profile or emu_settings.profile})"
            )
            click.echo(f"  export FLEET_BASE_URL={emu.public_url}")
            click.echo(f"  export FLEET_API_KEY={emu.api_key}")
            click.echo(f"  ledger: {emu.base_url}/_emulator/ledger   (Ctrl-C to stop)")
            await until_signalled()
        click.echo("emulator stopped")

    try:
        anyio.run(run, backend_options=_loop_options())
    except FleetrollError as exc:
        raise Failed(str(exc)) from None

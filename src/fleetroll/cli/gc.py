"""``fleetroll gc``: release the instances a run id left running.

Registered lazily on the ``fleetroll`` group by :mod:`fleetroll.cli.main`.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import click

from fleetroll.cli.options import CONFIG_OPTION, Failed, load_command_settings
from fleetroll.errors import FleetrollError

__all__ = ["gc"]


@click.command()
@click.option(
    "--run-id",
    default=None,
    help="The run id to collect: a `fleetroll run`'s batch id (its journal's), or a"
    " service's. Default: the service's of service.state_dir, if no serve holds it.",
)
@CONFIG_OPTION
def gc(run_id: str | None, config_file: Path | None) -> None:
    """Release the running instances of a run id (and of its batches and Ray actors).

    What a killed `fleetroll run` or `serve` left behind; `run --resume` and `serve`
    do the same for their own run id when they start. Prints each instance released.
    Needs a Fleet (FLEET_API_KEY, and FLEET_BASE_URL for an emulator process). Do
    not give the run id of a process still running: its instances are in use.
    """
    from fleetroll.pool.batch_pool import FleetTarget, release_run
    from fleetroll.service.state import service_run_id
    from fleetroll.telemetry import Events, MemorySink

    settings = load_command_settings(config_file)
    if settings.uses_emulator:
        raise Failed(
            "fleetroll gc needs a Fleet: set FLEET_API_KEY (and FLEET_BASE_URL for an"
            " emulator process); the embedded emulator's instances end with its process"
        )
    try:
        if run_id is None:
            state_dir = settings.service.state_dir.expanduser()
            try:
                run_id = service_run_id(state_dir)
            except FleetrollError:
                raise Failed(
                    f"a running fleetroll serve holds {state_dir}: its instances are in use"
                    " (stop it first, or pass --run-id)"
                ) from None
            if run_id is None:
                raise Failed(f"no service ran on {state_dir}: pass --run-id")
        fleet = FleetTarget(
            settings.require_fleet_api_key(),
            settings.fleet_base_url,
            settings.fleet_base_url or "Fleet",
        )
        sink = MemorySink()
        released = anyio.run(release_run, settings, fleet, run_id, Events([sink]))
    except FleetrollError as exc:
        raise Failed(str(exc)) from None
    for instance_id in released:
        click.echo(f"released {instance_id}")
    failed = sink.named("fleet_instance_release_failed")
    for event in failed:
        click.echo(f"could not release: {event.attributes.get('error_message')}", err=True)
    click.echo(f"fleetroll gc: run {run_id}: {len(released)} instance(s) released", err=True)
    if failed:
        raise SystemExit(1)

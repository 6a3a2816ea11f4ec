"""``fleetroll serve``: the HTTP service (and MCP tools) until interrupted.

Kept apart from :mod:`fleetroll.cli.main`, which registers :func:`serve` with one
import at its end (so this module must not import that one at load time).
"""

from __future__ import annotations

import signal
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import click

from fleetroll._internal.guard import check_bind
from fleetroll.cli.options import CONFIG_OPTION, Failed, ray_options
from fleetroll.errors import FleetrollError
from fleetroll.service.security import token_from_file
from fleetroll.settings import Settings, load_settings

__all__ = ["serve"]


@click.command()
@click.option("--host", default=None, help="Address to listen on (default from config: loopback).")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Port (default from config; 0 = a free one).",
)
@CONFIG_OPTION
@click.option(
    "--profile", default=None, help="Emulator fault profile, when running on the embedded emulator."
)
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path),
    default=None,
    help=(
        "Keep what serve writes here, made if missing: the telemetry store"
        " (DIR/telemetry.db) and the batches' journals (DIR/service)."
    ),
)
@ray_options
def serve(
    host: str | None,
    port: int | None,
    config_file: Path | None,
    profile: str | None,
    state_dir: Path | None,
    ray_address: str | None,
    ray_actors: int | None,
) -> None:
    """Serve the HTTP API (and MCP tools at /mcp) for remote training controllers.

    One rollout pool serves every request: on the embedded emulator unless
    FLEET_API_KEY or FLEET_BASE_URL is set. With --ray, batches and MCP
    rollouts are sharded over Ray actors; sessions stay in this process. Every
    route but /healthz wants `Authorization: Bearer <token>`: the token is
    FLEETROLL_SERVICE_TOKEN, else the one in service.token_file (made on first
    use, readable by you only; binding anything but loopback needs
    FLEETROLL_SERVICE_TOKEN). --state-dir DIR sets telemetry.db_path and
    service.state_dir under DIR. Exit code 2 for bad configuration.
    """
    try:
        settings = load_settings(config_file)
        if state_dir is not None:
            state_dir = state_dir.expanduser()
            _writable(state_dir)
            settings = settings.with_state_dir(state_dir)
        host = host or settings.service.host
        port = settings.service.port if port is None else port
        check_bind(host, settings.service_token)
        if settings.uses_emulator:
            settings.emulator.fault_profile(profile)  # fail early on a bad name
        token_file: Path | None = None
        made = ""
        if settings.service_token is None:
            # Never serve unauthenticated: a caller's task may carry code (a
            # verifier, a command) that would run as this user.
            token, new = token_from_file(settings.service.token_file)
            settings = settings.model_copy(update={"service_token": token})
            token_file = settings.service.token_file.expanduser()
            made = "made now" if new else "kept from an earlier start"
    except FleetrollError as exc:
        raise Failed(str(exc)) from None
    try:
        anyio.run(_serve, settings, host, port, profile, ray_address, ray_actors, token_file, made)
    except FleetrollError as exc:
        raise Failed(str(exc)) from None


def _writable(root: Path) -> None:
    """Make ``root`` (and its parents) if missing, and check this process can write in it.

    Raises:
        Failed: it cannot (one line: the folder and the system's reason).
    """
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise Failed(f"--state-dir {root}: not a folder serve can write in ({reason})") from None


async def _serve(
    settings: Settings,
    host: str,
    port: int,
    profile: str | None,
    ray_address: str | None,
    ray_actors: int | None,
    token_file: Path | None,
    made: str,
) -> None:
    from fleetroll._internal.gc_policy import gc_policy
    from fleetroll.jobs.fleet import open_fleet
    from fleetroll.pool.batch_pool import open_batch_pool, release_run
    from fleetroll.rollout.agent_process import AgentRecords
    from fleetroll.service.app import Service
    from fleetroll.service.asgi import create_app
    from fleetroll.service.metrics import Metrics
    from fleetroll.service.server import serve_app
    from fleetroll.service.state import open_store
    from fleetroll.telemetry import open_telemetry
    from fleetroll.telemetry.store import is_disabled

    async with AsyncExitStack() as stack:
        # First: a folder another service holds is refused before anything starts.
        store = await stack.enter_async_context(open_store(settings.service.state_dir))
        # What agents a killed earlier start left running end now; this start's
        # are noted until its pool (opened after, closed before) has ended them.
        records = AgentRecords(store.root / "agents")
        await anyio.to_thread.run_sync(records.open)
        stack.callback(records.close)
        # /metrics times every tool call from the same events the store gets.
        metrics = Metrics(settings.service.metrics_label_values)
        events = await stack.enter_async_context(
            open_telemetry(
                settings.telemetry,
                secrets=settings.secrets(),
                logfire_token=settings.logfire_token,
                extra_sinks=[metrics],
            )
        )
        fleet = await open_fleet(stack, settings, profile)
        # What a killed earlier start on this folder left running (its heartbeats
        # stop them too, later); nothing of this start runs yet.
        left = (
            []
            if settings.uses_emulator
            else await release_run(settings, fleet, store.run_id, events)
        )
        # One pool: sessions here; batches and MCP rollouts here or on Ray actors.
        pool, backend = await open_batch_pool(
            stack,
            settings,
            fleet,
            events,
            ray_address=ray_address,
            ray_actors=ray_actors,
            run_id=store.run_id,
        )
        # Once started: what start-up made is frozen (this process is ours).
        stack.enter_context(gc_policy(settings.pool.gc_policy))
        service = Service(pool, settings, store=store, agent_records=records, metrics=metrics)
        url = await stack.enter_async_context(
            serve_app(create_app(service), host, port, before_stop=service.stop)
        )
        click.echo(f"fleetroll serve: {url} on {backend}; bearer token required", err=True)
        # Where the token is, never the token itself (this output may be logged).
        if token_file is None:
            click.echo("  token: FLEETROLL_SERVICE_TOKEN", err=True)
        else:
            click.echo(f"  token: in {token_file} ({made}; readable by you only)", err=True)
        click.echo(f"  API: {url}/openapi.json   MCP: {url}/mcp   (Ctrl-C to stop)", err=True)
        restored = service.batches.restored
        click.echo(f"  batches kept in {store.root} ({restored} read back)", err=True)
        db = settings.telemetry.db_path
        click.echo(f"  telemetry store: {'off' if is_disabled(db) else db}", err=True)
        click.echo(
            f"  run id {store.run_id}: released {len(left)} instance(s) an earlier start left",
            err=True,
        )
        token = "FLEETROLL_SERVICE_TOKEN" if token_file is None else f"the token in {token_file}"
        click.echo(f"  dashboard: {url}/dashboard/login?token=<{token}>", err=True)
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                break
    click.echo("fleetroll serve: stopped", err=True)

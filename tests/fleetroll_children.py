"""``fleetroll`` run as a child process on a test's emulator: its environment."""

from __future__ import annotations

import os

from fleetroll.emulator import Emulator


def child_env(emu: Emulator, **settings: str) -> dict[str, str]:
    """This process's environment without fleetroll's, Fleet's, Logfire's, OpenAI's and
    OpenTelemetry's variables, pointed at ``emu``, no telemetry file, four rollouts at
    a time, then ``settings`` (``FLEETROLL_...`` variables)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLEET_", "FLEETROLL_", "LOGFIRE_", "OPENAI_", "OTEL_"))
    }
    return env | {
        "FLEET_BASE_URL": emu.base_url,
        "FLEET_API_KEY": emu.api_key,
        "FLEETROLL_TELEMETRY__DB_PATH": os.devnull,
        "FLEETROLL_POOL__CONCURRENCY": "4",
        **settings,
    }

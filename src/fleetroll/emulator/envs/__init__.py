"""The sample environments the emulator serves."""

from __future__ import annotations

from fleetroll.emulator.envs.base import SampleEnv
from fleetroll.emulator.envs.desktop import DesktopEnv
from fleetroll.emulator.envs.ledger import LedgerEnv

__all__ = ["SampleEnv", "default_envs"]


def default_envs() -> list[SampleEnv]:
    """One of each sample environment."""
    return [LedgerEnv(), DesktopEnv()]

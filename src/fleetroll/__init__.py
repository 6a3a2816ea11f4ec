"""fleetroll: asyncio-native rollout orchestration for RL on Fleet environments."""

from fleetroll.errors import FleetrollError
from fleetroll.settings import Settings, load_settings

__all__ = ["FleetrollError", "Settings", "load_settings"]

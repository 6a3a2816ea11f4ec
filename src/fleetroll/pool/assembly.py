"""Where the environment providers are built from :class:`~fleetroll.settings.Settings`:
each takes only what it reads (:class:`~fleetroll.environments.fleet.provider.FleetConfig`,
:class:`~fleetroll.environments.mcp.provider.McpConfig`), split out of the settings here.

An assembly module (issue 38's settings rule): the pool, its executors, the CLI,
the service and the benchmarks build their providers through these.
"""

from __future__ import annotations

from fleetroll.environments.admission import Admission, CreateLimits
from fleetroll.environments.fleet.provider import FleetConfig, FleetProvider
from fleetroll.environments.mcp.provider import McpConfig, McpProvider
from fleetroll.environments.mixed import MixedProvider
from fleetroll.settings import Settings
from fleetroll.telemetry.events import Events

__all__ = ["fleet_config", "fleet_provider", "mcp_config", "mcp_provider", "mixed_provider"]


def fleet_config(settings: Settings) -> FleetConfig:
    """What :class:`FleetProvider` reads of ``settings``."""
    return FleetConfig(
        provisioning=settings.provisioning,
        timeouts=settings.timeouts,
        retries=settings.retries,
        pool=settings.pool,
        modalities=settings.modalities,
        create_limits=CreateLimits.from_settings(settings.provisioning),
        preflight_cache_s=settings.service.preflight_cache_s,
        account_limit=settings.admission.account_limit,
    )


def mcp_config(settings: Settings) -> McpConfig:
    """What :class:`McpProvider` reads of ``settings``."""
    return McpConfig(
        timeouts=settings.timeouts,
        retries=settings.retries,
        mcp=settings.mcp,
        pool=settings.pool,
        modalities=settings.modalities,
    )


def fleet_provider(
    settings: Settings,
    events: Events,
    *,
    api_key: str,
    base_url: str | None = None,
    admission: Admission | None = None,
) -> FleetProvider:
    """A :class:`FleetProvider` configured by ``settings``."""
    return FleetProvider(
        fleet_config(settings), events, api_key=api_key, base_url=base_url, admission=admission
    )


def mcp_provider(settings: Settings, events: Events) -> McpProvider:
    """An :class:`McpProvider` configured by ``settings``."""
    return McpProvider(mcp_config(settings), events)


def mixed_provider(
    settings: Settings,
    events: Events,
    *,
    api_key: str | None = None,
    base_url: str | None = None,
    admission: Admission | None = None,
) -> MixedProvider:
    """A :class:`MixedProvider` (Fleet and mcp tasks) configured by ``settings``."""
    return MixedProvider(
        events,
        fleet=fleet_config(settings),
        mcp=mcp_config(settings),
        api_key=api_key,
        base_url=base_url,
        admission=admission,
    )

"""Where the environment providers, the policy and the rollout engine's configuration
are built from :class:`~fleetroll.settings.Settings`: each takes only what it reads
(:class:`~fleetroll.environments.fleet.provider.FleetConfig`,
:class:`~fleetroll.environments.mcp.provider.McpConfig`,
:class:`~fleetroll.policies.ChatPolicyConfig`,
:class:`~fleetroll.rollout.config.RolloutConfig`), split out of the settings here.

An assembly module (issue 38's settings rule): the pool, its executors, the CLI,
the service and the benchmarks build their providers through these.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any

from fleetroll.environments.admission import Admission, CreateLimits
from fleetroll.environments.fleet.provider import FleetConfig, FleetProvider
from fleetroll.environments.mcp.provider import McpConfig, McpProvider
from fleetroll.environments.mixed import MixedProvider
from fleetroll.policies import (
    ChatPolicyConfig,
    OpenAIChatPolicy,
    ScriptedPolicy,
    policy_from_config,
)
from fleetroll.rollout.config import RolloutConfig
from fleetroll.scoring import JudgeConfig
from fleetroll.settings import Settings
from fleetroll.telemetry.events import Events

__all__ = [
    "chat_policy_config",
    "fleet_config",
    "fleet_provider",
    "judge_config",
    "mcp_config",
    "mcp_provider",
    "mixed_provider",
    "open_telemetry",
    "policy_from_settings",
    "rollout_config",
]


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


def chat_policy_config(settings: Settings) -> ChatPolicyConfig:
    """What a policy made from ``settings`` reads: ``[policy]``, ``openai_api_key``,
    ``timeouts.policy_s`` and ``policy_connect_s``, ``retries.policy_backoff_*``
    (for :meth:`OpenAIChatPolicy.from_config` and ``CommandAgent.from_config``)."""
    return ChatPolicyConfig(
        policy=settings.policy,
        api_key=settings.openai_api_key,
        timeout_s=settings.timeouts.policy_s,
        connect_timeout_s=settings.timeouts.policy_connect_s,
        backoff_initial_s=settings.retries.policy_backoff_initial_s,
        backoff_max_s=settings.retries.policy_backoff_max_s,
    )


def policy_from_settings(settings: Settings) -> ScriptedPolicy | OpenAIChatPolicy:
    """The policy ``settings.policy.kind`` names, configured from ``settings``."""
    return policy_from_config(chat_policy_config(settings))


def judge_config(settings: Settings) -> JudgeConfig:
    """The judge of tasks' ``rewards``: ``[judge]``, ``judge_api_key`` and
    ``retries.judge_budget``."""
    return JudgeConfig.from_section(
        settings.judge, api_key=settings.judge_api_key, budget=settings.retries.judge_budget
    )


def rollout_config(settings: Settings) -> RolloutConfig:
    """What a :class:`~fleetroll.rollout.engine.RolloutEngine` reads of ``settings``."""
    return RolloutConfig(
        timeouts=settings.timeouts,
        pool=settings.pool,
        policy=settings.policy,
        judge=judge_config(settings),
        secrets=settings.secrets(),
    )


def open_telemetry(settings: Settings, **options: Any) -> AbstractAsyncContextManager[Events]:
    """:func:`fleetroll.telemetry.open_telemetry` configured by ``settings``: its
    ``[telemetry]`` section, the secrets to redact and the Logfire token.

    Exported as ``fleetroll.open_telemetry``; ``options`` are the rest of
    :func:`fleetroll.telemetry.open_telemetry`'s (``service_name``, ``console``,
    ``extra_sinks``).
    """
    from fleetroll.telemetry import session

    return session.open_telemetry(
        settings.telemetry,
        secrets=settings.secrets(),
        logfire_token=settings.logfire_token,
        **options,
    )

"""fleetroll: asyncio-native rollout orchestration for RL on Fleet environments.

In-process::

    from fleetroll import RolloutPool, ScriptedPolicy, load_settings, load_tasks

    settings = load_settings()
    async with RolloutPool(settings, api_key=..., base_url=...) as pool:
        async for result in pool.run_batch(tasks, ScriptedPolicy(), samples_per_task=8):
            ...

The embedded emulator lives in :mod:`fleetroll.emulator`. Everything not in
``__all__`` may change between versions. Names are imported on first use, so
``import fleetroll`` (and every ``fleetroll`` command) loads only what it uses.
"""

import typing as _typing

from fleetroll._lazy import lazy_attributes as _lazy_attributes

if _typing.TYPE_CHECKING:
    from fleetroll.client import FleetrollClient, ServiceError
    from fleetroll.errors import (
        ConfigError,
        FleetrollError,
        InstanceLostError,
        OperationTimeout,
        PolicyError,
        ProvisionError,
        RolloutError,
        TaskFileError,
        ToolsError,
    )
    from fleetroll.policies import (
        AssistantTurn,
        OpenAIChatPolicy,
        Policy,
        ScriptedPolicy,
        ToolCall,
        ToolSpec,
    )
    from fleetroll.pool.assembly import chat_policy_config, open_telemetry
    from fleetroll.pool.rollout_pool import Batch, BatchCounts, RolloutPool
    from fleetroll.results import FailureReason, RolloutResult, Timings, VerifierOutcome
    from fleetroll.rollout.agent_command import CommandAgent
    from fleetroll.rollout.env_session import EnvSession, StepResult
    from fleetroll.settings import Settings, load_settings
    from fleetroll.tasks import TaskSpec, load_tasks, parse_tasks
    from fleetroll.tools.session import ToolResult
    from fleetroll.training.groups import Group
    from fleetroll.training.trajectory import training_rows

#: Each public name and the module that defines it.
_WHERE: dict[str, str] = {
    "AssistantTurn": "fleetroll.policies",
    "Batch": "fleetroll.pool.rollout_pool",
    "BatchCounts": "fleetroll.pool.rollout_pool",
    "CommandAgent": "fleetroll.rollout.agent_command",
    "ConfigError": "fleetroll.errors",
    "EnvSession": "fleetroll.rollout.env_session",
    "FailureReason": "fleetroll.results",
    "FleetrollClient": "fleetroll.client",
    "FleetrollError": "fleetroll.errors",
    "Group": "fleetroll.training.groups",
    "InstanceLostError": "fleetroll.errors",
    "OpenAIChatPolicy": "fleetroll.policies",
    "OperationTimeout": "fleetroll.errors",
    "Policy": "fleetroll.policies",
    "PolicyError": "fleetroll.errors",
    "ProvisionError": "fleetroll.errors",
    "RolloutError": "fleetroll.errors",
    "RolloutPool": "fleetroll.pool.rollout_pool",
    "RolloutResult": "fleetroll.results",
    "ScriptedPolicy": "fleetroll.policies",
    "ServiceError": "fleetroll.client",
    "Settings": "fleetroll.settings",
    "StepResult": "fleetroll.rollout.env_session",
    "TaskFileError": "fleetroll.errors",
    "TaskSpec": "fleetroll.tasks",
    "Timings": "fleetroll.results",
    "ToolCall": "fleetroll.policies",
    "ToolResult": "fleetroll.tools.session",
    "ToolSpec": "fleetroll.policies",
    "ToolsError": "fleetroll.errors",
    "VerifierOutcome": "fleetroll.results",
    "chat_policy_config": "fleetroll.pool.assembly",
    "load_settings": "fleetroll.settings",
    "load_tasks": "fleetroll.tasks",
    "open_telemetry": "fleetroll.pool.assembly",
    "parse_tasks": "fleetroll.tasks",
    "training_rows": "fleetroll.training.trajectory",
}

__all__ = [
    "AssistantTurn",
    "Batch",
    "BatchCounts",
    "CommandAgent",
    "ConfigError",
    "EnvSession",
    "FailureReason",
    "FleetrollClient",
    "FleetrollError",
    "Group",
    "InstanceLostError",
    "OpenAIChatPolicy",
    "OperationTimeout",
    "Policy",
    "PolicyError",
    "ProvisionError",
    "RolloutError",
    "RolloutPool",
    "RolloutResult",
    "ScriptedPolicy",
    "ServiceError",
    "Settings",
    "StepResult",
    "TaskFileError",
    "TaskSpec",
    "Timings",
    "ToolCall",
    "ToolResult",
    "ToolSpec",
    "ToolsError",
    "VerifierOutcome",
    "chat_policy_config",
    "load_settings",
    "load_tasks",
    "open_telemetry",
    "parse_tasks",
    "training_rows",
]


__getattr__ = _lazy_attributes(__name__, globals(), _WHERE)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

"""fleetroll: asyncio-native rollout orchestration for RL on Fleet environments.

In-process::

    from fleetroll import RolloutPool, ScriptedPolicy, load_settings, load_tasks

    settings = load_settings()
    async with RolloutPool(settings, api_key=..., base_url=...) as pool:
        async for result in pool.run_batch(tasks, ScriptedPolicy(), samples_per_task=8):
            ...

The embedded emulator lives in :mod:`fleetroll.emulator`. Everything not in
``__all__`` may change between versions.
"""

from fleetroll.client import FleetrollClient, ServiceError
from fleetroll.env_session import EnvSession, StepResult
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
from fleetroll.pool import Batch, BatchCounts, RolloutPool
from fleetroll.results import FailureReason, RolloutResult, Timings, VerifierOutcome
from fleetroll.settings import Settings, load_settings
from fleetroll.tasks import TaskSpec, load_tasks, parse_tasks
from fleetroll.tools import ToolResult

__all__ = [
    "AssistantTurn",
    "Batch",
    "BatchCounts",
    "ConfigError",
    "EnvSession",
    "FailureReason",
    "FleetrollClient",
    "FleetrollError",
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
    "load_settings",
    "load_tasks",
    "parse_tasks",
]

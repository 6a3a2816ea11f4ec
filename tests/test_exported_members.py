"""The public API is exactly fleetroll.__all__ (the idea of httpx's test of the same name)."""

from __future__ import annotations

import fleetroll


def test_all_exported_members_exist_and_are_documented() -> None:
    for name in fleetroll.__all__:
        member = getattr(fleetroll, name)
        assert member.__doc__, f"{name} has no docstring"


def test_the_public_api_is_what_the_readme_promises() -> None:
    assert set(fleetroll.__all__) == {
        "AssistantTurn",
        "Batch",
        "BatchCounts",
        "ConfigError",
        "EnvSession",
        "FailureReason",
        "FleetrollClient",
        "FleetrollError",
        "ServiceError",
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
        "Settings",
        "StepResult",
        "TaskFileError",
        "TaskSpec",
        "Timings",
        "ToolCall",
        "ToolResult",
        "ToolSpec",
        "ToolsError",
        "VerifierError",
        "VerifierOutcome",
        "load_settings",
        "load_tasks",
        "parse_tasks",
    }


def test_public_names_are_not_private_modules_leaking() -> None:
    public = {n for n in dir(fleetroll) if not n.startswith("_")}
    modules = {
        "errors",
        "policies",
        "pool",
        "results",
        "rollout",
        "settings",
        "tasks",
        "tools",
        "emulator",
        "provisioning",
        "routing",
        "telemetry",
        "verification",
        "journal",
        "runner",
        "cli",
        "testing",
        "service",
        "client",
        "bench",
    }
    assert public - modules == set(fleetroll.__all__)

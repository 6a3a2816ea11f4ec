"""The public API is exactly fleetroll.__all__ (the idea of httpx's test of the same name)."""

from __future__ import annotations

import types

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
        "CommandAgent",
        "ConfigError",
        "EnvSession",
        "FailureReason",
        "FleetrollClient",
        "FleetrollError",
        "Group",
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
        "VerifierOutcome",
        "load_settings",
        "chat_policy_config",
        "load_tasks",
        "open_telemetry",
        "parse_tasks",
        "training_rows",
    }


def test_no_public_name_but_submodules_lies_outside_all() -> None:
    public = {n for n in dir(fleetroll) if not n.startswith("_")}
    submodules = {n for n in public if isinstance(getattr(fleetroll, n), types.ModuleType)}
    assert public - submodules == set(fleetroll.__all__)


def test_the_lazy_command_list_says_what_each_command_says_of_itself() -> None:
    import importlib

    from fleetroll.cli.main import _LazyGroup

    for name, (target, short_help) in _LazyGroup.lazy.items():
        module, _, attribute = target.partition(":")
        command = getattr(importlib.import_module(module), attribute)
        assert command.name == name
        assert command.get_short_help_str(limit=200) == short_help

"""The task form of the mcp provider: ``environment`` and ``verifier`` (docs/tasks.md)."""

from __future__ import annotations

from typing import Any

import pytest

from fleetroll.errors import TaskFileError
from fleetroll.tasks import parse_task

MODALITIES = {"tool_use"}
SERVER = {"command": ["{python}", "server.py", "--root", "{workdir}"]}
CHECK = {"command": ["bash", "-c", "echo 1"]}


def parse(**fields: Any) -> Any:
    record = {"key": "t-1", "prompt": "Do it.", **fields}
    return parse_task(record, source="tasks.jsonl", line=7, modalities=MODALITIES)


def test_a_task_with_an_environment_and_a_verifier_is_an_mcp_task_named_mcp() -> None:
    task = parse(environment={**SERVER, "files": {"a/b.txt": "x"}, "env": {"K": "v"}},
                 verifier={**CHECK, "reward_file": "reward.txt"})  # fmt: skip
    assert task.env_key == "mcp" and task.env_version is None
    assert task.environment.command == tuple(SERVER["command"])
    assert task.environment.files == {"a/b.txt": "x"}
    assert task.verifier.reward_file == "reward.txt"


def test_an_environment_name_becomes_the_env_key() -> None:
    assert parse(environment={**SERVER, "name": "notes"}, verifier=CHECK).env_key == "notes"


def test_a_url_environment_takes_a_reset_and_a_tool_verifier() -> None:
    task = parse(
        environment={"url": "http://127.0.0.1:9/mcp", "reset": {"tool": {"name": "reset"}}},
        verifier={"tool": {"name": "score", "arguments": {"x": 1}}},
    )
    assert task.environment.reset.tool.name == "reset"
    assert task.verifier.tool.arguments == {"x": 1}


def test_a_url_server_serves_one_rollout_at_a_time_unless_the_task_says_more() -> None:
    url = {"url": "http://127.0.0.1:9/mcp"}
    assert parse(environment=url, verifier=CHECK).environment.max_concurrent_rollouts == 1
    more = parse(environment={**url, "max_concurrent_rollouts": 4}, verifier=CHECK)
    assert more.environment.max_concurrent_rollouts == 4


def test_fleet_tasks_have_no_environment() -> None:
    task = parse(env_key="ledger:v1", verifier_func="def verify(env):\n    return 1.0\n")
    assert task.environment is None and task.verifier is None and task.env_key == "ledger"


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"environment": {**SERVER, "files": {"../x": ""}}, "verifier": CHECK},
         "environment.files", "relative path"),
        ({"environment": {**SERVER, "files": {"/etc/x": ""}}, "verifier": CHECK},
         "environment.files", "relative path"),
        ({"environment": {**SERVER, "url": "http://a/"}, "verifier": CHECK},
         "environment", "exactly one"),
        ({"environment": {"command": []}, "verifier": CHECK},
         "environment.command", "non-empty list"),
        ({"environment": {**SERVER, "colour": 1}, "verifier": CHECK},
         "environment.colour", "unknown field"),
        ({"environment": {**SERVER, "reset": {"tool": {"name": "r"}}}, "verifier": CHECK},
         "environment", "'url' server"),
        ({"environment": {**SERVER, "max_concurrent_rollouts": 2}, "verifier": CHECK},
         "environment", "'url' server"),
        ({"environment": {"url": "http://a/", "max_concurrent_rollouts": 0}, "verifier": CHECK},
         "environment.max_concurrent_rollouts", "greater than or equal to 1"),
        ({"environment": SERVER}, "verifier", "missing required field"),
        ({"environment": SERVER, "verifier": {**CHECK, "tool": {"name": "t"}}},
         "verifier", "exactly one"),
        ({"environment": SERVER, "verifier": {**CHECK, "reward_file": "../r"}},
         "verifier.reward_file", "relative path"),
        ({"environment": SERVER, "verifier": CHECK, "env_key": "ledger"},
         "env_key", "not both"),
        ({"environment": SERVER, "verifier": CHECK, "verifier_func": "def f(): pass"},
         "verifier_func", "Fleet tasks"),
        ({"env_key": "ledger", "verifier": CHECK}, "verifier", "verifier_func"),
        ({"environment": "python server.py", "verifier": CHECK}, "environment", "JSON object"),
    ],
)  # fmt: skip
def test_a_bad_mcp_task_is_refused_naming_file_line_and_field(
    fields: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(TaskFileError) as caught:
        parse(**fields)
    assert caught.value.field == field
    assert caught.value.line == 7 and caught.value.path == "tasks.jsonl"
    assert words in caught.value.reason

"""The ``rewards`` of a task: accepted forms, and errors naming the file, line and field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fleetroll.errors import TaskFileError
from fleetroll.tasks import TaskSpec, load_tasks, parse_task

MODALITIES = ("tool_use",)
VERIFIER = "def verify(env, final_answer=None):\n    return 1.0\n"
MCP = {"command": ["{python}", "{examples}/notes_server.py", "--root", "{workdir}"]}


def task(rewards: object, **fields: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "key": "t-1",
        "prompt": "Say hi.",
        "env_key": "ledger:v1",
        "verifier_func": VERIFIER,
        "rewards": rewards,
    }
    record.update(fields)
    return {name: value for name, value in record.items() if value is not None}


def parse(record: dict[str, Any]) -> TaskSpec:
    return parse_task(record, source="t.jsonl", line=3, modalities=MODALITIES)


def rejected(rewards: object, **fields: Any) -> TaskFileError:
    with pytest.raises(TaskFileError) as caught:
        parse(task(rewards, **fields))
    assert (caught.value.path, caught.value.line) == ("t.jsonl", 3)
    return caught.value


def test_a_task_without_rewards_has_none_and_runs_its_verifier() -> None:
    spec = parse(task(None))

    assert spec.rewards is None
    assert spec.runs_verifier


def test_every_kind_is_read_with_its_fields_and_defaults() -> None:
    spec = parse(
        task(
            [
                {"name": "solved", "kind": "verifier", "weight": 0.5},
                {"name": "clear", "kind": "judge", "weight": 0.2, "rubric": "Is it clear?"},
                {"name": "format", "kind": "regex", "pattern": "^ANSWER: ", "ignore_case": True},
                {"name": "says-hi", "kind": "contains", "text": "hi", "on": "last_message"},
                {"name": "json", "kind": "json_schema", "schema": {"type": "object"}},
                {"name": "short", "kind": "max_turns", "max": 3, "weight": -0.1},
            ]
        )
    )

    assert spec.rewards is not None
    by_name = {r.name: r for r in spec.rewards}
    assert list(by_name) == ["solved", "clear", "format", "says-hi", "json", "short"]
    assert by_name["solved"].weight == 0.5 and spec.runs_verifier
    assert (by_name["clear"].rubric, by_name["clear"].on) == ("Is it clear?", "transcript")
    assert by_name["format"].on == "final_answer" and by_name["format"].ignore_case
    assert by_name["format"].weight == 1.0
    assert by_name["says-hi"].on == "last_message"
    assert by_name["json"].json_schema == {"type": "object"}
    assert (by_name["short"].max, by_name["short"].weight) == (3, -0.1)


def test_rewards_without_a_verifier_component_need_no_verifier() -> None:
    judged = [{"name": "q", "kind": "judge", "rubric": "Good?"}]

    fleet = parse(task(judged, verifier_func=None))
    mcp = parse(task(judged, env_key=None, verifier_func=None, environment=MCP))

    assert not fleet.runs_verifier and fleet.verifier_func is None
    assert mcp.verifier is None and not mcp.runs_verifier


def test_a_verifier_component_still_needs_the_verifier() -> None:
    error = rejected([{"name": "v", "kind": "verifier"}], verifier_func=None)

    assert error.field == "verifier_func"


@pytest.mark.parametrize(
    ("rewards", "field", "words"),
    [
        ([], "rewards", "non-empty list"),
        ({"name": "x"}, "rewards", "non-empty list"),
        (["verifier"], "rewards.0", "must be an object"),
        ([{"name": "x", "kind": "vibes"}], "rewards.0.kind", "unknown kind 'vibes'"),
        ([{"name": "x"}], "rewards.0.kind", "missing"),
        ([{"kind": "verifier"}], "rewards.0.name", "letters, digits"),
        ([{"name": "a b", "kind": "verifier"}], "rewards.0.name", "letters, digits"),
        ([{"name": "x", "kind": "verifier", "weight": "1"}], "rewards.0.weight", "finite number"),
        ([{"name": "x", "kind": "verifier", "weight": True}], "rewards.0.weight", "finite"),
        ([{"name": "x", "kind": "verifier", "rubric": "?"}], "rewards.0.rubric", "unknown field"),
        ([{"name": "x", "kind": "judge"}], "rewards.0.rubric", "missing required field"),
        ([{"name": "x", "kind": "judge", "rubric": " "}], "rewards.0.rubric", "non-empty"),
        (
            [{"name": "x", "kind": "judge", "rubric": "?", "on": "vibes"}],
            "rewards.0.on",
            "final_answer, last_message, transcript",
        ),
        ([{"name": "x", "kind": "regex", "pattern": "("}], "rewards.0.pattern", "regular expr"),
        (
            [{"name": "x", "kind": "regex", "pattern": "a", "ignore_case": "yes"}],
            "rewards.0.ignore_case",
            "true or false",
        ),
        ([{"name": "x", "kind": "contains"}], "rewards.0.text", "missing required field 'text'"),
        (
            [{"name": "x", "kind": "json_schema", "schema": {"type": 3}}],
            "rewards.0.schema",
            "not a valid JSON Schema",
        ),
        ([{"name": "x", "kind": "max_turns", "max": -1}], "rewards.0.max", "whole number ≥ 0"),
        ([{"name": "x", "kind": "max_turns", "max": 2.5}], "rewards.0.max", "whole number ≥ 0"),
        (
            [{"name": "x", "kind": "verifier"}, {"name": "x", "kind": "max_turns", "max": 1}],
            "rewards.1.name",
            "duplicate name 'x', also rewards.0",
        ),
        (
            [{"name": "a", "kind": "verifier"}, {"name": "b", "kind": "verifier"}],
            "rewards.1.kind",
            "at most one component of kind 'verifier'",
        ),
    ],
)
def test_bad_rewards_are_refused_naming_the_field(rewards: object, field: str, words: str) -> None:
    error = rejected(rewards)

    assert error.field == field
    assert words in str(error)
    assert str(error).startswith("t.jsonl:3: ")


def test_a_file_with_bad_rewards_names_its_path_and_line(tmp_path: Path) -> None:
    good = task([{"name": "v", "kind": "verifier"}])
    bad = task([{"name": "v", "kind": "verifier", "weight": None}], key="t-2")
    bad["rewards"][0]["weight"] = "heavy"
    path = tmp_path / "tasks.jsonl"
    path.write_text(f"{json.dumps(good)}\n{json.dumps(bad)}\n", encoding="utf-8")

    with pytest.raises(TaskFileError) as caught:
        load_tasks(path, modalities=MODALITIES)

    assert str(caught.value).startswith(f"{path}:2: field 'rewards.0.weight': ")

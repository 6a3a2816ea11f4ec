"""Task files: both formats, and errors that name the file, the line and the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fleetroll.errors import TaskFileError
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import (
    FLEET_IGNORED_FIELDS,
    SolutionStep,
    TaskLimits,
    TaskSpec,
    load_task_paths,
    load_tasks,
    parse_task,
    parse_tasks,
)

MODALITIES = ("tool_use", "computer_use")
VERIFIER = "def verify(env, final_answer=None):\n    return 1.0\n"


def short(**fields: Any) -> dict[str, Any]:
    """A valid short-form task, with ``fields`` changed (None removes one)."""
    record: dict[str, Any] = {
        "key": "ledger-001",
        "prompt": "Record the rent.",
        "env_key": "ledger:v1",
        "data_key": "seed:v1",
        "modality": "tool_use",
        "verifier_func": VERIFIER,
    }
    record.update(fields)
    return {name: value for name, value in record.items() if value is not None}


def write_jsonl(tmp_path: Path, *records: dict[str, Any] | str) -> Path:
    path = tmp_path / "t.jsonl"
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def parse(record: dict[str, Any]) -> TaskSpec:
    return parse_task(record, source="t.jsonl", line=7, modalities=MODALITIES)


def rejected(record: dict[str, Any]) -> TaskFileError:
    with pytest.raises(TaskFileError) as caught:
        parse(record)
    assert caught.value.path == "t.jsonl" and caught.value.line == 7
    return caught.value


def test_fleet_export_and_short_form_give_the_same_task() -> None:
    solution = [{"name": "record_transaction", "arguments": {"amount": 1800}}]
    fleet = {
        "key": "ledger-001",
        "prompt": "Record the rent.",
        "env_id": "ledger",
        "version": "v1",
        "data_id": "seed",
        "data_version": "v1",
        "verifier_func": VERIFIER,
        "metadata": {"task_modality": "computer_use", "requires_final_answer": True},
        "solution": solution,
        "max_steps": 10,
    }
    short_form = short(
        modality="computer_use",
        verifier_func=VERIFIER,
        metadata={"task_modality": "computer_use", "requires_final_answer": True},
        solution=solution,
        max_steps=10,
    )
    task = parse(fleet)
    assert task == parse(short_form)
    assert (task.env_key, task.env_version, task.env_spec) == ("ledger", "v1", "ledger:v1")
    assert (task.data_key, task.data_version, task.data_spec) == ("seed", "v1", "seed:v1")
    assert task.modality == "computer_use" and task.requires_final_answer
    assert task.solution == (SolutionStep(name="record_transaction", arguments={"amount": 1800}),)
    assert task.metadata["task_modality"] == "computer_use"


def test_optional_parts_default_sensibly() -> None:
    task = parse({"key": "k", "prompt": "p", "env_key": "ledger", "verifier_func": VERIFIER})
    assert task.env_spec == "ledger" and task.env_version is None
    assert task.data_spec is None and task.modality == "tool_use"
    assert task.solution is None and task.max_steps is None
    assert task.requires_final_answer is False and task.metadata == {}


def test_placeholders_are_filled_in_solution_arguments_at_any_depth_and_nowhere_else() -> None:
    solution = [
        {"name": "write_file", "arguments": {"path": "{workdir}/a.txt", "n": 3}},
        {
            "name": "run",
            "arguments": {"argv": ["{python}", "{workdir}/x"], "env": {"D": "{workdir}"}},
        },
    ]
    task = parse(short(prompt="Write {workdir}/a.txt.", solution=solution))

    filled = task.with_placeholders({"{workdir}": "/w/1", "{python}": "/usr/bin/python3"})

    assert [dict(step.arguments) for step in filled.solution or ()] == [
        {"path": "/w/1/a.txt", "n": 3},
        {"argv": ["/usr/bin/python3", "/w/1/x"], "env": {"D": "/w/1"}},
    ]
    assert filled.prompt == "Write {workdir}/a.txt." and filled.key == task.key
    assert task.solution is not None and task.solution[0].arguments["path"] == "{workdir}/a.txt"
    assert task.with_placeholders({}) is task


@pytest.mark.parametrize("nothing", [{}, {"verifier_func": None}, {"verifier_code": None}])
def test_a_fleet_task_without_a_verifier_is_refused_naming_the_file_line_and_field(
    tmp_path: Path, nothing: dict[str, Any]
) -> None:
    # Every rollout of it would end verifier_error: the load says so once instead.
    bare = {**short(key="bare", verifier_func=None), **nothing}
    path = write_jsonl(tmp_path, short(key="ok"), bare)

    with pytest.raises(TaskFileError) as caught:
        load_tasks(path, modalities=MODALITIES)

    assert (caught.value.line, caught.value.field) == (2, "verifier_func")
    assert str(caught.value).startswith(f"{path}:2: field 'verifier_func': missing required field")
    assert "\n" not in str(caught.value)


def test_fleet_extra_fields_are_accepted_and_ignored() -> None:
    extras = {
        "created_at": "2025-06-01T12:00:00",
        "verifier_id": "v-123",
        "verifier_sha": "ab" * 32,
        "verifier_runtime_version": "1",
        "output_json_schema": {"type": "object"},
    }
    assert set(extras) == FLEET_IGNORED_FIELDS
    # Fleet exports write null for what a task does not set (here: the
    # verifier under its other name, verifier_code).
    nulls = {"data_id": None, "data_version": None, "env_variables": None, "verifier_func": None}
    record = {
        "key": "k",
        "prompt": "p",
        "env_id": "ledger",
        "version": "v1",
        "task_modality": "tool_use",
        "verifier_code": VERIFIER,
    }
    task = parse({**record, **extras, **nulls, "metadata": None, "env_variables": {"TZ": "UTC"}})
    assert task.env_spec == "ledger:v1" and task.data_spec is None
    assert task.env_variables == {"TZ": "UTC"}


def test_a_file_exported_by_the_fleet_sdk_loads(tmp_path: Path) -> None:
    from fleet.tasks import Task

    exported = Task(
        key="ledger-001",
        prompt="Record the rent.",
        env_id="ledger",
        version="v1",
        data_id="seed",
        data_version="v1",
        verifier_func=VERIFIER,
        metadata={"task_modality": "tool_use"},
    ).model_dump()
    exported.pop("verifier", None)  # as the SDK's export_tasks does
    path = tmp_path / "tasks_ledger.json"
    path.write_text(json.dumps([exported], indent=2, default=str))
    [task] = load_tasks(path, modalities=MODALITIES)
    metadata = {"task_modality": "tool_use"}
    assert task == parse(short(verifier_func=VERIFIER, metadata=metadata, env_variables={}))


def test_a_missing_prompt_names_the_file_line_and_field(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, short(key="a"), short(key="b", prompt=None))
    with pytest.raises(TaskFileError) as caught:
        load_tasks(path, modalities=MODALITIES)
    error = caught.value
    assert (error.path, error.line, error.field) == (str(path), 2, "prompt")
    assert error.reason == "missing required field 'prompt'"
    assert str(error) == f"{path}:2: field 'prompt': missing required field 'prompt'"


def test_duplicate_keys_name_both_lines(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, short(key="a"), "", short(key="b"), short(key="a"))
    with pytest.raises(TaskFileError) as caught:
        load_tasks(path, modalities=MODALITIES)
    assert (caught.value.line, caught.value.field) == (4, "key")
    assert caught.value.reason == "duplicate key 'a', first used on line 1"


def test_unknown_modality_lists_the_known_ones() -> None:
    error = rejected(short(modality="computr_use"))
    assert error.field == "modality"
    assert error.reason == "unknown modality 'computr_use' (known: computer_use, tool_use)"
    error = rejected(short(modality=None, metadata={"task_modality": "vision"}))
    assert error.field == "metadata.task_modality"


def test_modalities_given_twice_must_agree() -> None:
    assert parse(short(metadata={"task_modality": "tool_use"})).modality == "tool_use"
    error = rejected(short(metadata={"task_modality": "computer_use"}))
    assert error.field == "metadata.task_modality"
    assert error.reason == 'is "computer_use" but \'modality\' is "tool_use"'


def test_versions_given_twice_must_agree() -> None:
    assert parse(short(env_key="ledger", version="v2")).env_spec == "ledger:v2"
    assert rejected(short(version="v2")).field == "env_key"
    assert rejected(short(env_id="ledger")).reason == "give 'env_id' or 'env_key', not both"
    assert rejected(short(env_key=None)).field == "env_key"
    assert rejected(short(env_key="ledger:")).field == "env_key"
    assert rejected(short(data_key=None, data_version="v1")).field == "data_version"


def test_a_typo_in_an_optional_field_is_rejected_with_a_suggestion() -> None:
    error = rejected(short(max_step=5))
    assert error.field == "max_step"
    assert error.reason == "unknown field 'max_step' (did you mean 'max_steps'?)"
    assert rejected(short(colour="red")).reason == "unknown field 'colour'"


@pytest.mark.parametrize(
    ("fields", "field", "reason"),
    [
        ({"max_steps": "5"}, "max_steps", "must be a whole number ≥ 1, got the string '5'"),
        ({"max_steps": 0}, "max_steps", "must be a whole number ≥ 1, got 0"),
        ({"max_steps": 2.0}, "max_steps", "must be a whole number ≥ 1, got 2.0"),
        ({"max_steps": True}, "max_steps", "must be a whole number ≥ 1, got true"),
        ({"prompt": "  "}, "prompt", "must be a non-empty string, got an empty string"),
        ({"key": 12}, "key", "must be a non-empty string, got 12"),
        ({"requires_final_answer": "yes"}, "requires_final_answer", "must be true or false"),
        ({"env_variables": ["A=1"]}, "env_variables", "must be a JSON object, got a list"),
        ({"metadata": "x"}, "metadata", "must be a JSON object, got the string 'x'"),
        ({"verifier_func": ""}, "verifier_func", "must be a non-empty string"),
    ],
)
def test_wrong_types_are_rejected(fields: dict[str, Any], field: str, reason: str) -> None:
    error = rejected(short(**fields))
    assert error.field == field
    assert error.reason.startswith(reason)


@pytest.mark.parametrize(
    ("solution", "field", "reason"),
    [
        ({"name": "x"}, "solution", "must be a list of"),
        (["x"], "solution.0", "must be an object with 'name' and 'arguments'"),
        ([{"name": "a"}, {"arguments": {}}], "solution.1.name", "missing required field 'name'"),
        ([{"name": ""}], "solution.0.name", "must be a non-empty string"),
        (
            [{"name": "a"}, {"name": "b"}, {"name": "c", "arguments": []}],
            "solution.2.arguments",
            "must be a JSON object, got a list",
        ),
        ([{"name": "a", "args": {}}], "solution.0.args", "unknown field 'args'"),
    ],
)
def test_solution_entries_are_validated(solution: object, field: str, reason: str) -> None:
    error = rejected(short(solution=solution))
    assert error.field == field
    assert error.reason.startswith(reason)


def test_a_solution_step_without_arguments_gets_an_empty_object() -> None:
    task = parse(short(solution=[{"name": "list_accounts"}]))
    assert task.solution == (SolutionStep(name="list_accounts", arguments={}),)


def test_requires_final_answer_given_twice_must_agree() -> None:
    both = short(requires_final_answer=True, metadata={"requires_final_answer": True})
    assert parse(both).requires_final_answer
    odd = short(requires_final_answer=True, metadata={"requires_final_answer": False})
    assert rejected(odd).field == "metadata.requires_final_answer"


def test_a_verifier_with_a_syntax_error_is_rejected_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').close()\n\ndef verify(env):\n    return 1.0 +\n"
    error = rejected(short(verifier_func=code))
    assert error.field == "verifier_func"
    assert "is not valid Python" in error.reason and "line 4 of the verifier" in error.reason
    assert not marker.exists()


def test_a_valid_verifier_is_parsed_but_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').close()\n\ndef verify(env):\n    return 1.0\n"
    path = write_jsonl(tmp_path, short(verifier_func=code))
    assert load_tasks(path, modalities=MODALITIES)[0].verifier_func == code
    assert not marker.exists()


def test_a_verifier_must_define_a_function() -> None:
    error = rejected(short(verifier_func="score = 1.0\n"))
    assert error.field == "verifier_func" and "defines no top-level function" in error.reason


def test_a_json_array_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "tasks.json"  # any extension: the '[' decides
    path.write_text(json.dumps([short(key="a"), short(key="b")], indent=2))
    assert [task.key for task in load_tasks(path, modalities=MODALITIES)] == ["a", "b"]
    path.write_text("  []  ")
    with pytest.raises(TaskFileError, match="no tasks"):
        load_tasks(path, modalities=MODALITIES)


def test_an_error_in_a_json_array_gives_the_line_and_the_item(tmp_path: Path) -> None:
    path = tmp_path / "tasks.json"
    path.write_text(
        json.dumps([short(key="a"), short(key="b"), short(key="c", max_steps=0)], indent=2)
    )
    with pytest.raises(TaskFileError) as caught:
        load_tasks(path, modalities=MODALITIES)
    error = caught.value
    lines = path.read_text().split("\n")
    assert lines[error.line - 1].strip() == "{" and '"key": "c"' in lines[error.line]
    assert error.field == "max_steps" and error.reason.endswith("(the 3rd task in the array)")


def test_invalid_json_reports_the_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, short(key="a"), '{"key": "b", "prompt": }')
    with pytest.raises(TaskFileError) as caught:
        load_tasks(path, modalities=MODALITIES)
    assert caught.value.line == 2 and "invalid JSON at column 24" in caught.value.reason
    array = tmp_path / "tasks.json"
    array.write_text('[\n  {"key": "a"},\n  {"key": "b",}\n]\n')
    with pytest.raises(TaskFileError) as caught:
        load_tasks(array, modalities=MODALITIES)
    assert caught.value.line == 3 and "column 15" in caught.value.reason


def test_a_pretty_printed_object_in_json_lines_gets_a_hint(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, "{", '  "key": "a"', "}")
    with pytest.raises(TaskFileError, match="each task on one line") as caught:
        load_tasks(path, modalities=MODALITIES)
    assert caught.value.line == 1


def test_a_line_that_is_not_an_object_is_rejected(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, short(key="a"), '"just a string"')
    with pytest.raises(TaskFileError, match="must be a JSON object") as caught:
        load_tasks(path, modalities=MODALITIES)
    assert caught.value.line == 2


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_an_empty_file_has_no_tasks(tmp_path: Path, text: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    with pytest.raises(TaskFileError, match="no tasks"):
        load_tasks(path, modalities=MODALITIES)


def test_a_missing_or_unreadable_file_is_a_task_file_error(tmp_path: Path) -> None:
    with pytest.raises(TaskFileError, match="cannot read the file") as caught:
        load_tasks(tmp_path / "nope.jsonl", modalities=MODALITIES)
    assert caught.value.path == str(tmp_path / "nope.jsonl")
    # A folder is read as its task files (test_load_tasks_reads_a_folder_...): this one has none.
    with pytest.raises(TaskFileError, match=r"no \.jsonl or \.json task file"):
        load_tasks(tmp_path, modalities=MODALITIES)
    binary = tmp_path / "t.jsonl"
    binary.write_bytes(b'{"key": "\xff"}\n')
    with pytest.raises(TaskFileError, match="not UTF-8"):
        load_tasks(binary, modalities=MODALITIES)


def test_a_string_with_a_unicode_line_separator_stays_on_its_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    record = short(prompt="first\u2028second")
    path.write_text(json.dumps(record, ensure_ascii=False) + "\n", encoding="utf-8")
    assert load_tasks(path, modalities=MODALITIES)[0].prompt == "first\u2028second"


def test_in_memory_records_name_their_position_in_the_list() -> None:
    tasks = parse_tasks([short(key="a"), short(key="b")], source="request", modalities=MODALITIES)
    assert [task.key for task in tasks] == ["a", "b"]
    with pytest.raises(TaskFileError) as caught:
        parse_tasks([short(key="a"), short(prompt=None)], source="request", modalities=MODALITIES)
    assert caught.value.line is None and caught.value.field == "prompt"
    assert str(caught.value) == (
        "request: field 'prompt': missing required field 'prompt' (the 2nd task in the list)"
    )
    with pytest.raises(TaskFileError, match="first used by the 1st task in the list"):
        parse_tasks([short(key="a"), short(key="a")], source="request", modalities=MODALITIES)
    with pytest.raises(TaskFileError, match="no tasks"):
        parse_tasks([], source="request", modalities=MODALITIES)


def test_every_shipped_example_task_file_loads() -> None:
    files = sorted((config_dir() / "tasks").glob("*.jsonl"))
    assert files, "no example task files shipped in config/tasks"
    modalities = load_settings().modalities
    for path in files:
        tasks = load_tasks(path, modalities=modalities)
        assert tasks, path
        assert all(task.verifier_func and task.solution for task in tasks), path


# -- limits, checked before the work they bound (issue 12.7, 12.8) -----------------


def test_a_task_file_over_the_size_limit_is_refused_without_being_read(tmp_path: Path) -> None:
    path = tmp_path / "huge.jsonl"
    with path.open("wb") as f:
        f.truncate(50 * 1024**3)  # 50 GiB of holes: reading it would take minutes

    with pytest.raises(TaskFileError, match="over") as caught:
        load_tasks(path, modalities=MODALITIES, limits=TaskLimits(max_file_bytes=1024**2))

    assert caught.value.path == str(path)


def test_a_folder_whose_files_together_are_over_the_limit_is_refused(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(short(key=name)) + "\n")
    one_file = (tmp_path / "a.jsonl").stat().st_size

    with pytest.raises(TaskFileError, match="over"):
        load_task_paths([tmp_path], MODALITIES, TaskLimits(max_file_bytes=one_file + 1))
    assert len(load_task_paths([tmp_path], MODALITIES, TaskLimits(max_file_bytes=2 * one_file)))


def test_a_folder_is_read_one_level_deep_and_one_warning_names_subfolders_with_tasks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "top.jsonl").write_text(json.dumps(short(key="top")) + "\n")
    for sub in ("mcp", "more"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "t.jsonl").write_text(json.dumps(short(key=sub)) + "\n")
    (tmp_path / "notes").mkdir()  # no task file: nothing to say about it

    with caplog.at_level("WARNING", logger="fleetroll.tasks"):
        tasks = load_task_paths([tmp_path], MODALITIES)

    assert [t.key for t in tasks] == ["top"]
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path}: not reading the task files in its subfolder(s) mcp, more: folders are"
        " read one level deep; name a subfolder to load it too"
    ]
    assert [t.key for t in load_task_paths([tmp_path, tmp_path / "mcp"], MODALITIES)] == [
        "top",
        "mcp",
    ]


def test_load_tasks_reads_a_folder_as_the_cli_and_tasks_file_do(tmp_path: Path) -> None:
    for name in ("b", "a"):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(short(key=name)) + "\n")

    assert [t.key for t in load_tasks(tmp_path, modalities=MODALITIES)] == ["a", "b"]
    assert load_tasks(str(tmp_path), modalities=MODALITIES) == load_task_paths(
        [tmp_path], MODALITIES
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TaskFileError, match=r"no \.jsonl or \.json task file in this folder"):
        load_tasks(empty, modalities=MODALITIES)


def test_a_folder_whose_task_files_are_all_in_subfolders_says_so(tmp_path: Path) -> None:
    (tmp_path / "mcp").mkdir()
    (tmp_path / "mcp" / "t.jsonl").write_text(json.dumps(short()) + "\n")

    with pytest.raises(TaskFileError) as caught:
        load_task_paths([tmp_path], MODALITIES)

    assert str(caught.value) == (
        f"{tmp_path}: no .jsonl or .json task file in this folder; not reading the task files"
        " in its subfolder(s) mcp: folders are read one level deep; name a subfolder to load it"
        " too"
    )


def test_reading_stops_at_the_first_task_over_the_count_limit(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, *(short(key=f"t{n}") for n in range(5)))

    with pytest.raises(TaskFileError, match="3") as caught:
        load_tasks(path, modalities=MODALITIES, limits=TaskLimits(max_tasks=3))

    assert caught.value.line == 4
    with pytest.raises(TaskFileError, match="3"):
        parse_tasks(
            [short(key=f"t{n}") for n in range(5)],
            source="request",
            modalities=MODALITIES,
            limits=TaskLimits(max_tasks=3),
        )


def test_a_verifier_over_the_size_limit_is_refused_naming_its_line(tmp_path: Path) -> None:
    big = VERIFIER + "# " + "x" * 2000 + "\n"
    path = write_jsonl(
        tmp_path, short(key="ok", verifier_func=VERIFIER), short(key="big", verifier_func=big)
    )

    with pytest.raises(TaskFileError) as caught:
        load_tasks(path, modalities=MODALITIES, limits=TaskLimits(max_verifier_bytes=1000))

    assert caught.value.line == 2 and caught.value.field == "verifier_func"


def test_a_verifier_nested_too_deeply_for_the_parser_is_a_task_file_error(
    tmp_path: Path,
) -> None:
    deep = "def verify(env):\n    return " + "-" * 10_000 + "1\n"
    path = write_jsonl(tmp_path, short(key="deep", verifier_func=deep))

    with pytest.raises(TaskFileError) as caught:
        load_tasks(path, modalities=MODALITIES)

    assert caught.value.line == 1 and caught.value.field == "verifier_func"


def test_tasks_sharing_a_verifier_share_one_string(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, *(short(key=f"t{n}", verifier_func=VERIFIER) for n in range(3)))

    tasks = load_tasks(path, modalities=MODALITIES)

    assert len({id(t.verifier_func) for t in tasks}) == 1


def test_a_task_s_seed_and_timestamp_are_read_at_the_top_level_or_in_metadata() -> None:
    top = parse(short(seed=7, timestamp=1_767_225_600))
    assert (top.seed, top.timestamp) == (7, 1_767_225_600)
    # Fleet's exports carry them in metadata.
    exported = parse(short(metadata={"seed": 7, "timestamp": 1_767_225_600}))
    assert (exported.seed, exported.timestamp) == (7, 1_767_225_600)
    both = parse(short(seed=0, metadata={"seed": 0}))
    assert (both.seed, both.timestamp) == (0, None)
    assert (parse(short()).seed, parse(short()).timestamp) == (None, None)


@pytest.mark.parametrize(
    ("fields", "field", "reason"),
    [
        ({"seed": "7"}, "seed", "must be a whole number ≥ 0, got the string '7'"),
        ({"seed": -1}, "seed", "must be a whole number ≥ 0, got -1"),
        ({"seed": 1.5}, "seed", "must be a whole number ≥ 0, got 1.5"),
        ({"seed": True}, "seed", "must be a whole number ≥ 0, got true"),
        (
            {"timestamp": "2026-01-01"},
            "timestamp",
            "must be a whole number of seconds since 1970 (Unix time), got the string '2026-01-01'",
        ),
        (
            {"metadata": {"timestamp": 1.5}},
            "metadata.timestamp",
            "must be a whole number of seconds since 1970 (Unix time), got 1.5",
        ),
        ({"seed": 7, "metadata": {"seed": 8}}, "metadata.seed", "is 8 but 'seed' is 7"),
    ],
)
def test_a_bad_seed_or_timestamp_is_refused_in_one_line_naming_it(
    fields: dict[str, Any], field: str, reason: str
) -> None:
    error = rejected(short(**fields))
    assert (error.field, error.reason) == (field, reason)


def test_a_task_on_an_mcp_server_refuses_a_seed_it_could_not_send() -> None:
    record = {
        "key": "notes-001",
        "prompt": "Write a note.",
        "environment": {"command": ["{python}", "-c", "pass"]},
        "verifier": {"command": ["echo", "1"]},
        "metadata": {"seed": 3},
    }
    error = rejected(record)
    assert error.field == "metadata.seed"
    assert "is sent with a Fleet instance's reset" in error.reason

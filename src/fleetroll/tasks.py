"""Tasks: the input contract (DESIGN.md §4).

A :class:`TaskSpec` is one validated task. Fleet's export format (``env_id``,
``version``, ``data_id``, ``data_version``, ``metadata.task_modality``) and the
short form (``env_key: "ledger:v1"``, ``data_key: "seed:v1"``, ``modality``)
both become the same TaskSpec. Reading is pure: a verifier's code is parsed
with :func:`ast.parse`, never run, so a task file cannot run code in the
orchestrator's process. The first problem raises :class:`TaskFileError` naming
the file, the line and the field.
"""

from __future__ import annotations

import ast
import difflib
import json
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from fleetroll.errors import TaskFileError

__all__ = [
    "FLEET_IGNORED_FIELDS",
    "SolutionStep",
    "TaskSpec",
    "load_tasks",
    "parse_task",
    "parse_tasks",
]

#: Fields of Fleet's task export that fleetroll accepts and does not use.
FLEET_IGNORED_FIELDS: Final = frozenset(
    {"created_at", "verifier_id", "verifier_sha", "verifier_runtime_version", "output_json_schema"}
)
#: Every field fleetroll reads, in either format. Anything else is an error, so
#: a typo such as ``max_step`` cannot silently vanish.
_KNOWN_FIELDS: Final = frozenset(
    {
        "key", "prompt", "env_id", "version", "env_key", "data_id", "data_version", "data_key",
        "modality", "task_modality", "verifier_func", "max_steps", "env_variables", "solution",
        "requires_final_answer", "metadata",
    }
)  # fmt: skip
_T = TypeVar("_T")
_MISSING: Final = object()


class SolutionStep(BaseModel):
    """One tool call of a task's known solution."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)


class TaskSpec(BaseModel):
    """One task, normalised from either accepted format."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str = Field(min_length=1)
    prompt: str = Field(min_length=1)
    env_key: str = Field(min_length=1)
    env_version: str | None = None
    data_key: str | None = None
    data_version: str | None = None
    modality: str = "tool_use"
    verifier_func: str | None = None
    max_steps: int | None = Field(default=None, ge=1)
    env_variables: dict[str, Any] | None = None
    solution: tuple[SolutionStep, ...] | None = None
    requires_final_answer: bool = False
    metadata: dict[str, Any] = Field(default_factory=dict)

    @property
    def env_spec(self) -> str:
        """``env_key[:version]`` as the SDK's ``make`` takes it."""
        return f"{self.env_key}:{self.env_version}" if self.env_version else self.env_key

    @property
    def data_spec(self) -> str | None:
        """``data_key[:version]`` as the SDK's ``make`` takes it, or None."""
        if self.data_key is None:
            return None
        return f"{self.data_key}:{self.data_version}" if self.data_version else self.data_key


def load_tasks(path: str | Path, *, modalities: Collection[str]) -> list[TaskSpec]:
    """Read and validate every task of a file, before anything runs.

    The file holds JSON Lines (one task per line, blank lines skipped) or a JSON
    array, recognised by its first non-blank character ``[`` whatever the
    extension. For an array, errors give the line the item starts on and say
    which item it is.

    Args:
        path: the task file.
        modalities: the modality names routed here (``Settings.modalities``' keys).

    Raises:
        TaskFileError: the file cannot be read, is not valid JSON, holds no
            tasks, holds an invalid task, or uses one key twice.
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise TaskFileError(f"not UTF-8 text (byte {exc.start})", path=source) from None
    except OSError as exc:
        raise TaskFileError(f"cannot read the file: {exc.strerror or exc}", path=source) from None
    read = _read_array if text.lstrip().startswith("[") else _read_lines
    return _parse_all(read(text, source), source, modalities)


def parse_tasks(
    records: Sequence[Mapping[str, Any]], *, source: str, modalities: Collection[str]
) -> list[TaskSpec]:
    """Validate in-memory task records (e.g. a request body) as :func:`load_tasks` does.

    Args:
        records: task objects, in either format.
        source: what to call the records in errors (e.g. ``"request body"``).
        modalities: the modality names this deployment routes.

    Raises:
        TaskFileError: there are no records, one is invalid (the message says
            which, e.g. "the 3rd task in the list"), or two share a key.
    """
    entries = [(rec, _Where(source, nth=i, container="list")) for i, rec in enumerate(records, 1)]
    return _parse_all(entries, source, modalities)


def parse_task(
    record: Mapping[str, Any], *, source: str, line: int | None = None, modalities: Collection[str]
) -> TaskSpec:
    """Validate one task record, in Fleet's export format or the short form.

    Args:
        record: the decoded JSON object.
        source: the file (or other origin) to name in errors.
        line: the record's 1-based line in ``source``, if it has one.
        modalities: the modality names this deployment routes.

    Raises:
        TaskFileError: a field is missing, unknown, of the wrong type or at odds
            with another, the modality is unknown, or ``verifier_func`` is not
            Python defining a top-level function.
    """
    return _parse(record, _Where(source, line=line), modalities)


@dataclass(frozen=True, slots=True)
class _Where:
    """Where a record came from, to build errors that point at it."""

    source: str
    line: int | None = None
    nth: int = 0  # 1-based position in a JSON array or a list; 0 when in neither
    container: str = "array"

    @property
    def ordinal(self) -> str:
        return f"the {_nth(self.nth)} task in the {self.container}" if self.nth else ""

    def error(self, reason: str, field: str | None = None) -> TaskFileError:
        reason = f"{reason} ({self.ordinal})" if self.ordinal else reason
        return TaskFileError(reason, path=self.source, line=self.line, field=field)


def _parse_all(
    entries: Sequence[tuple[object, _Where]], source: str, modalities: Collection[str]
) -> list[TaskSpec]:
    if not entries:
        raise TaskFileError("no tasks", path=source)
    tasks = [(_parse(record, where, modalities), where) for record, where in entries]
    first_use: dict[str, _Where] = {}
    for task, where in tasks:
        first = first_use.setdefault(task.key, where)
        if first is not where:
            at = f"on line {first.line}" if first.line is not None else f"by {first.ordinal}"
            raise where.error(f"duplicate key {task.key!r}, first used {at}", "key")
    return [task for task, _ in tasks]


def _parse(record: object, where: _Where, modalities: Collection[str]) -> TaskSpec:
    if not isinstance(record, Mapping):
        raise where.error(f"each task must be a JSON object, got {_describe(record)}")
    unknown = sorted(set(record) - _KNOWN_FIELDS - FLEET_IGNORED_FIELDS)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(_KNOWN_FIELDS), n=1, cutoff=0.7)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise where.error(f"unknown field {unknown[0]!r}{hint}", unknown[0])
    metadata = _object(record.get("metadata"), "metadata", where) or {}
    env_key, env_version = _spec(record, ("env_id", "env_key"), "version", where)
    if env_key is None:
        hint = "e.g. \"ledger:v1\"; Fleet's export calls it 'env_id'"
        raise where.error(f"missing required field 'env_key' ({hint})", "env_key")
    data_key, data_version = _spec(record, ("data_id", "data_key"), "data_version", where)
    named = {
        "modality": record.get("modality"),
        "task_modality": record.get("task_modality"),
        "metadata.task_modality": metadata.get("task_modality"),
    }
    modality = _agreed(named, where, _string) or "tool_use"
    if modality not in modalities:
        known = ", ".join(sorted(modalities)) or "none"
        field = next((name for name, value in named.items() if value is not None), "modality")
        raise where.error(f"unknown modality {modality!r} (known: {known})", field)
    final_answer = {
        "requires_final_answer": record.get("requires_final_answer"),
        "metadata.requires_final_answer": metadata.get("requires_final_answer"),
    }
    max_steps = record.get("max_steps")
    if max_steps is not None and (type(max_steps) is not int or max_steps < 1):
        raise where.error(f"must be a whole number ≥ 1, got {_describe(max_steps)}", "max_steps")
    verifier = record.get("verifier_func")
    return TaskSpec(
        key=_string(record.get("key", _MISSING), "key", where),
        prompt=_string(record.get("prompt", _MISSING), "prompt", where),
        env_key=env_key,
        env_version=env_version,
        data_key=data_key,
        data_version=data_version,
        modality=modality,
        verifier_func=None if verifier is None else _verifier(verifier, where),
        max_steps=max_steps,
        env_variables=_object(record.get("env_variables"), "env_variables", where),
        solution=_solution(record.get("solution"), where),
        requires_final_answer=_agreed(final_answer, where, _boolean) or False,
        metadata=metadata,
    )


def _spec(
    record: Mapping[str, Any], names: tuple[str, str], version_field: str, where: _Where
) -> tuple[str | None, str | None]:
    """Name and version from ``env_id`` + ``version`` or ``env_key: "name:version"``."""
    given = [name for name in names if record.get(name) is not None]
    if len(given) > 1:
        raise where.error(f"give {names[0]!r} or {names[1]!r}, not both", given[1])
    version = record.get(version_field)
    version = None if version is None else _string(version, version_field, where)
    if not given:
        if version is not None:
            raise where.error(f"is set but {names[0]!r} is not", version_field)
        return None, None
    value = _string(record[given[0]], given[0], where)
    name, colon, inline = value.partition(":")
    if colon and not (name and inline):
        raise where.error(f"must look like 'name' or 'name:version', got {value!r}", given[0])
    if colon and version is not None and version != inline:
        reason = f"says version {inline!r} but {version_field!r} says {version!r}"
        raise where.error(reason, given[0])
    return name, inline or version


def _agreed(
    named: Mapping[str, object], where: _Where, check: Callable[[object, str, _Where], _T]
) -> _T | None:
    """The one value given under several names; they must agree when several are."""
    given = [(n, check(v, n, where)) for n, v in named.items() if v is not None]
    for name, value in given[1:]:
        if value != given[0][1]:
            first, first_value = given[0]
            reason = f"is {json.dumps(value)} but {first!r} is {json.dumps(first_value)}"
            raise where.error(reason, name)
    return given[0][1] if given else None


def _string(value: object, field: str, where: _Where) -> str:
    if value is _MISSING:
        raise where.error(f"missing required field {field.rpartition('.')[2]!r}", field)
    if not isinstance(value, str) or not value.strip():
        raise where.error(f"must be a non-empty string, got {_describe(value)}", field)
    return value


def _boolean(value: object, field: str, where: _Where) -> bool:
    if not isinstance(value, bool):
        raise where.error(f"must be true or false, got {_describe(value)}", field)
    return value


def _object(value: object, field: str, where: _Where) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, Mapping):
        raise where.error(f"must be a JSON object, got {_describe(value)}", field)
    return None if value is None else dict(value)


def _verifier(value: object, where: _Where) -> str:
    """Check the verifier is Python defining a function: parsed only, never run."""
    code = _string(value, "verifier_func", where)
    try:
        tree = ast.parse(code, filename="<verifier_func>")
    except SyntaxError as exc:
        at = f" at line {exc.lineno} of the verifier" if exc.lineno else ""
        text = f": {exc.text.strip()!r}" if exc.text and exc.text.strip() else ""
        raise where.error(f"is not valid Python: {exc.msg}{at}{text}", "verifier_func") from None
    except (ValueError, RecursionError) as exc:  # null bytes; absurd nesting
        raise where.error(f"is not valid Python: {exc}", "verifier_func") from None
    if not any(isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) for node in tree.body):
        example = "def verify(env, final_answer=None): ..."
        raise where.error(f"defines no top-level function (e.g. {example!r})", "verifier_func")
    return code


def _solution(value: object, where: _Where) -> tuple[SolutionStep, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        shape = '{"name": ..., "arguments": {...}}'
        raise where.error(f"must be a list of {shape}, got {_describe(value)}", "solution")
    steps = []
    for i, step in enumerate(value):
        field = f"solution.{i}"
        if not isinstance(step, Mapping):
            reason = f"must be an object with 'name' and 'arguments', got {_describe(step)}"
            raise where.error(reason, field)
        extra = sorted(set(step) - {"name", "arguments"})
        if extra:
            reason = f"unknown field {extra[0]!r} (a step has 'name' and 'arguments')"
            raise where.error(reason, f"{field}.{extra[0]}")
        name = _string(step.get("name", _MISSING), f"{field}.name", where)
        arguments = _object(step.get("arguments"), f"{field}.arguments", where) or {}
        steps.append(SolutionStep(name=name, arguments=arguments))
    return tuple(steps)


def _read_lines(text: str, source: str) -> list[tuple[object, _Where]]:
    entries: list[tuple[object, _Where]] = []
    # split("\n"), not splitlines(): JSON strings may hold a raw U+2028.
    for number, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as exc:
            cut = exc.pos >= len(raw.rstrip())
            hint = " (JSON Lines needs each task on one line, or use a JSON array)" if cut else ""
            reason = f"invalid JSON at column {exc.colno}: {exc.msg}{hint}"
            raise TaskFileError(reason, path=source, line=number) from None
        entries.append((record, _Where(source, line=number)))
    return entries


def _read_array(text: str, source: str) -> list[tuple[object, _Where]]:
    try:
        count = len(json.loads(text))
    except json.JSONDecodeError as exc:
        reason = f"invalid JSON at column {exc.colno}: {exc.msg}"
        raise TaskFileError(reason, path=source, line=exc.lineno) from None
    # The text is a valid array: walk it item by item to learn where each starts.
    entries: list[tuple[object, _Where]] = []
    pos, line, counted = text.index("[") + 1, 1, 0
    for nth in range(1, count + 1):
        pos = _skip_blank(text, pos)
        line, counted = line + text.count("\n", counted, pos), pos
        record, pos = _DECODER.raw_decode(text, pos)
        entries.append((record, _Where(source, line=line, nth=nth)))
        pos = _skip_blank(text, pos) + 1  # past the ',' (or the closing ']')
    return entries


def _skip_blank(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


_DECODER: Final = json.JSONDecoder()


def _describe(value: object) -> str:
    """A JSON value as a person would name it in an error message."""
    if isinstance(value, str):
        return f"the string {value[:40]!r}" if value.strip() else "an empty string"
    if isinstance(value, Mapping):
        return "an object"
    return "a list" if isinstance(value, list | tuple) else json.dumps(value, default=repr)


def _nth(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"

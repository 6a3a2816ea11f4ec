"""Tasks: the input contract (docs/tasks.md).

A :class:`TaskSpec` is one validated task. Fleet's export format (``env_id``,
``version``, ``data_id``, ``data_version``, ``metadata.task_modality``) and the
short form (``env_key: "ledger:v1"``, ``data_key: "seed:v1"``, ``modality``)
both become the same TaskSpec. Reading is pure: a verifier's code is compiled
with :func:`compile`, never run, so a task file cannot run code in the
orchestrator's process. The first problem raises :class:`TaskFileError` naming
the file, the line and the field.
Turning a file's bytes into JSON records (JSON Lines or an array, with the
line of each) is :mod:`fleetroll.tasks.records`; this module checks them.

Loading is blocking work: async callers run it in a worker thread
(``anyio.to_thread.run_sync``) with :class:`TaskLimits` checked before the
work they bound (file size, task count, verifier size). Each distinct
verifier is compiled once per load (by its sha256), and tasks sharing one
share one string, so 100k tasks over a few verifiers load in seconds.
"""

from __future__ import annotations

import difflib
import hashlib
import inspect
import json
import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from fleetroll.errors import TaskFileError
from fleetroll.tasks.mcp import McpEnvironment, McpVerifier, parse_mcp
from fleetroll.tasks.records import Where, read_records, too_big, too_many
from fleetroll.tasks.rewards import RewardSpec, parse_rewards

__all__ = [
    "FLEET_IGNORED_FIELDS",
    "McpEnvironment",
    "McpVerifier",
    "RewardSpec",
    "SolutionStep",
    "TaskLimits",
    "TaskSpec",
    "load_task_paths",
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
        "requires_final_answer", "metadata", "environment", "verifier",
        "verifier_code", "ttl_seconds", "rewards", "seed", "timestamp",
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
    #: An ``mcp`` task's environment and verifier (then ``env_key`` is its name, or "mcp").
    environment: McpEnvironment | None = None
    verifier: McpVerifier | None = None
    #: The instance's lifetime on Fleet; None: the modality's ``ttl_s``.
    ttl_seconds: int | None = Field(default=None, ge=1)
    #: Composite rewards: the components whose weighted sum is the reward
    #: (:mod:`fleetroll.tasks.rewards`); None: the verifier's reward, as it is.
    rewards: tuple[RewardSpec, ...] | None = None
    #: The seed and the point in time (Unix seconds) every reset of the task's
    #: instance asks for (Fleet's ``reset(seed, timestamp)``); None: the platform's.
    seed: int | None = Field(default=None, ge=0)
    timestamp: int | None = Field(default=None, ge=0)

    @property
    def judged(self) -> bool:
        """Whether a component of ``rewards`` is a judge (needs ``judge.base_url``)."""
        return self.rewards is not None and any(r.kind == "judge" for r in self.rewards)

    @property
    def runs_verifier(self) -> bool:
        """Whether scoring runs the verifier: always, unless ``rewards`` names none."""
        return self.rewards is None or any(r.kind == "verifier" for r in self.rewards)

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

    def with_placeholders(self, values: Mapping[str, str]) -> TaskSpec:
        """This task with each placeholder of ``values`` (``{"{workdir}": "/tmp/..."}``)
        replaced in the strings of its ``solution`` arguments, at any depth.

        The task itself when there is nothing to replace (a Fleet instance has no
        placeholders; the one task object serves every sample).
        """
        if not values or not self.solution:
            return self

        def fill(value: Any) -> Any:
            if isinstance(value, str):
                for placeholder, replacement in values.items():
                    value = value.replace(placeholder, replacement)
                return value
            if isinstance(value, Mapping):
                return {k: fill(v) for k, v in value.items()}
            if isinstance(value, list | tuple):
                return [fill(v) for v in value]
            return value

        solution = tuple(
            step.model_copy(update={"arguments": fill(step.arguments)}) for step in self.solution
        )
        return self if solution == self.solution else self.model_copy(update={"solution": solution})


@dataclass(frozen=True, slots=True)
class TaskLimits:
    """Limits on loading tasks, each checked before the work it bounds (None: no limit).

    Attributes:
        max_file_bytes: a task file's size (a folder's task files together),
            checked with ``stat`` before reading and again while reading.
        max_tasks: tasks in all; reading stops at the first one over.
        max_verifier_bytes: one ``verifier_func``'s UTF-8 size, checked before
            it is compiled.
    """

    max_file_bytes: int | None = None
    max_tasks: int | None = None
    max_verifier_bytes: int | None = None


_NO_LIMITS: Final = TaskLimits()
_log = logging.getLogger("fleetroll.tasks")


def load_task_paths(
    paths: Sequence[str | Path], modalities: Collection[str], limits: TaskLimits = _NO_LIMITS
) -> list[TaskSpec]:
    """Tasks from files and folders (a folder means its ``*.jsonl`` and ``*.json``).

    Blocking: async code calls it through ``anyio.to_thread.run_sync``.

    Raises:
        TaskFileError: a file is invalid or over a limit, a folder holds no
            task file, or a key appears twice (in one file or in two).
    """
    files = task_files(paths)
    if limits.max_file_bytes is not None:
        total = 0
        for file in files:
            total += _size(file)
            if total > limits.max_file_bytes:
                reason = too_big("the task files hold", total, limits.max_file_bytes)
                raise TaskFileError(reason, path=str(file))
    tasks: list[TaskSpec] = []
    seen: dict[str, Path] = {}
    verifiers = _Verifiers(limits.max_verifier_bytes)
    for file in files:
        left = None if limits.max_tasks is None else limits.max_tasks - len(tasks)
        remaining = TaskLimits(limits.max_file_bytes, left, limits.max_verifier_bytes)
        for task in _load(file, modalities, remaining, verifiers):
            if task.key in seen:
                raise TaskFileError(
                    f"duplicate key {task.key!r}, also in {seen[task.key]}",
                    path=str(file),
                    field="key",
                )
            seen[task.key] = file
            tasks.append(task)
    if not tasks:
        raise TaskFileError("no tasks", path=", ".join(str(p) for p in paths))
    return tasks


def task_files(paths: Iterable[str | Path]) -> list[Path]:
    """The task files ``paths`` name: files as given, folders' ``*.jsonl``/``*.json`` sorted.

    A folder is read one level deep: its subfolders are not (so a folder of
    tasks can keep others apart below it). Subfolders holding task files are
    named in one warning (logger ``fleetroll.tasks``), so they are not
    skipped unknowingly; name them to load them too.

    Raises:
        TaskFileError: a folder holds no task file, or cannot be listed.
    """
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        if not path.is_dir():
            files.append(path)
            continue
        try:
            entries = sorted(path.iterdir())
            found = [p for p in entries if _is_task_file(p)]
            skipped = [p.name for p in entries if p.is_dir() and _holds_task_files(p)]
        except OSError as exc:
            reason = f"cannot list the folder: {exc.strerror or exc}"
            raise TaskFileError(reason, path=str(path)) from None
        below = (
            f"not reading the task files in its subfolder(s) {', '.join(skipped)}: folders"
            " are read one level deep; name a subfolder to load it too"
        )
        if not found:
            reason = "no .jsonl or .json task file in this folder"
            raise TaskFileError(f"{reason}; {below}" if skipped else reason, path=str(path))
        if skipped:
            _log.warning("%s: %s", path, below)
        files += found
    return files


def _is_task_file(path: Path) -> bool:
    return path.suffix in (".jsonl", ".json") and not path.is_dir()


def _holds_task_files(folder: Path) -> bool:
    """Whether ``folder`` holds a task file (an unreadable one is not worth a warning)."""
    try:
        return any(_is_task_file(p) for p in folder.iterdir())
    except OSError:
        return False


def load_tasks(
    path: str | Path, *, modalities: Collection[str], limits: TaskLimits = _NO_LIMITS
) -> list[TaskSpec]:
    """Read and validate every task of a file (or a folder's), before anything runs.

    The file holds JSON Lines (one task per line, blank lines skipped) or a JSON
    array, recognised by its first non-blank character ``[`` whatever the
    extension. For an array, errors give the line the item starts on and say
    which item it is. A folder means its ``*.jsonl`` and ``*.json`` files, as
    ``fleetroll run`` and ``tasks_file`` read one (:func:`load_task_paths`).
    Blocking: async code calls it in a worker thread.

    Args:
        path: the task file, or a folder of them.
        modalities: the modality names routed here (``Settings.modalities``' keys).
        limits: sizes and counts refused before the work (default: none).

    Raises:
        TaskFileError: the file cannot be read, is over a limit, is not valid
            JSON, holds no tasks, holds an invalid task, or uses one key twice;
            a folder holds no task file.
    """
    if Path(path).is_dir():
        return load_task_paths([path], modalities, limits)
    return list(_load(Path(path), modalities, limits, _Verifiers(limits.max_verifier_bytes)))


def parse_tasks(
    records: Sequence[Mapping[str, Any]],
    *,
    source: str,
    modalities: Collection[str],
    limits: TaskLimits = _NO_LIMITS,
) -> list[TaskSpec]:
    """Validate in-memory task records (e.g. a request body) as :func:`load_tasks` does.

    Blocking for large lists (each verifier is compiled): async code calls it
    in a worker thread.

    Args:
        records: task objects, in either format.
        source: what to call the records in errors (e.g. ``"request body"``).
        modalities: the modality names this deployment routes.
        limits: ``max_tasks`` and ``max_verifier_bytes`` apply.

    Raises:
        TaskFileError: there are no records or too many, one is invalid (the
            message says which, e.g. "the 3rd task in the list"), or two share a key.
    """
    if limits.max_tasks is not None and len(records) > limits.max_tasks:
        raise TaskFileError(too_many(limits.max_tasks), path=source)
    entries = ((rec, Where(source, nth=i, container="list")) for i, rec in enumerate(records, 1))
    verifiers = _Verifiers(limits.max_verifier_bytes)
    return list(_parse_all(entries, source, modalities, verifiers))


def parse_task(
    record: Mapping[str, Any],
    *,
    source: str,
    line: int | None = None,
    modalities: Collection[str],
    max_verifier_bytes: int | None = None,
) -> TaskSpec:
    """Validate one task record, in Fleet's export format or the short form.

    Args:
        record: the decoded JSON object.
        source: the file (or other origin) to name in errors.
        line: the record's 1-based line in ``source``, if it has one.
        modalities: the modality names this deployment routes.
        max_verifier_bytes: the largest ``verifier_func`` accepted (UTF-8 bytes).

    Raises:
        TaskFileError: a field is missing, unknown, of the wrong type or at odds
            with another, the modality is unknown, or ``verifier_func`` is too
            large or not Python defining a top-level function.
    """
    return _parse(record, Where(source, line=line), modalities, _Verifiers(max_verifier_bytes))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as exc:
        reason = f"cannot read the file: {exc.strerror or exc}"
        raise TaskFileError(reason, path=str(path)) from None


def _load(
    path: Path, modalities: Collection[str], limits: TaskLimits, verifiers: _Verifiers
) -> Iterator[TaskSpec]:
    source = str(path)
    try:
        with open(path, "rb") as f:
            records = read_records(
                f, source, max_bytes=limits.max_file_bytes, max_tasks=limits.max_tasks
            )
            yield from _parse_all(records, source, modalities, verifiers)
    except OSError as exc:
        raise TaskFileError(f"cannot read the file: {exc.strerror or exc}", path=source) from None


class _Verifiers:
    """Checks verifiers, compiling each distinct source once (keyed by its sha256).

    Tasks sharing a verifier get one shared string. ``compile`` to bytecode,
    not ``ast.parse``: it builds no Python AST objects, whose constructor keeps
    per-interpreter state that two threads parsing at once can corrupt on
    CPython 3.11 ("AST constructor recursion depth mismatch"), so this can
    run in a worker thread while the event loop's thread parses.
    """

    def __init__(self, max_bytes: int | None) -> None:
        self.max_bytes = max_bytes
        self._seen: dict[bytes, str] = {}  # digest → the source, or "\0" + why not
        self.compiled = 0

    def check(self, code: str, where: Where) -> str:
        data = code.encode("utf-8", "surrogatepass")
        if self.max_bytes is not None and len(data) > self.max_bytes:
            raise where.error(too_big("is", len(data), self.max_bytes), "verifier_func")
        digest = hashlib.sha256(data).digest()
        known = self._seen.get(digest)
        if known is None:
            self.compiled += 1
            known = self._seen[digest] = _compile_check(code)
        if known.startswith("\0"):
            raise where.error(known[1:], "verifier_func")
        return known


def _compile_check(code: str) -> str:
    """``code`` if it is Python defining a top-level function, else ``"\\0"`` + why not."""
    try:
        module = compile(code, "<verifier_func>", "exec", dont_inherit=True)
    except SyntaxError as exc:
        at = f" at line {exc.lineno} of the verifier" if exc.lineno else ""
        text = f": {exc.text.strip()[:80]!r}" if exc.text and exc.text.strip() else ""
        return f"\0is not valid Python: {exc.msg}{at}{text}"
    except (MemoryError, RecursionError):  # the parser's limit on nesting (e.g. "-" * 10_000)
        return "\0is not valid Python: nested too deeply for Python's parser"
    except (ValueError, UnicodeError) as exc:  # null bytes, lone surrogates
        return f"\0is not valid Python: {str(exc)[:200]}"
    if not any(_is_function(const) for const in module.co_consts):
        example = "def verify(env, final_answer=None): ..."
        return f"\0defines no top-level function (e.g. {example!r})"
    return code


def _is_function(const: object) -> bool:
    """A function's code (not a class body, a lambda or a comprehension)."""
    return (
        inspect.iscode(const)
        and bool(const.co_flags & inspect.CO_OPTIMIZED)
        and not const.co_name.startswith("<")
    )


def _parse_all(
    entries: Iterable[tuple[object, Where]],
    source: str,
    modalities: Collection[str],
    verifiers: _Verifiers,
) -> Iterator[TaskSpec]:
    first_use: dict[str, Where] = {}
    for record, where in entries:
        task = _parse(record, where, modalities, verifiers)
        first = first_use.setdefault(task.key, where)
        if first is not where:
            at = f"on line {first.line}" if first.line is not None else f"by {first.ordinal}"
            raise where.error(f"duplicate key {task.key!r}, first used {at}", "key")
        yield task
    if not first_use:
        raise TaskFileError("no tasks", path=source)


def _parse(
    record: object, where: Where, modalities: Collection[str], verifiers: _Verifiers
) -> TaskSpec:
    if not isinstance(record, Mapping):
        raise where.error(f"each task must be a JSON object, got {_describe(record)}")
    unknown = sorted(set(record) - _KNOWN_FIELDS - FLEET_IGNORED_FIELDS)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(_KNOWN_FIELDS), n=1, cutoff=0.7)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise where.error(f"unknown field {unknown[0]!r}{hint}", unknown[0])
    metadata = _object(record.get("metadata"), "metadata", where) or {}
    env_key, env_version = _spec(record, ("env_id", "env_key"), "version", where)
    rewards = parse_rewards(record.get("rewards"), where)
    # A task whose rewards name no verifier component does not need a verifier.
    needs_verifier = rewards is None or any(r.kind == "verifier" for r in rewards)
    mcp = parse_mcp(record, where, fleet_env=env_key is not None, needs_verifier=needs_verifier)
    if mcp is not None:
        env_key = mcp[0].name or "mcp"
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
    ttl = record.get("ttl_seconds")
    if ttl is not None and (type(ttl) is not int or ttl < 1):
        raise where.error(f"must be a whole number ≥ 1, got {_describe(ttl)}", "ttl_seconds")
    # Fleet's exports carry them in metadata; the short form at the top level.
    seed = _agreed(
        {"seed": record.get("seed"), "metadata.seed": metadata.get("seed")}, where, _whole
    )
    timestamp = _agreed(
        {"timestamp": record.get("timestamp"), "metadata.timestamp": metadata.get("timestamp")},
        where,
        _whole,
    )
    if mcp is not None and (seed is not None or timestamp is not None):
        given = "seed" if seed is not None else "timestamp"
        at = given if record.get(given) is not None else f"metadata.{given}"
        reason = "is sent with a Fleet instance's reset; a task with an 'environment' has none"
        raise where.error(reason, at)
    verifier = record.get("verifier_func")
    if verifier is not None and record.get("verifier_code") is not None:
        raise where.error("give 'verifier_func' or 'verifier_code', not both", "verifier_code")
    verifier = record.get("verifier_code") if verifier is None else verifier  # Fleet: both
    if verifier is not None:
        verifier = verifiers.check(_string(verifier, "verifier_func", where), where)
    key = _string(record.get("key", _MISSING), "key", where)
    prompt = _string(record.get("prompt", _MISSING), "prompt", where)
    if verifier is None and mcp is None and needs_verifier:
        # Every rollout of it would end verifier_error: say so once, before anything runs.
        example = 'e.g. "def verify(env, final_answer=None): ..."'
        raise where.error(f"missing required field 'verifier_func' ({example})", "verifier_func")
    # Every field is checked above: construct without validating it all again.
    return TaskSpec.model_construct(
        key=key,
        prompt=prompt,
        env_key=env_key,
        env_version=env_version,
        data_key=data_key,
        data_version=data_version,
        modality=modality,
        verifier_func=verifier,
        max_steps=max_steps,
        env_variables=_object(record.get("env_variables"), "env_variables", where),
        solution=_solution(record.get("solution"), where),
        requires_final_answer=_agreed(final_answer, where, _boolean) or False,
        metadata=metadata,
        environment=None if mcp is None else mcp[0],
        verifier=None if mcp is None else mcp[1],
        ttl_seconds=ttl,
        rewards=rewards,
        seed=seed,
        timestamp=timestamp,
    )


def _spec(
    record: Mapping[str, Any], names: tuple[str, str], version_field: str, where: Where
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
    named: Mapping[str, object], where: Where, check: Callable[[object, str, Where], _T]
) -> _T | None:
    """The one value given under several names; they must agree when several are."""
    given = [(n, check(v, n, where)) for n, v in named.items() if v is not None]
    for name, value in given[1:]:
        if value != given[0][1]:
            first, first_value = given[0]
            reason = f"is {json.dumps(value)} but {first!r} is {json.dumps(first_value)}"
            raise where.error(reason, name)
    return given[0][1] if given else None


def _string(value: object, field: str, where: Where) -> str:
    if value is _MISSING:
        raise where.error(f"missing required field {field.rpartition('.')[2]!r}", field)
    if not isinstance(value, str) or not value.strip():
        raise where.error(f"must be a non-empty string, got {_describe(value)}", field)
    return value


def _boolean(value: object, field: str, where: Where) -> bool:
    if not isinstance(value, bool):
        raise where.error(f"must be true or false, got {_describe(value)}", field)
    return value


def _whole(value: object, field: str, where: Where) -> int:
    if type(value) is not int or value < 0:
        what = "of seconds since 1970 (Unix time)" if field.endswith("timestamp") else "≥ 0"
        raise where.error(f"must be a whole number {what}, got {_describe(value)}", field)
    return value


def _object(value: object, field: str, where: Where) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, Mapping):
        raise where.error(f"must be a JSON object, got {_describe(value)}", field)
    return None if value is None else dict(value)


def _solution(value: object, where: Where) -> tuple[SolutionStep, ...] | None:
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
        steps.append(SolutionStep.model_construct(name=name, arguments=arguments))
    return tuple(steps)


def _describe(value: object) -> str:
    """A JSON value as a person would name it in an error message."""
    if isinstance(value, str):
        return f"the string {value[:40]!r}" if value.strip() else "an empty string"
    if isinstance(value, Mapping):
        return "an object"
    return "a list" if isinstance(value, list | tuple) else json.dumps(value, default=repr)

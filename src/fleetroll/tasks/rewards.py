"""The task form of composite rewards: ``rewards`` (docs/tasks.md, "Composite rewards").

A task may declare its reward as a weighted sum of named components::

    "rewards": [
      {"name": "solved", "kind": "verifier", "weight": 0.7},
      {"name": "clear", "kind": "judge", "weight": 0.2,
       "rubric": "Does the answer explain each step?"},
      {"name": "format", "kind": "regex", "weight": 0.1, "pattern": "^ANSWER: "}
    ]

Kinds: ``verifier`` (the task's own verifier), ``judge`` (a rubric scored by a
model, :mod:`fleetroll.scoring.judge`), and checks computed here from the
rollout alone: ``regex``, ``contains``, ``json_schema``, ``max_turns``.
:func:`parse_rewards` checks a record's ``rewards`` field, raising the
loader's :class:`~fleetroll.errors.TaskFileError` naming the field
(``rewards.1.pattern``). Pure: nothing runs here (a pattern is compiled, a
schema checked against its metaschema).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Final, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field

from fleetroll.tasks.records import Where

__all__ = [
    "CHECK_KINDS",
    "KINDS",
    "RewardSpec",
    "Target",
    "parse_rewards",
]

#: What a check or a judge reads: the agent's submitted answer, its last
#: assistant message's text, or the whole transcript rendered as text.
Target = Literal["final_answer", "last_message", "transcript"]
_TARGETS: Final = ("final_answer", "last_message", "transcript")
#: Components computed from the stored rollout alone (``fleetroll rescore`` redoes them).
CHECK_KINDS: Final = ("regex", "contains", "json_schema", "max_turns")
KINDS: Final = ("verifier", "judge", *CHECK_KINDS)
#: Names become keys of the result's ``rewards`` and words of error messages.
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: The fields each kind takes beside ``name``, ``kind`` and ``weight``.
_FIELDS: Final[Mapping[str, frozenset[str]]] = {
    "verifier": frozenset(),
    "judge": frozenset({"rubric", "on"}),
    "regex": frozenset({"pattern", "on", "ignore_case"}),
    "contains": frozenset({"text", "on", "ignore_case"}),
    "json_schema": frozenset({"schema", "on"}),
    "max_turns": frozenset({"max"}),
}
#: Judges read the whole conversation unless told otherwise; checks the answer.
_DEFAULT_TARGET: Final[Mapping[str, Target]] = {"judge": "transcript"}


class RewardSpec(BaseModel):
    """One component of a task's reward, checked (use :func:`parse_rewards`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    kind: Literal["verifier", "judge", "regex", "contains", "json_schema", "max_turns"]
    #: Its weight in the sum (not normalised: the reward is Σ weight × value).
    weight: float = 1.0
    #: What a judge or a check reads.
    on: Target = "final_answer"
    #: judge: the rubric the model scores against.
    rubric: str | None = None
    #: regex: searched for (``re.search``); contains: looked for.
    pattern: str | None = None
    text: str | None = None
    ignore_case: bool = False
    #: json_schema: the JSON Schema the text, parsed as JSON, must satisfy.
    json_schema: dict[str, Any] | None = Field(default=None)
    #: max_turns: the most steps (tool-calling turns) that still score 1.
    max: int | None = None

    @property
    def is_check(self) -> bool:
        """Computed from the rollout alone, without a model or the environment."""
        return self.kind in CHECK_KINDS


def parse_rewards(value: object, where: Where) -> tuple[RewardSpec, ...] | None:
    """A record's ``rewards`` (None when it has none), every component checked.

    Raises:
        TaskFileError: not a non-empty list of objects, a component with an
            unknown kind or field, a missing or invalid field (name, weight,
            rubric, pattern, schema...), two components with one name, or more
            than one ``verifier`` component.
    """
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        shape = '{"name": ..., "kind": ..., "weight": ...}'
        raise where.error(f"must be a non-empty list of {shape}", "rewards")
    specs: list[RewardSpec] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(value):
        spec = _component(item, f"rewards.{i}", where)
        if spec.name in seen:
            reason = f"duplicate name {spec.name!r}, also rewards.{seen[spec.name]}"
            raise where.error(reason, f"rewards.{i}.name")
        seen[spec.name] = i
        specs.append(spec)
    verifiers = [i for i, s in enumerate(specs) if s.kind == "verifier"]
    if len(verifiers) > 1:
        reason = "a task has one verifier: give at most one component of kind 'verifier'"
        raise where.error(reason, f"rewards.{verifiers[1]}.kind")
    return tuple(specs)


def _component(item: object, field: str, where: Where) -> RewardSpec:
    if not isinstance(item, Mapping):
        raise where.error("must be an object with 'name', 'kind' and 'weight'", field)
    kind = item.get("kind")
    if kind not in KINDS:
        got = "missing" if kind is None else f"unknown kind {kind!r}"
        raise where.error(f"{got} (kinds: {', '.join(KINDS)})", f"{field}.kind")
    allowed = {"name", "kind", "weight"} | _FIELDS[kind]
    extra = sorted(set(item) - allowed)
    if extra:
        takes = ", ".join(sorted(_FIELDS[kind])) or "only name, kind and weight"
        reason = f"unknown field {extra[0]!r} for kind {kind!r} (it takes: {takes})"
        raise where.error(reason, f"{field}.{extra[0]}")
    name = item.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        reason = f"must be 1-64 letters, digits, '_', '.' or '-', got {name!r}"
        raise where.error(reason, f"{field}.name")
    weight = item.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
        raise where.error(f"must be a finite number, got {weight!r}", f"{field}.weight")
    on = item.get("on", _DEFAULT_TARGET.get(kind, "final_answer"))
    if on not in _TARGETS:
        raise where.error(f"must be one of {', '.join(_TARGETS)}, got {on!r}", f"{field}.on")
    fields: dict[str, Any] = {"name": name, "kind": kind, "weight": float(weight), "on": on}
    if kind == "judge":
        fields["rubric"] = _text(item.get("rubric"), f"{field}.rubric", where)
    elif kind == "regex":
        fields["pattern"] = _pattern(item.get("pattern"), f"{field}.pattern", where)
    elif kind == "contains":
        fields["text"] = _text(item.get("text"), f"{field}.text", where)
    elif kind == "json_schema":
        fields["json_schema"] = _schema(item.get("schema"), f"{field}.schema", where)
    elif kind == "max_turns":
        limit = item.get("max")
        if type(limit) is not int or limit < 0:
            raise where.error(f"must be a whole number ≥ 0, got {limit!r}", f"{field}.max")
        fields["max"] = limit
    if kind in ("regex", "contains"):
        ignore_case = item.get("ignore_case", False)
        if not isinstance(ignore_case, bool):
            reason = f"must be true or false, got {ignore_case!r}"
            raise where.error(reason, f"{field}.ignore_case")
        fields["ignore_case"] = ignore_case
        if kind == "regex":  # compiled once more with the flag: it must still compile
            _pattern(fields["pattern"], f"{field}.pattern", where, ignore_case=ignore_case)
    return RewardSpec.model_construct(**fields)


def _text(value: object, field: str, where: Where) -> str:
    if value is None:
        raise where.error(f"missing required field {field.rpartition('.')[2]!r}", field)
    if not isinstance(value, str) or not value.strip():
        raise where.error(f"must be a non-empty string, got {value!r}"[:200], field)
    return value


def _pattern(value: object, field: str, where: Where, *, ignore_case: bool = False) -> str:
    text = _text(value, field, where)
    try:
        re.compile(text, re.IGNORECASE if ignore_case else 0)
    except re.error as exc:
        raise where.error(f"is not a valid regular expression: {exc}", field) from None
    return text


def _schema(value: object, field: str, where: Where) -> dict[str, Any]:
    if value is None:
        raise where.error("missing required field 'schema'", field)
    if not isinstance(value, Mapping):
        raise where.error("must be a JSON Schema (an object)", field)
    schema = dict(value)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        at = "/".join(str(p) for p in exc.path)
        raise where.error(
            f"is not a valid JSON Schema{' at ' + at if at else ''}: {exc.message}"[:300], field
        ) from None
    return schema

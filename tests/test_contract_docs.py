"""The contracts in docs/ say what the code does: names are compared, not trusted.

Each documented name is the first cell of a markdown table row, in
backticks, under a heading of its page (``| `init_error` | ... |``). Fast:
no emulator, no network.
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import pytest
from pydantic import AliasChoices, BaseModel

from fleetroll.results import (
    SCORED_REASONS,
    Cost,
    FailureReason,
    RolloutResult,
    Timings,
    Trajectory,
    Turn,
    VerifierOutcome,
)
from fleetroll.service.mcp_tools import build_mcp_server
from fleetroll.service.openapi import openapi_document
from fleetroll.settings import Settings
from fleetroll.tasks import _KNOWN_FIELDS, FLEET_IGNORED_FIELDS
from fleetroll.telemetry.events import BASE_ATTRIBUTES, EVENT_NAMES, Events, MemorySink
from fleetroll.telemetry.sinks import CONSOLE_LEVELS
from fleetroll.telemetry.store import COLUMNS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
_HEADING = re.compile(r"^(#+)\s+(.*?)\s*$")
_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|(.*)$")
#: ``.emit("name"`` or ``.emit(\n    "name"`` anywhere in the source.
_EMIT = re.compile(r"\.emit\(\s*(?:name\s*=\s*)?[\"']([^\"']+)[\"']")


def rows(page: str) -> dict[str, list[tuple[str, str]]]:
    """Per heading (its text), the (name, rest of the row) of every table row naming something."""
    found: dict[str, list[tuple[str, str]]] = {}
    heading = ""
    fenced = False
    for line in (DOCS / page).read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if match := _HEADING.match(line):
            heading = match.group(2)
            continue
        if match := _ROW.match(line):
            found.setdefault(heading, []).append((match.group(1), match.group(2)))
    return found


def names(page: str, heading: str) -> set[str]:
    """The names documented under the one heading of ``page`` that is (or contains) ``heading``."""
    tables = rows(page)
    matches = [h for h in tables if h == heading] or [h for h in tables if heading in h]
    assert len(matches) == 1, f"{page}: expected one table section {heading!r}, found {matches}"
    return {name for name, _ in tables[matches[0]]}


# -- tasks.md -------------------------------------------------------------------------


def test_every_task_field_read_or_ignored_is_documented_and_nothing_else() -> None:
    assert names("tasks.md", "Fields") == _KNOWN_FIELDS | FLEET_IGNORED_FIELDS


# -- results.md -------------------------------------------------------------------


def test_the_documented_failure_reasons_are_the_code_s() -> None:
    assert names("results.md", "Failure reasons") == {r.value for r in FailureReason}


def test_the_reasons_documented_as_rewarded_are_the_scored_reasons() -> None:
    (section,) = [v for h, v in rows("results.md").items() if h == "Failure reasons"]
    rewarded = {name for name, rest in section if "from the verifier" in rest}
    assert rewarded == {r.value for r in SCORED_REASONS}


def test_every_field_of_a_result_is_documented_and_nothing_else() -> None:
    expected = (
        set(RolloutResult.model_fields)
        | {f"timings.{name}" for name in Timings.model_fields}
        | {f"verifier.{name}" for name in VerifierOutcome.model_fields}
        | {f"turns.{name}" for name in Turn.model_fields}
        | {f"cost.{name}" for name in Cost.model_fields}
        | {f"trajectory.{name}" for name in Trajectory.model_fields}
    )
    assert names("results.md", "Fields") == expected


# -- telemetry.md -----------------------------------------------------------------


def test_the_documented_events_are_the_registered_ones() -> None:
    assert names("telemetry.md", "Events") == EVENT_NAMES


def test_every_event_named_in_src_is_registered_and_every_registered_one_is_emitted() -> None:
    emitted: dict[str, list[str]] = {}
    for path in sorted((ROOT / "src" / "fleetroll").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for match in _EMIT.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            where = f"{path.relative_to(ROOT)}:{line}"
            emitted.setdefault(match.group(1), []).append(where)
    unregistered = {name: where for name, where in emitted.items() if name not in EVENT_NAMES}
    assert unregistered == {}
    assert set(emitted) == EVENT_NAMES, (
        f"registered but never emitted: {EVENT_NAMES - set(emitted)}"
    )


def test_emit_refuses_a_name_that_is_not_registered() -> None:
    sink = MemorySink()
    events = Events([sink])
    with pytest.raises(ValueError, match="'fleet_rollout_complete'"):
        events.emit("fleet_rollout_complete", status="completed")
    assert sink.events == []
    events.emit("fleet_rollout_completed", status="completed")
    assert [e.name for e in sink.events] == ["fleet_rollout_completed"]


def test_console_levels_name_only_registered_events() -> None:
    assert set(CONSOLE_LEVELS) <= EVENT_NAMES


def test_the_documented_base_attributes_are_the_bound_ones() -> None:
    assert names("telemetry.md", "Base attributes") == set(BASE_ATTRIBUTES)


def test_the_documented_store_columns_are_the_store_s() -> None:
    assert names("telemetry.md", "The local store") == set(COLUMNS)


# -- http-api.md ----------------------------------------------------------------------


def _documents() -> list[dict[str, Any]]:
    return [openapi_document(version="0", token_required=t) for t in (False, True)]


def test_every_route_of_the_service_is_documented() -> None:
    text = (DOCS / "http-api.md").read_text(encoding="utf-8")
    routes = {
        (method.upper(), path)
        for path, item in _documents()[0]["paths"].items()
        for method in item
        if method != "parameters"
    } | {("GET", "/dashboard"), ("GET", "/dashboard/data")}
    missing = [
        f"{method} {path}"
        for method, path in sorted(routes)
        if not re.search(rf"`{method} {re.escape(path)}(\?[^`]*)?`", text)
    ]
    assert missing == []
    assert "`/mcp`" in text


def test_every_status_the_service_answers_is_documented() -> None:
    answered = {
        status
        for document in _documents()
        for item in document["paths"].values()
        for method, operation in item.items()
        if method != "parameters"
        for status in operation["responses"]
    }
    assert {"401", "404", "409", "413", "421", "422", "503"} <= answered
    assert answered - {"200", "201", "202"} <= names("http-api.md", "Errors")


def test_the_serve_synopsis_names_every_option_of_serve_and_nothing_else() -> None:
    from fleetroll.cli.serve import serve

    text = (DOCS / "http-api.md").read_text(encoding="utf-8")
    synopsis = text.split("```text\nfleetroll serve ", 1)[1].split("```", 1)[0]
    options = {o for p in serve.params for o in p.opts if o.startswith("--") and o != "--help"}
    assert set(re.findall(r"--[a-z][a-z-]*", synopsis)) == options


async def test_the_documented_mcp_tools_are_the_server_s() -> None:
    server = build_mcp_server(None)  # type: ignore[arg-type]  # listing touches no service
    tools = {tool.name for tool in await server.list_tools()}
    assert names("http-api.md", "MCP tools") == tools


# -- configuration.md ---------------------------------------------------------------


def _unwrap(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        options = [a for a in get_args(annotation) if a is not type(None)]
        if len(options) == 1:
            return options[0]
    return annotation


def _model(annotation: Any) -> type[BaseModel] | None:
    inner = _unwrap(annotation)
    return inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None


def _table_of_models(annotation: Any) -> type[BaseModel] | None:
    """``Model`` of ``dict[str, Model]``."""
    inner = _unwrap(annotation)
    if get_origin(inner) is dict:
        return _model(get_args(inner)[1])
    return None


def sections() -> Iterator[tuple[str, type[BaseModel]]]:
    """Every ``[section]`` of the settings with its model; tables of models as ``[x.NAME]``."""

    def below(prefix: str, model: type[BaseModel]) -> Iterator[tuple[str, type[BaseModel]]]:
        yield prefix, model
        for name, info in model.model_fields.items():
            rows_model = _table_of_models(info.annotation)
            if rows_model is not None:
                yield from below(f"{prefix}.{name}.NAME", rows_model)

    for name, info in Settings.model_fields.items():
        section = _model(info.annotation)
        if section is not None:
            yield from below(name, section)
        elif (table := _table_of_models(info.annotation)) is not None:
            yield from below(f"{name}.NAME", table)


def test_every_setting_is_documented_in_its_section_and_nothing_else() -> None:
    documented: dict[str, set[str]] = {}
    for heading, entries in rows("configuration.md").items():
        match = re.search(r"`\[([A-Za-z_.]+)\]`", heading)
        if match:
            documented[match.group(1)] = {name for name, _ in entries}
    expected = {path: set(model.model_fields) for path, model in sections()}
    assert {"timeouts", "pool", "modalities.NAME", "emulator.profiles.NAME"} <= set(expected)
    assert documented == expected


def test_every_environment_only_setting_is_documented_by_its_variable() -> None:
    variables = set()
    for info in Settings.model_fields.values():
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            variables.add(str(alias.choices[0]))
    assert "FLEET_API_KEY" in variables
    assert names("configuration.md", "Secrets and endpoints") == variables


# -- all pages ------------------------------------------------------------------


def test_the_docs_index_lists_every_page_and_every_link_resolves() -> None:
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    assert pages == set(re.findall(r"\]\(([\w-]+\.md)\)", index))
    for doc in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", doc.read_text("utf-8")):
            assert (doc.parent / target).is_file(), f"{doc.name} links to missing {target}"


def test_nothing_cites_the_design_notes_users_cannot_read() -> None:
    cited = []
    paths = [ROOT / "README.md", *(ROOT / "config").rglob("*.toml"), *(ROOT / "src").rglob("*.py")]
    for path in paths:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "DESIGN.md" in line:
                cited.append(f"{path.relative_to(ROOT)}:{number}")
    assert cited == []

"""What the thin MCP client makes of a result: a listing parsed once and shared by
every session that got it, and a tool result validated as the SDK validates it
(the version's surface, the result model, the tool's output schema, with the
SDK's messages), the usual shape of one built without the validations it passes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, cast

from jsonschema import SchemaError
from jsonschema import exceptions as jsonschema_exceptions
from jsonschema.protocols import Validator
from jsonschema.validators import validator_for
from mcp_types import (
    CallToolResult,
    ContentBlock,
    ListToolsResult,
    TextContent,
    Tool,
)
from mcp_types import methods as _methods
from pydantic import TypeAdapter
from referencing import Registry
from referencing.exceptions import Unresolvable

from fleetroll.policies import ToolSpec
from fleetroll.tools.mcp_common import shared_spec, shared_validator

__all__ = [
    "Listing",
    "check_structured",
    "check_surface",
    "clamp_ttl",
    "plain_result",
    "shared_listing",
]

_log = logging.getLogger("fleetroll.mcp_thin")

_ABSENT: Final = object()


def clamp_ttl(raw: dict[str, Any]) -> None:
    """A negative ``ttlMs`` floored to 0 (the SDK's ``_clamp_inbound_ttl``)."""
    ttl = raw.get("ttlMs")
    if isinstance(ttl, int | float) and not isinstance(ttl, bool) and ttl < 0:
        raw["ttlMs"] = 0


# ------------------------------------------------------------------ listings


@dataclass(frozen=True, slots=True)
class Listing:
    """A ``tools/list`` answer, parsed once and shared by every session that got it.

    Rollouts of one environment list the same tools: one parse, one copy of
    each schema and one compiled validator for all of them.
    """

    tools: tuple[Tool, ...]  # without the tools a modern client must drop
    specs: tuple[ToolSpec, ...]
    output_schemas: Mapping[str, dict[str, Any] | None]
    param_headers: Mapping[str, dict[tuple[str, ...], str]]
    #: Each tool's compiled output-schema validator (None: not a schema), once looked up.
    validators: dict[str, Validator | None] = field(default_factory=dict)


_LISTINGS: dict[str, Listing] = {}
_LISTINGS_MAX = 256


def shared_listing(raw: dict[str, Any], version: str) -> Listing:
    """The shared :class:`Listing` of a ``tools/list`` result.

    Raises:
        pydantic.ValidationError: the result is not a listing at ``version``.
    """
    key = json.dumps(raw, sort_keys=True)
    found = _LISTINGS.get(key)
    if found is not None:
        return found
    from mcp.shared.inbound import find_invalid_x_mcp_header, x_mcp_header_map

    clamp_ttl(raw)
    check_surface("tools/list", version, raw)
    result = ListToolsResult.model_validate(raw, by_name=False)
    kept: list[Tool] = []
    headers: dict[str, dict[tuple[str, ...], str]] = {}
    for tool in result.tools:
        reason = find_invalid_x_mcp_header(tool.input_schema)
        if reason is not None:  # 2026-07-28: a client MUST drop it
            _log.warning("dropping tool %r: invalid x-mcp-header (%s)", tool.name, reason)
            continue
        header_map = x_mcp_header_map(tool.input_schema)
        if header_map:
            headers[tool.name] = header_map
        kept.append(tool)
    listing = Listing(
        tools=tuple(kept),
        specs=tuple(shared_spec(t) for t in kept),
        output_schemas={t.name: t.output_schema for t in kept},
        param_headers=headers,
    )
    if len(_LISTINGS) >= _LISTINGS_MAX:
        _LISTINGS.clear()
    _LISTINGS[key] = listing
    return listing


#: The version's wire type of each method's result, as a validator (None: no such pair).
_SURFACES: dict[tuple[str, str], TypeAdapter[Any] | None] = {}


def check_surface(method: str, version: str, raw: dict[str, Any]) -> None:
    """The SDK's ``validate_server_result`` check (the SDK session skips a pair it
    does not know), without the dump of the result it then throws away.

    Raises:
        pydantic.ValidationError: the result is not of the version's shape.
    """
    key = (method, version)
    if key not in _SURFACES:
        target = _methods.SERVER_RESULTS.get(key)
        _SURFACES[key] = None if target is None else TypeAdapter(cast(Any, target))
    adapter = _SURFACES[key]
    if adapter is not None:
        adapter.validate_python(raw, by_name=False)


_PLAIN_KEYS: Final = frozenset({"content", "structuredContent", "isError", "resultType", "_meta"})
_TEXT_KEYS: Final = frozenset({"type", "text"})


def plain_result(raw: dict[str, Any]) -> CallToolResult | None:
    """A tool result of the usual shape, built without the two validations it passes.

    The usual shape: ``resultType: "complete"`` (which the modern surface
    requires), ``content`` (a list of bare text blocks), and at most
    ``structuredContent`` (any JSON value), ``isError`` (a bool) and ``_meta``
    (an object: every surface takes any; the SDK's servers put their
    ``serverInfo`` in every result's) besides.
    Such a result passes the version's surface and the result model as it
    stands, so the model is made from it directly; any other shape (images,
    annotations, a ttl, no ``resultType``...) is None, and is
    validated as the SDK does.
    """
    if not raw.keys() <= _PLAIN_KEYS or raw.get("resultType") != "complete":
        return None
    is_error = raw.get("isError", False)
    content = raw.get("content")
    if type(is_error) is not bool or type(content) is not list:
        return None
    meta = raw.get("_meta", _ABSENT)
    if meta is not _ABSENT and type(meta) is not dict:
        return None
    blocks: list[ContentBlock] = []
    for block in content:
        if (
            type(block) is not dict
            or block.keys() != _TEXT_KEYS
            or block["type"] != "text"
            or type(block["text"]) is not str
        ):
            return None
        blocks.append(TextContent.model_construct(type="text", text=block["text"]))
    fields: dict[str, Any] = {"content": blocks}  # the fields set: those the answer has
    if "structuredContent" in raw:
        fields["structured_content"] = raw["structuredContent"]
    if "isError" in raw:
        fields["is_error"] = is_error
    if meta is not _ABSENT:
        fields["meta"] = meta
    fields["result_type"] = "complete"
    return CallToolResult.model_construct(**fields)


def check_structured(
    name: str,
    schema: dict[str, Any],
    result: CallToolResult,
    validators: dict[str, Validator | None],
) -> None:
    """The SDK's ``validate_tool_result``, with its messages, on a shared validator
    (``validators``: the listing's, looked up once per tool).

    Raises:
        RuntimeError: no structured content, content that breaks the schema,
            or a schema that is not one.
    """
    if result.structured_content is None and "structured_content" not in result.model_fields_set:
        raise RuntimeError(
            f"Tool {name} has an output schema but did not return structured content"
        )
    if name in validators:
        validator = validators[name]
    else:
        validator = validators[name] = shared_validator(schema)
    if validator is None:
        cls = validator_for(schema)
        try:
            cls.check_schema(schema)
        except SchemaError as e:
            raise RuntimeError(f"Invalid schema for tool {name}: {e}") from None
        validator = cast(Validator, cls(schema, registry=Registry()))
    try:
        if validator.is_valid(result.structured_content):
            return  # the usual case, without best_match's walk of the errors
        errors = validator.iter_errors(result.structured_content)
        error = cast("Exception | None", jsonschema_exceptions.best_match(errors))
    except Unresolvable as e:
        raise RuntimeError(f"Invalid schema for tool {name}: {e}") from e
    if error is not None:
        raise RuntimeError(
            f"Invalid structured content returned by tool {name}: {error}"
        ) from error

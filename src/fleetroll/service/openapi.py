"""``GET /openapi.json``: the API described from its route table and its pydantic models.

Every operation comes from one :class:`~fleetroll.service.routes.Endpoint` of
:data:`~fleetroll.service.routes.ROUTES`, the table the ASGI routes are made
of; the schemas come from the models' JSON schemas (requests in validation
mode, responses in serialization mode). So the document cannot drift from what
the routes accept and answer. No example, default or description holds a secret.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from fleetroll.service.models import ErrorBody, ValidationErrorBody
from fleetroll.service.routes import PATH_PARAMETERS, ROUTES, Endpoint

__all__ = ["openapi_document"]

_REF = "#/components/schemas/{model}"


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _content(media: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {media: {"schema": schema}}


def _operation(endpoint: Endpoint, *, token_required: bool) -> dict[str, Any]:
    answer = endpoint.answer
    schema = _ref(answer) if isinstance(answer, type) else dict(answer)
    responses: dict[str, Any] = {
        str(status): {"description": meaning, "content": _content(endpoint.media, schema)}
        for status, meaning in endpoint.answers.items()
    }
    for status, meaning in endpoint.error_statuses(token_required=token_required).items():
        error = ValidationErrorBody if status == 422 else ErrorBody
        content = _content("application/json", _ref(error))
        responses[str(status)] = {"description": meaning, "content": content}
    operation: dict[str, Any] = {"summary": endpoint.summary}
    if endpoint.description is not None:
        operation["description"] = endpoint.description
    operation["operationId"] = endpoint.operation_id
    if not endpoint.auth:
        operation["security"] = []
    if endpoint.query:
        operation["parameters"] = [
            {
                "name": q.name,
                "in": "query",
                "required": False,
                "description": q.description,
                "schema": dict(q.schema),
            }
            for q in endpoint.query
        ]
    if endpoint.body is not None:
        operation["requestBody"] = {
            "required": True,
            "content": _content("application/json", _ref(endpoint.body)),
        }
    operation["responses"] = responses
    return operation


def _paths(*, token_required: bool) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for endpoint in ROUTES:
        item = paths.setdefault(endpoint.path, {})
        names = re.findall(r"{(\w+)}", endpoint.path)
        if names and "parameters" not in item:
            item["parameters"] = [
                {
                    "name": name,
                    "in": "path",
                    "required": True,
                    "description": PATH_PARAMETERS[name],
                    "schema": {"type": "string"},
                }
                for name in names
            ]
        item[endpoint.method.lower()] = _operation(endpoint, token_required=token_required)
    return paths


def _schemas() -> dict[str, Any]:
    models: dict[tuple[type[BaseModel], JsonSchemaMode], None] = {}
    for e in ROUTES:
        if e.body is not None:
            models[e.body, "validation"] = None
    for e in ROUTES:
        if isinstance(e.answer, type):
            models[e.answer, "serialization"] = None
    models |= {(ErrorBody, "serialization"): None, (ValidationErrorBody, "serialization"): None}
    _, top = models_json_schema(list(models), ref_template=_REF)
    return dict(top.get("$defs", {}))


@cache
def openapi_document(*, version: str, token_required: bool) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the service (built once per configuration)."""
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "fleetroll",
            "version": version,
            "description": (
                "Rollout orchestration for RL training on Fleet environments: batches"
                " streamed as NDJSON, env-style sessions, read-only telemetry queries."
                " The same verbs are MCP tools at /mcp (streamable HTTP)."
            ),
        },
        "paths": _paths(token_required=token_required),
        "components": {"schemas": _schemas()},
    }
    if token_required:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"bearer": []}]
    return document

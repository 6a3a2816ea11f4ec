"""``GET /openapi.json``: the API described from the pydantic models themselves.

The schemas come from the models' JSON schemas (requests in validation mode,
responses in serialization mode), so the document cannot drift from what the
routes accept and answer. No example, default or description holds a secret.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from fleetroll.results import RolloutResult
from fleetroll.service.models import (
    BatchCreated,
    BatchRequest,
    BatchState,
    ErrorBody,
    EventStreamLine,
    GroupStreamLine,
    Health,
    Observation,
    PauseLease,
    PauseRequest,
    PolicyState,
    PolicyVersionRequest,
    QueryRequest,
    QueryResult,
    SessionDone,
    SessionOpened,
    SessionRequest,
    StatsResult,
    StepRequest,
    StreamLine,
    ValidationErrorBody,
)

__all__ = ["openapi_document"]

_REQUESTS: tuple[type[BaseModel], ...] = (
    BatchRequest,
    SessionRequest,
    StepRequest,
    QueryRequest,
    PolicyVersionRequest,
    PauseRequest,
)
_RESPONSES: tuple[type[BaseModel], ...] = (
    BatchCreated,
    BatchState,
    StreamLine,
    GroupStreamLine,
    EventStreamLine,
    PolicyState,
    PauseLease,
    SessionOpened,
    Observation,
    SessionDone,
    RolloutResult,
    QueryResult,
    StatsResult,
    Health,
    ErrorBody,
    ValidationErrorBody,
)
_REF = "#/components/schemas/{model}"


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _json(model: type[BaseModel], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(model)}}}


def _error(description: str) -> dict[str, Any]:
    return _json(ErrorBody, description)


_INVALID = _json(ValidationErrorBody, "Invalid request: each problem with its location")
_UNSUPPORTED = _error("The body must be JSON (Content-Type: application/json)")
_TOO_LARGE = _error("The request body is over service.max_body_bytes")


def _body(model: type[BaseModel]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": _ref(model)}}}


def _path_param(name: str, description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "description": description,
        "schema": {"type": "string"},
    }


_BATCH_ID = _path_param("batch_id", "The batch's id")
_SESSION_ID = _path_param("session_id", "The session's id")
_PAUSE_ID = _path_param("pause_id", "The pause's id (from POST /v1/policy/pauses)")
_AFTER = {
    "name": "after",
    "in": "query",
    "required": False,
    "description": "Send only lines with a cursor above this one",
    "schema": {"type": "integer", "minimum": 0, "default": 0},
}


def _paths() -> dict[str, Any]:
    no_batch = _error("No such batch (unknown, or finished long ago and forgotten)")
    no_session = _error("No such session")
    no_pause = _error("No such pause (released, or its lease expired)")
    on_ray = _error("Batches run on Ray actors: no policy version or pause from this process")
    return {
        "/healthz": {
            "get": {
                "summary": "Liveness (needs no token)",
                "operationId": "healthz",
                "security": [],
                "responses": {"200": _json(Health, "The service is up")},
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics (text exposition format)",
                "operationId": "metrics",
                "responses": {
                    "200": {
                        "description": "Rollouts by status, in flight, provisioning latency",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "operationId": "openapi",
                "responses": {
                    "200": {
                        "description": "The OpenAPI document",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    }
                },
            }
        },
        "/v1/batches": {
            "post": {
                "summary": "Start a batch of rollouts (idempotent with batch_id)",
                "operationId": "createBatch",
                "requestBody": _body(BatchRequest),
                "responses": {
                    "201": _json(BatchCreated, "The batch started"),
                    "200": _json(
                        BatchCreated,
                        "An identical request already started it; those of its rollouts"
                        " that ended cancelled run again (`rerun`)",
                    ),
                    "409": _error("The batch_id is taken by a different request"),
                    "413": _TOO_LARGE,
                    "415": _UNSUPPORTED,
                    "422": _json(
                        ValidationErrorBody,
                        "Invalid request: each problem with its location; or the pre-flight"
                        " refused the batch (type preflight_error, nothing provisioned)",
                    ),
                    "503": _error(
                        "The pool is full (pool.max_queued_rollouts), or a cancel of this"
                        " batch is still settling: retry after Retry-After seconds"
                    ),
                },
            }
        },
        "/v1/batches/{batch_id}": {
            "parameters": [_BATCH_ID],
            "get": {
                "summary": "A batch's status and counts",
                "operationId": "getBatch",
                "responses": {"200": _json(BatchState, "The batch"), "404": no_batch},
            },
            "delete": {
                "summary": "Cancel a batch (every result still arrives, cancelled ones too)",
                "operationId": "cancelBatch",
                "responses": {"202": _json(BatchState, "Cancelling"), "404": no_batch},
            },
        },
        "/v1/batches/{batch_id}/results": {
            "parameters": [_BATCH_ID],
            "get": {
                "summary": "The batch's results as NDJSON, streamed as rollouts end",
                "description": (
                    "One JSON object per line (StreamLine): `result` lines carry the n-th"
                    " result with `cursor` n; `heartbeat` lines keep an idle stream alive;"
                    " an `end` line closes a complete stream. A stream that stops without"
                    " an `end` line was cut: reconnect with `?after=<last cursor>` to get"
                    " the rest, nothing lost and nothing twice. An `interrupted` line"
                    " closes the stream of a batch the service stopped while it ran (a"
                    " restart): resubmit the same request to run its rollouts without a"
                    " result, then reconnect with `?after=`."
                ),
                "operationId": "streamResults",
                "parameters": [
                    {
                        "name": "after",
                        "in": "query",
                        "required": False,
                        "description": "Send only results with a cursor above this one",
                        "schema": {"type": "integer", "minimum": 0, "default": 0},
                    }
                ],
                "responses": {
                    "200": {
                        "description": "NDJSON: one StreamLine per line",
                        "content": {"application/x-ndjson": {"schema": _ref(StreamLine)}},
                    },
                    "404": no_batch,
                    "422": _INVALID,
                },
            },
        },
        "/v1/batches/{batch_id}/groups": {
            "parameters": [_BATCH_ID],
            "get": {
                "summary": "The batch's groups as NDJSON, each as soon as it is complete",
                "description": (
                    "One JSON object per line (GroupStreamLine): `group` lines carry the n-th"
                    " complete group (all samples of one task: rewards, mean, std, uniform)"
                    " with `cursor` n, in completion order; `heartbeat`, `end` and"
                    " `interrupted` lines as on the results stream. Reconnect with"
                    " `?after=<last cursor>`."
                ),
                "operationId": "streamGroups",
                "parameters": [_AFTER],
                "responses": {
                    "200": {
                        "description": "NDJSON: one GroupStreamLine per line",
                        "content": {"application/x-ndjson": {"schema": _ref(GroupStreamLine)}},
                    },
                    "404": no_batch,
                    "422": _INVALID,
                },
            },
        },
        "/v1/rollouts/{rollout_id}/events": {
            "parameters": [_path_param("rollout_id", "The rollout's id")],
            "get": {
                "summary": "A rollout's live events as NDJSON: phases, turns, tool calls, the end",
                "description": (
                    "One JSON object per line (EventStreamLine): `event` lines carry the n-th"
                    " event with `cursor` n; the stream ends after the `end` event. A `gap`"
                    " line says events after the cursor are no longer held (pool.events_max)."
                    " Reconnect with `?after=<last cursor>`."
                ),
                "operationId": "streamRolloutEvents",
                "parameters": [_AFTER],
                "responses": {
                    "200": {
                        "description": "NDJSON: one EventStreamLine per line",
                        "content": {"application/x-ndjson": {"schema": _ref(EventStreamLine)}},
                    },
                    "404": _error("No such rollout (unknown, or its batch was forgotten)"),
                    "422": _INVALID,
                    "504": _error("The Ray actor running the rollout did not answer in time"),
                },
            },
        },
        "/v1/policy": {
            "get": {
                "summary": "The policy version recorded on turns, and the pauses held",
                "operationId": "getPolicy",
                "responses": {"200": _json(PolicyState, "The policy"), "409": on_ray},
            }
        },
        "/v1/policy/version": {
            "put": {
                "summary": "Set the policy version (after a weight sync)",
                "operationId": "setPolicyVersion",
                "requestBody": _body(PolicyVersionRequest),
                "responses": {
                    "200": _json(PolicyState, "The policy"),
                    "409": on_ray,
                    "415": _UNSUPPORTED,
                    "422": _INVALID,
                },
            }
        },
        "/v1/policy/pauses": {
            "post": {
                "summary": "Pause new policy calls (tool calls go on) for a lease of ttl_s",
                "description": (
                    "The pause ends after `ttl_s` unless renewed with PUT, or at once with"
                    " DELETE: a trainer that crashed mid weight swap cannot pause forever."
                    " Waiting is charged to no rollout deadline, only to a batch's deadline_s."
                ),
                "operationId": "startPause",
                "requestBody": _body(PauseRequest),
                "responses": {
                    "201": _json(PauseLease, "The pause is held"),
                    "409": on_ray,
                    "415": _UNSUPPORTED,
                    "422": _INVALID,
                },
            }
        },
        "/v1/policy/pauses/{pause_id}": {
            "parameters": [_PAUSE_ID],
            "put": {
                "summary": "Renew a pause: it now ends ttl_s from now",
                "operationId": "renewPause",
                "requestBody": _body(PauseRequest),
                "responses": {
                    "200": _json(PauseLease, "Renewed"),
                    "404": no_pause,
                    "415": _UNSUPPORTED,
                    "422": _INVALID,
                },
            },
            "delete": {
                "summary": "End a pause (policy calls go on when no other is held)",
                "operationId": "endPause",
                "responses": {"200": _json(PolicyState, "The policy"), "404": no_pause},
            },
        },
        "/v1/sessions": {
            "post": {
                "summary": "Open an env-style session on one task (provisions an instance)",
                "operationId": "openSession",
                "requestBody": _body(SessionRequest),
                "responses": {
                    "201": _json(SessionOpened, "The opening messages and the tools"),
                    "413": _TOO_LARGE,
                    "415": _UNSUPPORTED,
                    "422": _INVALID,
                    "502": _error("The environment could not be set up"),
                    "503": _error("No instance in time, or a transient platform failure"),
                },
            }
        },
        "/v1/sessions/{session_id}/step": {
            "parameters": [_SESSION_ID],
            "post": {
                "summary": "Run one tool call in the session",
                "operationId": "stepSession",
                "requestBody": _body(StepRequest),
                "responses": {
                    "200": _json(Observation, "The tool's answer"),
                    "404": no_session,
                    "410": _error("The session has ended: DELETE it for its result"),
                    "413": _TOO_LARGE,
                    "415": _UNSUPPORTED,
                    "422": _INVALID,
                    "502": _error("The instance is gone: the session has ended"),
                    "504": _error("The session did not answer in time"),
                },
            },
        },
        "/v1/sessions/{session_id}/done": {
            "parameters": [_SESSION_ID],
            "post": {
                "summary": "End the episode: the agent finished (the result will be completed,"
                " not abandoned); then DELETE the session for its result",
                "operationId": "endEpisode",
                "responses": {
                    "200": _json(SessionDone, "The episode is over"),
                    "404": no_session,
                    "410": _error("The session has ended: DELETE it for its result"),
                    "504": _error("The session did not answer in time"),
                },
            },
        },
        "/v1/sessions/{session_id}": {
            "parameters": [_SESSION_ID],
            "delete": {
                "summary": "Close the session: score it (if not yet), release it, get its result",
                "operationId": "closeSession",
                "responses": {
                    "200": _json(RolloutResult, "The rollout's result"),
                    "404": no_session,
                    "502": _error("Closing failed"),
                    "504": _error("The session did not answer in time"),
                },
            },
        },
        "/v1/query": {
            "post": {
                "summary": "Run one read-only SQL statement on the local telemetry store",
                "operationId": "query",
                "requestBody": _body(QueryRequest),
                "responses": {
                    "200": _json(QueryResult, "The rows"),
                    "400": _error("Invalid SQL, too slow, or more than one statement"),
                    "403": _error("The statement tries to change something"),
                    "404": _error("No telemetry store yet"),
                    "413": _TOO_LARGE,
                    "415": _UNSUPPORTED,
                    "422": _INVALID,
                },
            }
        },
        "/v1/stats": {
            "get": {
                "summary": "Rollouts per environment from the telemetry store, and its invariant",
                "operationId": "stats",
                "parameters": [
                    {
                        "name": "batch_id",
                        "in": "query",
                        "required": False,
                        "description": "Only this batch's rollouts",
                        "schema": {"type": "string"},
                    }
                ],
                "responses": {
                    "200": _json(StatsResult, "The statistics"),
                    "404": _error("No telemetry store yet, or no such batch"),
                },
            }
        },
    }


@cache
def openapi_document(*, version: str, token_required: bool) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the service (built once per configuration)."""
    models: list[tuple[type[BaseModel], JsonSchemaMode]] = [
        *((m, "validation") for m in _REQUESTS),
        *((m, "serialization") for m in _RESPONSES),
    ]
    _, top = models_json_schema(models, ref_template=_REF)
    paths = _paths()
    common: dict[str, Any] = {"421": _error("The Host header does not name loopback")}
    if token_required:
        common = {"401": _error("Missing or invalid bearer token")}
    for route, item in paths.items():
        for method, operation in item.items():
            if method == "parameters" or route == "/healthz":
                continue
            operation["responses"].update(common)
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
        "paths": paths,
        "components": {"schemas": top.get("$defs", {})},
    }
    if token_required:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"bearer": []}]
    return document

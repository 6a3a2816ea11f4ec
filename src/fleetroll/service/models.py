"""The HTTP API's request and response bodies (pydantic), and the results-stream lines.

These models are the API's contract: the routes validate requests with them,
answer with them, and the OpenAPI document is built from their JSON schemas.
Request models forbid unknown fields, so a typo is a 422, not a silent default,
and are strict: ``"samples_per_task": "4"`` is a 422 naming the field, not a 4.
"""

from __future__ import annotations

import shlex
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StringConstraints,
    field_validator,
    model_validator,
)

from fleetroll.results import RolloutResult
from fleetroll.training.groups import Group

__all__ = [
    "BatchCounts",
    "BatchCreated",
    "BatchRequest",
    "BatchState",
    "BatchStatus",
    "ErrorBody",
    "ErrorItem",
    "Health",
    "Observation",
    "PolicyConfig",
    "QueryRequest",
    "QueryResult",
    "SessionDone",
    "SessionOpened",
    "SessionRequest",
    "StatsResult",
    "StepRequest",
    "StreamLine",
    "TaskObject",
    "ToolInfo",
    "TreeCreated",
    "TreeRequest",
    "TreeState",
    "TreeStatus",
    "TreeStreamLine",
    "ValidationErrorBody",
]

#: Batch ids travel in URLs and become part of rollout ids.
BATCH_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"

#: ``interrupted``: the service stopped while the batch ran (a restart); some
#: rollouts have no result, and resubmitting the batch runs exactly those.
BatchStatus = Literal["running", "finished", "cancelled", "interrupted"]

#: ``failed``: the branches could not start (the pool was full by then); ``error`` says so.
TreeStatus = Literal["running", "finished", "cancelled", "failed"]

#: Tree ids become batch ids with ``-root`` or ``-b<k>`` after them.
TREE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,99}$"

#: A task in the short form, as the OpenAPI document shows it.
EXAMPLE_TASK: dict[str, Any] = {
    "key": "ledger-003",
    "prompt": "Transfer $5,000 from Savings to Checking.",
    "env_key": "ledger:v1",
    "data_key": "seed:v1",
    "modality": "tool_use",
    "solution": [
        {
            "name": "record_transaction",
            "arguments": {"from_account": "Savings", "to_account": "Checking", "amount": 5000},
        }
    ],
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class TaskObject(BaseModel):
    """One task, in Fleet's export format or the short form (docs/tasks.md).

    Only the shape is checked here; the task-file rules (required fields,
    formats agreeing, modality known, verifier parses...) are applied by
    :func:`fleetroll.tasks.parse_tasks`, whose errors name the item and field.
    Other fields of Fleet's export (``created_at``, ``verifier_id``...) are
    accepted and ignored; any other unknown field is a 422.
    """

    model_config = ConfigDict(
        extra="allow", strict=True, json_schema_extra={"examples": [EXAMPLE_TASK]}
    )

    key: str = Field(description="Unique within the batch")
    prompt: str
    env_key: str | None = Field(None, description='Short form: "name" or "name:version"')
    env_id: str | None = Field(None, description="Fleet export form of env_key")
    version: str | None = Field(None, description="Fleet export form: the env's version")
    data_key: str | None = Field(None, description='Short form: "name" or "name:version"')
    data_id: str | None = None
    data_version: str | None = None
    modality: str | None = Field(None, description="tool_use (default) or computer_use")
    task_modality: str | None = None
    verifier_func: str | None = Field(
        None, description="Python source defining the verifier; parsed, never run here"
    )
    max_steps: int | None = None
    env_variables: dict[str, Any] | None = None
    solution: list[dict[str, Any]] | None = Field(
        None, description='Tool calls solving the task: [{"name": ..., "arguments": {...}}]'
    )
    requires_final_answer: bool | None = None
    metadata: dict[str, Any] | None = None
    seed: int | None = Field(
        None, ge=0, description="Sent with every reset of the task's instance (Fleet's reset)"
    )
    timestamp: int | None = Field(
        None, ge=0, description="Unix seconds: the point in time every reset sets the clock to"
    )

    def record(self) -> dict[str, Any]:
        """The task as the client sent it (only the fields it set)."""
        return self.model_dump(exclude_unset=True)


_BaseUrl = Annotated[str, StringConstraints(pattern=r"^https?://[^\s]+$", max_length=2048)]
_Word = Annotated[str, StringConstraints(min_length=1, max_length=65_536)]


class PolicyConfig(_Request):
    """The policy driving a batch's rollouts. Unset fields come from the server's
    ``[policy]`` settings.

    ``api_key`` is write-only: it is never echoed, logged or stored in results.
    The server's own ``OPENAI_API_KEY`` is sent only to the server's configured
    servers (``policy.base_urls``, or else ``policy.base_url``), never to others
    named in a request.
    """

    kind: Literal["scripted", "openai"] | None = None
    model: str | None = Field(None, min_length=1, max_length=256)
    base_url: str | None = Field(
        None, pattern=r"^https?://[^\s]+$", max_length=2048, description="…/v1 of the endpoint"
    )
    base_urls: list[_BaseUrl] | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="Many policy servers (…/v1 each), each rollout sticking to one;"
        " wins over base_url",
    )
    api_key: SecretStr | None = Field(None, max_length=4096, json_schema_extra={"writeOnly": True})
    temperature: float | None = Field(None, ge=0, le=10)
    top_p: float | None = Field(None, ge=0, le=1)
    max_tokens: int | None = Field(None, ge=1, le=10_000_000)
    extra_body: dict[str, Any] | None = None
    system_prompt: str | None = Field(None, max_length=1_000_000)
    think_time_s: float | None = Field(None, ge=0, le=3600, description="scripted: delay per turn")
    max_retries: int | None = Field(None, ge=0, le=10)
    return_token_ids: bool | None = Field(None, description="token ids in results' turns")
    logprobs: bool | None = Field(None, description="logprobs in results' turns")
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("base_urls")
    @classmethod
    def _distinct(cls, urls: list[str] | None) -> list[str] | None:
        if urls is not None and len({u.rstrip("/") for u in urls}) < len(urls):
            raise ValueError("a policy server is listed twice")
        return urls


class BatchRequest(_Request):
    """``POST /v1/batches``: give ``tasks`` inline or a ``tasks_file`` on the server."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"tasks": [EXAMPLE_TASK], "samples_per_task": 2, "policy": {"kind": "scripted"}}
            ]
        }
    )

    tasks: list[TaskObject] | None = Field(None, min_length=1)
    tasks_file: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="A task file on the server, under its service.tasks_root",
    )
    samples_per_task: int = Field(1, ge=1, le=100_000)
    policy: PolicyConfig | None = None
    batch_id: str | None = Field(
        None,
        pattern=BATCH_ID_PATTERN,
        description="Idempotency key: resubmitting the same request returns the same batch",
    )
    deadline_s: float | None = Field(
        None, gt=0, le=7 * 86400, description="Cancel what is still running after this long"
    )
    oversample: int | None = Field(
        None,
        ge=0,
        le=100_000,
        description=(
            "Extra rollouts per group (default: the server's pool.oversample); a group is"
            " complete at its first samples_per_task scored samples, the rest end superseded"
        ),
    )

    groups_target: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description=(
            "Straggler cut-off by whole groups: once this many groups are complete, every"
            " rollout of the other groups ends superseded and their groups come with cut:"
            " true. At most the number of tasks"
        ),
    )
    agent_command: list[_Word] | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description=(
            "Run this command (an argv, or a string split as a shell would) as each"
            " rollout's agent, as fleetroll run --agent-command does; needs an openai"
            " policy. Refused (422) unless the service's service.allow_command_tasks"
        ),
    )
    max_in_flight: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description=(
            "At most this many of the batch's rollouts at once, within the pool's limits:"
            " its share of the pool beside other batches (an evaluation beside training)"
        ),
    )
    policy_version: int | None = Field(
        None,
        ge=0,
        description="A tag recorded on every result of the batch (an evaluation's policy version)",
    )

    @field_validator("agent_command", mode="before")
    @classmethod
    def _split(cls, command: Any) -> Any:
        if isinstance(command, str):
            try:
                return shlex.split(command)
            except ValueError as exc:
                raise ValueError(f"cannot be split into words: {exc}") from None
        return command

    @model_validator(mode="after")
    def _one_source(self) -> BatchRequest:
        if (self.tasks is None) == (self.tasks_file is None):
            raise ValueError("give exactly one of 'tasks' (a list) or 'tasks_file' (a path)")
        return self


class BatchCreated(BaseModel):
    batch_id: str
    rollouts: int = Field(description="Rollouts in the batch (tasks × samples_per_task)")
    created: bool = Field(description="False when an identical earlier request made it")
    rerun: int = Field(
        0,
        description="Rollouts of an identical earlier request that ended cancelled and run"
        " again now (the results stream then gives the newest result per rollout)",
    )


class BatchCounts(BaseModel):
    total: int
    queued: int
    provisioning: int
    running: int
    done: int
    failed: int = Field(description="Rollouts that failed; cancelled ones are not counted here")
    cancelled: int = Field(
        default=0,
        description="Rollouts cancelled (failure_reason cancelled): neither done nor failed",
    )


class BatchState(BaseModel):
    batch_id: str
    status: BatchStatus = Field(
        description="running until every result is in; then finished, or cancelled if it was;"
        " interrupted: the service stopped while it ran, or could not keep its results"
        " (error; resubmit it to run the rest)"
    )
    cancel_requested: bool
    counts: BatchCounts
    results: int = Field(description="Results available: the cursor of the latest one")
    error: str | None = Field(
        default=None,
        description="Why it stopped early: its results could not be written to"
        " service.state_dir (a full disk); null otherwise",
    )


class StreamLine(BaseModel):
    """One line of ``GET /v1/batches/{id}/results`` (NDJSON).

    * ``{"type": "result", "cursor": n, "result": {...}}``: the n-th result
      (1-based, in arrival order). Reconnect with ``?after=n`` to get the rest.
    * ``{"type": "heartbeat", "cursor": n}``: nothing new yet (sent while idle).
    * ``{"type": "end", "cursor": n, "status": ...}``: the last line; the batch
      is over and all ``n`` results were sent. A stream that stops without it
      was cut: reconnect with ``?after=`` the last cursor seen.
    * ``{"type": "interrupted", "cursor": n, "missing": k}``: the last line of a
      batch the service stopped while it ran (a restart): ``k`` rollouts have
      no result. Resubmit the same request, then reconnect with ``?after=n``.
      With ``"error"``: the service could not write the batch's results (a full
      disk) and stopped it; it takes no new rollouts until it is restarted.
    """

    type: Literal["result", "heartbeat", "end", "interrupted"]
    cursor: int = Field(ge=0)
    result: RolloutResult | None = None
    status: BatchStatus | None = None
    missing: int | None = None
    error: str | None = None


class GroupStreamLine(BaseModel):
    """One line of ``GET /v1/batches/{id}/groups`` (NDJSON), as :class:`StreamLine`.

    * ``{"type": "group", "cursor": n, "group": {...}}``: the n-th complete
      group (1-based, in completion order). Reconnect with ``?after=n``.
    * ``{"type": "heartbeat", "cursor": n}``, ``{"type": "end", "cursor": n,
      "status": ...}`` and ``{"type": "interrupted", "cursor": n, "missing": k}``:
      as on the results stream.
    """

    type: Literal["group", "heartbeat", "end", "interrupted"]
    cursor: int = Field(ge=0)
    group: Group | None = None
    status: BatchStatus | None = None
    missing: int | None = None
    error: str | None = None


class EventStreamLine(BaseModel):
    """One line of ``GET /v1/rollouts/{id}/events`` (NDJSON).

    * ``{"type": "event", "cursor": n, "event": {"seq": n, "kind": ..., "t_s": ...}}``:
      the n-th event; ``kind`` is ``phase`` (``phase``), ``turn`` (``latency_s``,
      ``policy_version``, ``tool_calls``, ``preview``), ``tool_call`` (``name``,
      ``duration_s``, ``is_error``, ``arguments``, ``preview``) or ``end``
      (``status``, ``failure_reason``, ``reward``, ``error``; the last line).
    * ``{"type": "gap", "cursor": n, "missed": k}``: ``k`` events after ``n`` are no
      longer held (``pool.events_max``).
    * ``{"type": "heartbeat", "cursor": n}``: nothing new yet.
    """

    type: Literal["event", "gap", "heartbeat"]
    cursor: int = Field(ge=0)
    event: dict[str, Any] | None = None
    missed: int | None = None


class TreeRequest(_Request):
    """``POST /v1/trees``: a rollout tree (``RolloutPool.run_tree``) on one task."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "task": EXAMPLE_TASK,
                    "branch_at": 1,
                    "width": 4,
                    "policy": {"kind": "scripted"},
                    "tree_id": "tree-1",
                }
            ]
        }
    )

    task: TaskObject
    branch_at: int = Field(
        ge=1,
        le=100_000,
        description="The branch point k: the root's first k steps are the shared prefix",
    )
    width: int = Field(
        4,
        ge=1,
        le=100_000,
        description="Branches from the branch point; at most service.max_batch_rollouts",
    )
    policy: PolicyConfig | None = None
    tree_id: str | None = Field(
        None,
        pattern=TREE_ID_PATTERN,
        description="Idempotency key: resubmitting the same request returns the same tree",
    )
    deadline_s: float | None = Field(
        None, gt=0, le=7 * 86400, description="Cancel what is still running after this long"
    )
    agent_command: list[_Word] | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description=(
            "Refused (422): a tree replays its prefix in fleetroll's own loop, so an agent"
            " command cannot be branched; give a scripted or openai policy"
        ),
    )


class TreeCreated(BaseModel):
    tree_id: str
    rollouts: int = Field(description="Rollouts at most: the root and width branches")
    created: bool = Field(description="False when an identical earlier request made it")
    root_batch_id: str = Field(description="The root's batch ({tree_id}-root)")
    branches_batch_id: str = Field(description="The branches' batch ({tree_id}-b{branch_at})")


class TreeState(BaseModel):
    """``GET /v1/trees/{id}``: the tree so far, as ``RolloutPool.run_tree`` returns it."""

    tree_id: str
    status: TreeStatus = Field(
        description="running until the root and every branch ended; then finished, or"
        " cancelled if it was; failed: the branches could not start (error)"
    )
    cancel_requested: bool
    branch_at: int
    width: int
    root_batch_id: str
    branches_batch_id: str
    root: RolloutResult | None = Field(
        None, description="The root once it ended: stopped at the branch point (max_steps)"
    )
    branches: list[RolloutResult] = Field(
        default_factory=list, description="The branches that ended, in the order they ended"
    )
    groups: list[Group] = Field(
        default_factory=list,
        description="Once every branch ended: one group per branch point (its branches);"
        " empty when the root ended before the branch point",
    )
    results: int = Field(description="Results available: the cursor of the latest one")
    error: str | None = Field(
        default=None, description="Why the branches did not start (failed); null otherwise"
    )


class TreeStreamLine(BaseModel):
    """One line of ``GET /v1/trees/{id}/results`` (NDJSON), as :class:`StreamLine`.

    * ``{"type": "result", "cursor": n, "result": {...}}``: the n-th result: the
      root is cursor 1, the branches follow as they end.
    * ``{"type": "heartbeat", "cursor": n}``: nothing new yet.
    * ``{"type": "end", "cursor": n, "status": ...}``: the last line; with
      ``"error"`` when the branches could not start.
    """

    type: Literal["result", "heartbeat", "end"]
    cursor: int = Field(ge=0)
    result: RolloutResult | None = None
    status: TreeStatus | None = None
    error: str | None = None


class PolicyState(BaseModel):
    """``GET /v1/policy``: the policy version recorded on turns, and the pauses held."""

    version: int
    paused: bool = Field(description="New policy calls wait (a pause is held)")
    pauses: int = Field(ge=0, description="Pause leases held over HTTP")


class PolicyVersionRequest(_Request):
    """``PUT /v1/policy/version``: the trainer synced new weights."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"version": 12}]})

    version: int = Field(ge=0)


class PauseRequest(_Request):
    """``POST /v1/policy/pauses`` (a new pause) and ``PUT`` on one (a renewal)."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"ttl_s": 60}]})

    ttl_s: float = Field(
        gt=0,
        description=(
            "The pause ends this long from now unless renewed (at most the server's"
            " service.max_pause_ttl_s), so a crashed trainer cannot pause forever"
        ),
    )


class PauseLease(BaseModel):
    """A pause held for the caller: renew it before ``ttl_s`` passes, delete it when done."""

    pause_id: str
    ttl_s: float


class SessionRequest(_Request):
    """``POST /v1/sessions``: an env-style session on one task (no policy)."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"task": EXAMPLE_TASK}]})

    task: TaskObject
    batch_id: str | None = Field(
        None, pattern=BATCH_ID_PATTERN, description="Recorded on the result (default: sessions)"
    )
    sample_index: int = Field(0, ge=0, le=1_000_000)


class ToolInfo(BaseModel):
    name: str
    description: str
    input_schema: dict[str, Any]


class SessionOpened(BaseModel):
    session_id: str
    messages: list[dict[str, Any]] = Field(description="The opening messages (the task prompt)")
    tools: list[ToolInfo]


class StepRequest(_Request):
    """``POST /v1/sessions/{id}/step``: one tool call."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"name": "get_balance", "arguments": {"account": "Rent"}}]}
    )

    name: str = Field(min_length=1, max_length=256)
    arguments: dict[str, Any] = Field(default_factory=dict)
    id: str | None = Field(None, max_length=256, description="The call's id (default: made up)")


class Observation(BaseModel):
    text: str
    is_error: bool
    done: bool = Field(description="The episode is over: DELETE the session for its result")
    messages: list[dict[str, Any]] = Field(description="Messages this step added")


class SessionDone(BaseModel):
    """``POST /v1/sessions/{id}/done``: the episode is over (its result will be completed)."""

    session_id: str
    done: Literal[True] = True


class QueryRequest(_Request):
    """``POST /v1/query``: one read-only SQL statement on the telemetry store."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "sql": "SELECT span_name, count(*) FROM records WHERE span_name LIKE ?"
                    " GROUP BY span_name",
                    "params": ["fleet_%"],
                }
            ]
        }
    )

    sql: str = Field(min_length=1, max_length=100_000)
    params: list[Any] | dict[str, Any] | None = None
    max_rows: int | None = Field(None, ge=1, description="Capped by the server's query_max_rows")


class QueryResult(BaseModel):
    columns: list[str]
    rows: list[list[Any]]
    truncated: bool = Field(
        description="More rows matched than were returned (service.query_max_rows or"
        " service.query_max_bytes reached; fetching stopped there)"
    )


class StatsResult(BaseModel):
    """``GET /v1/stats``: rollouts per environment, and the telemetry invariant."""

    batch_id: str | None = None
    envs: list[dict[str, Any]] = Field(
        description="Per (env_key, env_version, modality): started, completed, failed,"
        " failure_reasons, reward_mean, provisioning_p50_s/p95_s, tool_errors,"
        " verifier_errors, and the results' cost summed: instance_s, prompt_tokens,"
        " completion_tokens, policy_calls, tool_calls"
    )
    batches: list[dict[str, Any]] = Field(
        description="The results' cost summed per batch, newest first: batch_id, completed,"
        " instance_s, prompt_tokens, completion_tokens, policy_calls, tool_calls"
    )
    invariant_ok: bool = Field(description="Every rollout id started once and completed once")
    rollouts: int
    never_completed: list[str]
    completed_more_than_once: list[str]
    completed_without_start: list[str]


_FIGURES: dict[str, Any] = {
    "samples": {"type": "integer", "description": "Results (scored or not)"},
    "scored": {"type": "integer", "description": "Results with a reward"},
    "successes": {"type": "integer", "description": "Scored results with reward ≥ the threshold"},
    "unscored": {"type": "integer", "description": "Results without a reward"},
    "unscored_reasons": {
        "type": "object",
        "additionalProperties": {"type": "integer"},
        "description": "Results without a reward, per failure reason",
    },
    "mean_reward": {"type": ["number", "null"]},
}
_PASS_AT: dict[str, Any] = {"^pass@[0-9]+$": {"type": ["number", "null"]}}
_INTERVAL: dict[str, Any] = {
    "type": ["array", "null"],
    "items": {"type": "number"},
    "minItems": 2,
    "maxItems": 2,
}

#: Figures over a set of tasks: pass@j is the mean over the tasks that have it.
_SUMMARY: dict[str, Any] = {
    "type": "object",
    "properties": {
        "tasks": {"type": "integer"},
        "tasks_scored": {"type": "integer"},
        **_FIGURES,
        "intervals": {
            "type": "object",
            "additionalProperties": _INTERVAL,
            "description": "Per pass@j, its 95% bootstrap interval over tasks",
        },
        "counted": {
            "type": "object",
            "additionalProperties": {"type": "integer"},
            "description": "Per pass@j, the tasks with at least j scored samples",
        },
    },
    "patternProperties": _PASS_AT,
}

#: ``GET /v1/batches/{id}/eval``: an evaluation (``EvalReport.to_json``), as a JSON schema.
EVAL_REPORT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["k", "success_threshold", "policy_version", "tasks", "environments", "overall"],
    "properties": {
        "k": {"type": "integer", "description": "The largest j of pass@j"},
        "success_threshold": {"type": "number"},
        "policy_version": {"type": ["integer", "null"]},
        "batch_ids": {"type": "array", "items": {"type": "string"}},
        "intervals": {"type": "string", "description": "What the intervals are"},
        "tasks": {
            "type": "object",
            "description": "Per task_key: its figures and pass@1 … pass@k (null above scored)",
            "additionalProperties": {
                "type": "object",
                "properties": {
                    "task_key": {"type": "string"},
                    "env": {"type": "string"},
                    **_FIGURES,
                    "pass@1_interval": _INTERVAL,
                },
                "patternProperties": _PASS_AT,
            },
        },
        "environments": {
            "type": "object",
            "description": "Per environment (key:version): as overall",
            "additionalProperties": _SUMMARY,
        },
        "overall": {"description": "Means over tasks (each weighs the same)", **_SUMMARY},
    },
}


class Health(BaseModel):
    status: Literal["ok", "failing"] = "ok"
    error: str | None = Field(
        default=None,
        description="failing: why (service.state_dir cannot be written); it takes no new"
        " rollouts until it is restarted",
    )


class ErrorItem(BaseModel):
    loc: list[str | int] = Field(description='Where: e.g. ["body", "tasks", 2, "env_key"]')
    msg: str
    type: str


class ValidationErrorBody(BaseModel):
    """422: what is wrong, field by field."""

    detail: list[ErrorItem]


class ErrorBody(BaseModel):
    detail: str

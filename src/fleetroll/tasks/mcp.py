"""The task form of the ``mcp`` provider: ``environment`` and ``verifier`` (docs/tasks.md).

A task runs on any MCP server when it gives ``environment`` instead of
``env_key``: a stdio server started per rollout (``environment.command``,
with ``files``, ``setup`` and ``env``) or a streamable-HTTP server already
running (``environment.url``, with an optional ``reset`` and
``max_concurrent_rollouts``, how many rollouts it serves at once). Its
``verifier`` is a command run in the rollout's working directory or a tool call on the
environment's own server. :func:`parse_mcp` checks both fields of a record,
raising the loader's :class:`~fleetroll.errors.TaskFileError` naming the
field (``environment.files.notes/../x``). Pure: nothing runs here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any, Final, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fleetroll.tasks.records import Where

__all__ = [
    "PLACEHOLDERS",
    "HttpRequest",
    "McpEnvironment",
    "McpVerifier",
    "ToolCallSpec",
    "parse_mcp",
]

#: Placeholders substituted in ``environment.command``, ``setup``, ``env``,
#: ``verifier.command`` and the task's ``solution`` arguments: the rollout's
#: working directory, the Python running fleetroll, and the folder of
#: fleetroll's example MCP servers.
PLACEHOLDERS: Final = ("{workdir}", "{python}", "{examples}")
#: Fields of a Fleet task that an ``mcp`` task may not give.
_FLEET_ONLY: Final = ("verifier_func", "data_key", "data_id", "data_version", "env_variables")
_M = TypeVar("_M", bound=BaseModel)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ToolCallSpec(_Strict):
    """A tool call: ``{"name": ..., "arguments": {...}}``."""

    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)


class HttpRequest(_Strict):
    """An HTTP request (an environment's reset): ``{"method": "POST", "url": ...}``."""

    method: str = Field("POST", pattern=r"^(GET|POST|PUT|DELETE|PATCH)$")
    url: str = Field(pattern=r"^https?://")


class Reset(_Strict):
    """How a URL environment is brought back to its start: an HTTP request or a tool call."""

    http: HttpRequest | None = None
    tool: ToolCallSpec | None = None

    @model_validator(mode="after")
    def _one(self) -> Reset:
        if (self.http is None) == (self.tool is None):
            raise ValueError("give 'http' or 'tool', exactly one")
        return self


def _command(value: tuple[str, ...] | None) -> tuple[str, ...] | None:
    if value is not None and (not value or not all(part for part in value)):
        raise ValueError("must be a non-empty list of non-empty strings")
    return value


class McpEnvironment(_Strict):
    """Where an ``mcp`` task's tools are: a command (stdio) or a URL (streamable HTTP)."""

    name: str | None = Field(None, min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    command: tuple[str, ...] | None = None
    files: dict[str, str] = Field(default_factory=dict)
    setup: tuple[str, ...] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    url: str | None = Field(None, pattern=r"^https?://")
    reset: Reset | None = None
    #: Rollouts the ``url`` server serves at once (their states must not mix):
    #: more wait for it, from before their reset until they are verified.
    max_concurrent_rollouts: int = Field(1, ge=1)

    _commands = field_validator("command", "setup")(_command)

    @field_validator("files")
    @classmethod
    def _relative(cls, files: dict[str, str]) -> dict[str, str]:
        for path in files:
            pure = PurePosixPath(path)
            if not path or pure.is_absolute() or ".." in pure.parts or "\\" in path:
                raise ValueError(f"{path!r} must be a relative path inside the working directory")
        return files

    @model_validator(mode="after")
    def _shape(self) -> McpEnvironment:
        if (self.command is None) == (self.url is None):
            raise ValueError("give 'command' (a stdio server) or 'url', exactly one")
        if self.url is not None and (self.files or self.setup or self.env):
            raise ValueError("'files', 'setup' and 'env' are for a 'command' server, not a 'url'")
        if self.command is not None and self.reset is not None:
            raise ValueError("'reset' is for a 'url' server (a 'command' server starts fresh)")
        if self.command is not None and "max_concurrent_rollouts" in self.model_fields_set:
            raise ValueError(
                "'max_concurrent_rollouts' is for a 'url' server (a 'command' server is"
                " started for each rollout)"
            )
        return self


class McpVerifier(_Strict):
    """An ``mcp`` task's verifier: a command in the working directory, or a tool call."""

    command: tuple[str, ...] | None = None
    reward_file: str | None = Field(None, min_length=1)
    tool: ToolCallSpec | None = None

    _commands = field_validator("command")(_command)

    @field_validator("reward_file")
    @classmethod
    def _relative(cls, path: str | None) -> str | None:
        if path is not None:
            pure = PurePosixPath(path)
            if pure.is_absolute() or ".." in pure.parts:
                raise ValueError(f"{path!r} must be a relative path inside the working directory")
        return path

    @model_validator(mode="after")
    def _shape(self) -> McpVerifier:
        if (self.command is None) == (self.tool is None):
            raise ValueError("give 'command' or 'tool', exactly one")
        if self.reward_file is not None and self.command is None:
            raise ValueError("'reward_file' goes with 'command'")
        return self


def parse_mcp(
    record: Mapping[str, Any], where: Where, *, fleet_env: bool, needs_verifier: bool = True
) -> tuple[McpEnvironment, McpVerifier | None] | None:
    """The record's ``environment`` and ``verifier``, or None for a Fleet task.

    Args:
        record: the task object.
        where: where it came from (for errors).
        fleet_env: the record names a Fleet environment (``env_key``/``env_id``).
        needs_verifier: a missing ``verifier`` is an error (false when the
            task's ``rewards`` name no verifier component).

    Raises:
        TaskFileError: a field is invalid, or the record mixes the two forms.
    """
    environment = record.get("environment")
    verifier = record.get("verifier")
    if environment is None:
        if verifier is not None:
            raise where.error("is for tasks with an 'environment' (Fleet uses 'verifier_func')",
                              "verifier")  # fmt: skip
        return None
    if fleet_env:
        given = "env_key" if record.get("env_key") is not None else "env_id"
        raise where.error("give 'env_key' (Fleet) or 'environment' (mcp), not both", given)
    for name in _FLEET_ONLY:
        if record.get(name) is not None:
            raise where.error("is for Fleet tasks, not ones with an 'environment'", name)
    if verifier is None:
        if not needs_verifier:
            return _model(McpEnvironment, environment, "environment", where), None
        example = '{"command": ["bash", "-c", "..."]}'
        raise where.error(f"missing required field 'verifier' (e.g. {example})", "verifier")
    return _model(McpEnvironment, environment, "environment", where), _model(
        McpVerifier, verifier, "verifier", where
    )


def _model(cls: type[_M], value: object, field: str, where: Where) -> _M:
    if not isinstance(value, Mapping):
        raise where.error("must be a JSON object", field)
    try:
        return cls.model_validate(dict(value))
    except ValidationError as exc:
        error = exc.errors(include_url=False, include_input=False)[0]
        loc = ".".join(str(part) for part in error["loc"])
        message = str(error["msg"]).removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = f"unknown field {str(error['loc'][-1])!r}"
        raise where.error(message, f"{field}.{loc}" if loc else field) from None

"""fleetroll's exceptions: one tree, rooted at :class:`FleetrollError`.

::

    FleetrollError
    ├── ConfigError              settings or a config file are invalid
    ├── TaskFileError            a task file is invalid (file, line, field)
    ├── EmulatorError            the embedded emulator failed to start or stop
    ├── PoolFullError            a pool has too many unfinished rollouts to take a batch
    ├── ServiceError             the HTTP service answered an error (fleetroll.client)
    ├── StoreError               the local telemetry store (fleetroll.telemetry.store)
    │   └── QueryError           a query failed (fleetroll.telemetry.queries)
    │       └── ReadOnlyError    a query tried to write
    └── RolloutError             one rollout's operation failed; carries
        │                        rollout_id, operation, transient
        ├── ProvisionError       creating an instance failed
        ├── InstanceLostError    the instance died mid-rollout
        ├── ToolsError           tool discovery or a session set-up failed
        ├── PolicyError          the policy endpoint failed
        └── OperationTimeout     an operation passed its own deadline;
                                 carries timeout_s

Third-party exceptions (the Fleet SDK's, httpx's, mcp's) are translated into
these at the module that calls the library, with ``raise ... from exc``, so
nothing above that module needs to know which library failed.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "EmulatorError",
    "FleetrollError",
    "InstanceLostError",
    "OperationTimeout",
    "PolicyError",
    "PoolFullError",
    "ProvisionError",
    "RolloutError",
    "TaskFileError",
    "ToolsError",
]


class FleetrollError(Exception):
    """Base class of every error fleetroll raises on purpose."""


class ConfigError(FleetrollError):
    """Settings, a config file or a fault profile are invalid.

    The message names the source (file or environment variable) and the field.
    """


class TaskFileError(FleetrollError):
    """A task file cannot be used. Nothing has run when this is raised."""

    def __init__(
        self, message: str, *, path: str, line: int | None = None, field: str | None = None
    ) -> None:
        where = path if line is None else f"{path}:{line}"
        if field:
            where = f"{where}: field {field!r}"
        super().__init__(f"{where}: {message}")
        self.path = path
        self.line = line
        self.field = field
        self.reason = message


class EmulatorError(FleetrollError):
    """The embedded Fleet emulator could not start, or failed while running."""


class PoolFullError(FleetrollError):
    """A pool refused a batch: its unfinished rollouts would pass ``pool.max_queued_rollouts``.

    Nothing of the batch has started; submit it again once earlier batches
    have finished (the HTTP service answers 503 with Retry-After).

    Attributes:
        queued: rollouts not yet finished across the pool's batches.
        requested: rollouts of the refused batch.
        limit: ``pool.max_queued_rollouts``.
    """

    def __init__(self, *, queued: int, requested: int, limit: int) -> None:
        if requested > limit:  # no wait makes room: the batch alone is too big
            message = (
                f"a batch of {requested} rollouts is over pool.max_queued_rollouts = {limit}:"
                " split it, or raise the limit (FLEETROLL_POOL__MAX_QUEUED_ROLLOUTS)"
            )
        else:
            message = (
                f"the pool is full: {queued} rollouts not yet finished + {requested} of this"
                f" batch would pass pool.max_queued_rollouts = {limit}; retry once earlier"
                " batches end"
            )
        super().__init__(message)
        self.queued = queued
        self.requested = requested
        self.limit = limit


class RolloutError(FleetrollError):
    """An operation of one rollout failed.

    Attributes:
        operation: what was being done (``"provision"``, ``"call_tool"``...).
        transient: whether trying again may succeed. Decided once, where the
            error is raised, never by matching messages later.
        rollout_id: the rollout, when known.
    """

    def __init__(
        self,
        message: str,
        *,
        operation: str,
        transient: bool = False,
        rollout_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.operation = operation
        self.transient = transient
        self.rollout_id = rollout_id


class ProvisionError(RolloutError):
    """Creating an instance failed (after retries, or permanently).

    Attributes:
        status_code: HTTP status of the last failed create, when there was one.
        retry_after_s: the server's Retry-After, when it sent one.
        attempts: how many creates were tried.
    """

    def __init__(
        self,
        message: str,
        *,
        transient: bool,
        status_code: int | None = None,
        retry_after_s: float | None = None,
        attempts: int = 1,
        rollout_id: str | None = None,
    ) -> None:
        super().__init__(message, operation="provision", transient=transient, rollout_id=rollout_id)
        self.status_code = status_code
        self.retry_after_s = retry_after_s
        self.attempts = attempts


class InstanceLostError(RolloutError):
    """The rollout's instance is gone (expired, died, or deleted elsewhere)."""


class ToolsError(RolloutError):
    """MCP session set-up or tool discovery failed, or found no usable tool."""


class PolicyError(RolloutError):
    """The policy (model endpoint) failed or answered something unusable."""


class OperationTimeout(RolloutError):
    """An operation passed its own deadline.

    Attributes:
        timeout_s: the deadline that passed, in seconds.
    """

    def __init__(
        self, message: str, *, operation: str, timeout_s: float, rollout_id: str | None = None
    ) -> None:
        super().__init__(message, operation=operation, transient=True, rollout_id=rollout_id)
        self.timeout_s = timeout_s

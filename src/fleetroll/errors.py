"""fleetroll's exceptions: one tree, rooted at :class:`FleetrollError`.

::

    FleetrollError
    ├── ConfigError              settings or a config file are invalid
    ├── TaskFileError            a task file is invalid (file, line, field)
    ├── EmulatorError            the embedded emulator failed to start or stop
    ├── PoolFullError            a pool has too many unfinished rollouts to take a batch
    ├── PreflightError           a batch cannot run: unknown env, key refused, policy dead
    │   └── ServicePreflightError  the service's pre-flight refused it (also a ServiceError)
    ├── ServiceError             the HTTP service answered an error (fleetroll.client)
    ├── JournalError             a result journal could not be written (a full disk)
    ├── WeightSyncError          a policy server did not take new weights (fleetroll.training)
    ├── StoreError               the local telemetry store could not be opened or read
    │   ├── NoSuchBatchError     a batch id the store has never seen
    │   └── QueryError           a query failed
    │       └── ReadOnlyError    a query tried to write
    └── RolloutError             one rollout's operation failed; carries
        │                        rollout_id, operation, transient
        ├── ProvisionError       creating an instance failed
        │   └── EnvUnavailableError  its environment version is quarantined
        ├── InstanceLostError    the instance died mid-rollout
        ├── ToolsError           tool discovery or a session set-up failed
        │   ├── ComputerToolMissing  computer_use without a ``computer`` tool
        │   └── ToolCallFailed   a tool call got no answer (timeout, transport)
        ├── PolicyError          the policy endpoint failed
        │   └── ContextOverflowError  the prompt is longer than the model's context
        ├── JudgeError           a reward's judge failed or answered no score
        └── OperationTimeout     an operation passed its own deadline;
                                 carries timeout_s

Every class is defined here; the modules that raise them re-export them
(``fleetroll.client.ServiceError`` is this ``ServiceError``).

Third-party exceptions (the Fleet SDK's, httpx's, mcp's) are translated into
these at the module that calls the library, with ``raise ... from exc``, so
nothing above that module needs to know which library failed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = [
    "ComputerToolMissing",
    "ConfigError",
    "ContextOverflowError",
    "EmulatorError",
    "EnvUnavailableError",
    "FleetrollError",
    "InstanceLostError",
    "JournalError",
    "JudgeError",
    "NoSuchBatchError",
    "OperationTimeout",
    "PolicyError",
    "PoolFullError",
    "PreflightError",
    "ProvisionError",
    "QueryError",
    "ReadOnlyError",
    "RolloutError",
    "ServiceError",
    "ServicePreflightError",
    "StoreError",
    "TaskFileError",
    "ToolCallFailed",
    "ToolsError",
    "WeightSyncError",
]


class FleetrollError(Exception):
    """Base class of every error fleetroll raises on purpose."""


class ConfigError(FleetrollError):
    """Settings, a config file or a fault profile are invalid.

    The message names the source (file or environment variable) and the field.
    """


class JournalError(FleetrollError):
    """Writing a result journal failed (a full disk, an I/O error): nothing more
    is written to it, and the results it could not write are not kept.

    Attributes:
        path: the journal.
        error: the operating system's error (``errno`` tells ENOSPC from EIO).
        written: how many results it holds from this run.
    """

    def __init__(self, path: object, error: OSError, written: int, hint: str = "") -> None:
        self.path = path
        self.error = error
        self.written = written
        why = error.strerror or str(error)
        super().__init__(f"writing the journal {path} failed: {why}{hint}")


class WeightSyncError(FleetrollError):
    """New weights did not reach every policy server
    (:mod:`fleetroll.training.weight_sync`): a server refused them, did not
    answer in time, or still reports its old weight version.

    Attributes:
        failed: each server that did not take the weights (its URL, without
            credentials) and why, one line each.
        synced: the servers that did take them (the fleet serves mixed weights
            until a sync succeeds everywhere).
    """

    def __init__(self, failed: Mapping[str, str], synced: Sequence[str] = ()) -> None:
        self.failed = dict(failed)
        self.synced = list(synced)
        lines = "; ".join(f"{server}: {why}" for server, why in self.failed.items())
        tail = ""
        if self.synced:
            tail = (
                f" ({len(self.synced)} other server(s) took them: the servers now serve"
                " different weights until a sync succeeds on all of them)"
            )
        super().__init__(f"the weight sync failed on {lines}{tail}")


class PreflightError(FleetrollError):
    """The checks before a batch provisions anything found problems; nothing ran.

    ``problems`` holds one line per problem (an unknown environment version, a
    refused key, a policy endpoint that does not answer); never a secret.
    """

    def __init__(self, problems: Sequence[str], *, skip: str = "--no-preflight") -> None:
        self.problems = list(problems)
        lines = "; ".join(self.problems)
        super().__init__(f"pre-flight failed, nothing was provisioned ({skip} skips it): {lines}")


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


class EnvUnavailableError(ProvisionError):
    """The environment version is quarantined by its circuit breaker (fail-fast mode).

    Attributes:
        env: the quarantined ``key:version``.
    """

    def __init__(self, message: str, *, env: str) -> None:
        super().__init__(message, transient=True, attempts=0)
        self.env = env


class InstanceLostError(RolloutError):
    """The rollout's instance is gone (expired, died, or deleted elsewhere)."""


class ToolsError(RolloutError):
    """MCP session set-up or tool discovery failed, or found no usable tool."""


class PolicyError(RolloutError):
    """The policy (model endpoint) failed or answered something unusable."""


class JudgeError(RolloutError):
    """A judge (the model scoring a rubric of a task's ``rewards``) failed: no
    answer within ``judge.timeout_s``, an error status after retries, or an
    answer without a score in [0, 1]. ``operation`` is ``"judge"``.

    Attributes:
        status_code: the HTTP status the judge answered, when it answered one.
        retry_after_s: the server's Retry-After, when it sent one.
    """

    def __init__(
        self,
        message: str,
        *,
        transient: bool,
        status_code: int | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, operation="judge", transient=transient)
        self.status_code = status_code
        self.retry_after_s = retry_after_s


class ContextOverflowError(PolicyError):
    """The prompt would not fit the model's context (``policy.max_context_tokens``,
    or the server answered that it is too long). Never transient."""


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


class ToolCallFailed(ToolsError):
    """A tool call raised or timed out (as opposed to answering an error)."""


class ComputerToolMissing(ToolsError):
    """A computer_use rollout's endpoint offers no ``computer`` tool."""


class ServiceError(FleetrollError):
    """The service answered with an error, or could not be reached in time.

    Attributes:
        status_code: the HTTP status, or None when no answer came.
        detail: the service's explanation (for a 422: ``loc: msg`` per problem).
    """

    def __init__(self, message: str, *, status_code: int | None = None, detail: str = "") -> None:
        super().__init__(message)
        self.status_code = status_code
        self.detail = detail


class ServicePreflightError(PreflightError, ServiceError):
    """The service's pre-flight refused a batch (its 422): the remote :class:`PreflightError`.

    Caught as either: ``except PreflightError`` works as in-process, and
    ``status_code`` is 422 for code that handles every :class:`ServiceError`.
    ``problems`` holds the service's problem lines as one line.
    """

    def __init__(self, message: str) -> None:
        FleetrollError.__init__(self, message)
        _, found, lines = message.partition(" skips it): ")
        self.problems = [lines if found else message]
        self.status_code: int | None = 422
        self.detail = message


class StoreError(FleetrollError):
    """The telemetry store could not be opened or queried; the message says why.

    (A ``FleetrollError``: entry points turn it into one line and exit code 2.)
    """


class QueryError(StoreError):
    """The SQL failed (syntax, unknown column, time limit...); the message says why."""


class ReadOnlyError(QueryError):
    """The SQL tried to change the store, which is only ever opened for reading."""


class NoSuchBatchError(StoreError):
    """``--batch``/``batch_id`` names no batch in the store.

    Attributes:
        batch_id: the id asked for.
        recent: the most recent batch ids in the store, newest first.
    """

    def __init__(self, batch_id: str, recent: Sequence[str]) -> None:
        known = f"; recent batches: {', '.join(recent)}" if recent else "; the store has none"
        super().__init__(f"no such batch: {batch_id}{known}")
        self.batch_id = batch_id
        self.recent = list(recent)

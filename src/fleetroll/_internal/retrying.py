"""One table for "is this failure worth another attempt", one Retry-After parser, one backoff.

Every caller that retries an outgoing call (provisioning, verification, MCP
connects, the OpenAI-compatible policy, a reward's judge, the HTTP client) decides with
:func:`decide` and :func:`transient_status`, waits :func:`backoff_s`, and reads
the server's wish with :func:`retry_after_s`. The Fleet SDK's typed
exceptions are mapped onto this table in :mod:`fleetroll.environments.fleet.provider`, the
only module that knows them.

Every retry loop is :func:`attempts`, spending the budget (:class:`Budget`) its
caller was given from the caller's own settings section
(``ProvisioningSettings.budget``, ``RetrySettings.verify_budget``, ...)::

    async for attempt in retrying.attempts("policy", budget, deadline=scope.deadline):
        with attempt:
            response = await post()

Each retry it schedules is one debug record on the ``fleetroll.retries``
logger, and is reported once (:class:`Retry`), per call: to the reporter the
caller passes, else to the one bound for the current context
(:func:`reporting`; a rollout binds a ``fleet_retry`` emitter).

The loop is fleetroll's own, in the style of stamina's ``retry_context``
(which it used before): stamina runs only process-wide retry hooks (its
default prints a line on stdout per retry), and a library must neither
print nor change a dependency's process-wide state. Every decision (what
is transient, the wait, the deadline) was fleetroll's already.
"""

from __future__ import annotations

import contextvars
import logging
import math
import random
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from types import TracebackType
from typing import Literal, Self

import anyio
import httpx
import httpx2

from fleetroll._internal.wire import BadResponse, ConnectFailed, ConnectionLost
from fleetroll.settings.sections import Budget

__all__ = [
    "Attempt",
    "Budget",
    "Decision",
    "Operation",
    "Report",
    "Retry",
    "attempts",
    "backoff_s",
    "decide",
    "reporting",
    "retry_after_s",
    "transient_status",
]

#: Every operation fleetroll retries, as ``fleet_retry`` names it.
Operation = Literal[
    "make",
    "preflight",
    "mcp_connect",
    "list_tools",
    "mcp_request",
    "verify",
    "policy",
    "judge",
    "client",
    "client_stream",
    "weight_sync",
]

_log = logging.getLogger("fleetroll.retries")

#: Statuses that say "later" rather than "never": timeouts, too early, too many.
_TRANSIENT_4XX = frozenset({408, 425, 429})


@dataclass(frozen=True, slots=True)
class Decision:
    """What one failure means for the next attempt."""

    transient: bool
    status_code: int | None = None
    retry_after_s: float | None = None


def _retry_after_of(exc: BaseException) -> float | None:
    value = getattr(exc, "retry_after_s", None)
    if isinstance(value, int | float) and math.isfinite(value) and value >= 0:
        return float(value)
    return None


def transient_status(status: int) -> bool:
    """Whether an HTTP status is worth another attempt (408, 425, 429, 5xx)."""
    return status >= 500 or status in _TRANSIENT_4XX


def decide(exc: BaseException) -> Decision:
    """The generic part of the table: deadlines, transports, statuses, our own errors.

    Order: a deadline of ours, a transport failure, an explicit ``transient``
    flag (fleetroll's own errors), an HTTP status the exception carries
    (``status_code``); anything else is permanent. A ``retry_after_s``
    the exception carries (the server's wish) comes along.
    """
    if isinstance(exc, TimeoutError | httpx.TransportError | httpx2.TransportError):
        return Decision(True)
    if isinstance(exc, ConnectFailed | ConnectionLost | BadResponse):  # the Wire's, likewise
        return Decision(True)
    status = getattr(exc, "status_code", None)
    flag = getattr(exc, "transient", None)
    if isinstance(flag, bool):
        return Decision(flag, status if isinstance(status, int) else None, _retry_after_of(exc))
    if isinstance(status, int):
        return Decision(transient_status(status), status, _retry_after_of(exc))
    return Decision(False)


def retry_after_s(headers: Mapping[str, str], *, now: datetime | None = None) -> float | None:
    """The wait a server asked for, in seconds, or None.

    Reads ``retry-after-ms`` (OpenAI's) first, then ``Retry-After`` as seconds
    or as an HTTP date. Negative, unparsable or infinite values are None.
    """
    millis = headers.get("retry-after-ms")
    if millis is not None:
        try:
            value = float(millis) / 1000
        except ValueError:
            pass
        else:
            if math.isfinite(value) and value >= 0:
                return value
    header = headers.get("retry-after")
    if header is None:
        return None
    try:
        value = float(header)
    except ValueError:
        try:
            when = parsedate_to_datetime(header)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        value = (when - (now or datetime.now(UTC))).total_seconds()
    if not math.isfinite(value):
        return None
    return max(value, 0.0)


def backoff_s(
    attempt: int, *, initial_s: float, max_s: float, retry_after: float | None = None
) -> float:
    """The wait before attempt ``attempt + 1``: the server's wish, or full jitter.

    Exponential (``initial_s * 2**(attempt-1)``) with full jitter, capped at
    ``max_s``; a Retry-After replaces it, capped at ``max_s`` too.
    """
    if retry_after is not None:
        return min(retry_after, max_s)
    ceiling = min(max_s, initial_s * 2.0 ** max(0, attempt - 1))
    return random.uniform(0.0, ceiling)


# ------------------------------------------------------------------ attempts


@dataclass(frozen=True, slots=True)
class Retry:
    """One retry about to happen: ``attempt`` failed with ``error``; the next
    starts in ``delay_s``."""

    operation: str
    attempt: int
    error: BaseException
    delay_s: float
    decision: Decision

    @property
    def cause(self) -> BaseException:
        """``error``, or the one error inside it when it is a group of one
        (what a task group raises)."""
        exc = self.error
        while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
        return exc


#: Told of every retry before its wait; must not block or raise.
Report = Callable[[Retry], None]

_reporter: contextvars.ContextVar[Report | None] = contextvars.ContextVar(
    "fleetroll_retry_reporter", default=None
)


@contextmanager
def reporting(report: Report) -> Iterator[None]:
    """Report the retries of calls made in this context to ``report``."""
    token = _reporter.set(report)
    try:
        yield
    finally:
        _reporter.reset(token)


def _log_retry(retry: Retry) -> None:
    _log.debug(
        "retry of %s after attempt %d in %.3g s: %s",
        retry.operation,
        retry.attempt,
        retry.delay_s,
        type(retry.cause).__name__,
    )


class Attempt:
    """One attempt of :func:`attempts`: ``with attempt:`` around the work.

    A failure in the block that is worth another attempt is kept (the block
    ends quietly, the loop waits and tries again); any other leaves the
    loop unchanged.
    """

    __slots__ = ("_attempts", "num")

    def __init__(self, attempts: _Attempts, num: int) -> None:
        self._attempts = attempts
        #: This attempt's number, 1 for the first.
        self.num = num

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if exc is None:
            self._attempts.succeeded = True
            return False
        if not isinstance(exc, Exception):  # cancellation, KeyboardInterrupt: never retried
            return False
        delay = self._attempts.retry_in(exc)
        if delay is None:
            return False
        self._attempts.wait_s = delay
        return True


class _Attempts:
    """The attempts at one operation: fleetroll's decision, wait and report."""

    def __init__(
        self,
        operation: str,
        budget: Budget,
        *,
        deadline: float | None,
        classify: Callable[[BaseException], Decision],
        report: Report | None,
    ) -> None:
        self._operation = operation
        self._budget = budget
        self._deadline = deadline
        self._classify = classify
        self._report = report
        #: The attempt under way (1 for the first).
        self.number = 0
        self.succeeded = False
        #: The wait before the next attempt, set when the last one failed transiently.
        self.wait_s: float | None = None

    def retry_in(self, exc: Exception) -> float | None:
        """The wait before another attempt after ``exc``, reported; None: no other."""
        decision = self._classify(exc)
        limit = self._budget.attempts
        if not decision.transient or (limit is not None and self.number >= limit):
            return None
        b = self._budget
        jitter = backoff_s(self.number, initial_s=b.backoff_initial_s, max_s=b.backoff_max_s)
        delay = max(jitter, decision.retry_after_s or 0.0)
        if self._deadline is not None and anyio.current_time() + delay >= self._deadline:
            return None  # the next attempt could not start in time
        retry = Retry(self._operation, self.number, exc, delay, decision)
        _log_retry(retry)
        if self._report is not None:
            self._report(retry)
        return delay

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Attempt:
        if self.number > 0:
            wait, self.wait_s = self.wait_s, None
            if self.succeeded or wait is None:
                raise StopAsyncIteration
            await anyio.sleep(wait)
        self.number += 1
        return Attempt(self, self.number)


def attempts(
    operation: Operation,
    budget: Budget,
    *,
    deadline: float | None = None,
    classify: Callable[[BaseException], Decision] = decide,
    report: Report | None = None,
) -> _Attempts:
    """Attempts at ``operation``: ``async for attempt in ...: with attempt: ...``.

    An exception raised in an attempt's block is retried when ``classify``
    calls it transient, the budget has attempts left and the next attempt
    can start before ``deadline`` (``anyio.current_time()`` terms). The wait
    is full-jitter exponential backoff, or the server's Retry-After when
    longer. Otherwise the exception propagates unchanged: the caller turns
    it into its own error. Each retry is logged and reported first (see module doc).
    """
    chosen = report or _reporter.get()
    return _Attempts(operation, budget, deadline=deadline, classify=classify, report=chosen)

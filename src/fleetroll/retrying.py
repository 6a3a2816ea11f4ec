"""One table for "is this failure worth another attempt", one Retry-After parser, one backoff.

Every caller that retries an outgoing call (provisioning, verification, MCP
connects, the OpenAI-compatible policy, the HTTP client) decides with
:func:`decide` and :func:`transient_status`, waits :func:`backoff_s`, and reads
the server's wish with :func:`retry_after_s`. The Fleet SDK's typed
exceptions are mapped onto this table in :mod:`fleetroll.provisioning`, the
only module that knows them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

import httpx
import httpx2

__all__ = ["Decision", "backoff_s", "decide", "retry_after_s", "transient_status"]

#: Statuses that say "later" rather than "never": timeouts, too early, too many.
_TRANSIENT_4XX = frozenset({408, 425, 429})


@dataclass(frozen=True, slots=True)
class Decision:
    """What one failure means for the next attempt."""

    transient: bool
    status_code: int | None = None
    retry_after_s: float | None = None


def transient_status(status: int) -> bool:
    """Whether an HTTP status is worth another attempt (408, 425, 429, 5xx)."""
    return status >= 500 or status in _TRANSIENT_4XX


def decide(exc: BaseException) -> Decision:
    """The generic part of the table: deadlines, transports, statuses, our own errors.

    Order: a deadline of ours, a transport failure, an HTTP status the
    exception carries (``status_code``), an explicit ``transient`` flag
    (fleetroll's own errors); anything else is permanent.
    """
    if isinstance(exc, TimeoutError | httpx.TransportError | httpx2.TransportError):
        return Decision(True)
    status = getattr(exc, "status_code", None)
    if isinstance(status, int):
        return Decision(transient_status(status), status)
    flag = getattr(exc, "transient", None)
    if isinstance(flag, bool):
        return Decision(flag)
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

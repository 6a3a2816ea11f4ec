"""The one retry table: which failures are worth another attempt, and how long to wait."""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
import httpx2
import pytest

from fleetroll.errors import PolicyError, ProvisionError
from fleetroll.retrying import backoff_s, decide, retry_after_s, transient_status

NOW = datetime(2026, 11, 23, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("status", "transient"),
    [
        (400, False),
        (401, False),
        (404, False),
        (409, False),
        (408, True),
        (425, True),
        (429, True),
        (500, True),
        (503, True),
        (599, True),
    ],
)
def test_statuses_that_say_later_are_transient(status: int, transient: bool) -> None:
    assert transient_status(status) is transient


class WithStatus(Exception):
    def __init__(self, status_code: int) -> None:
        self.status_code = status_code


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (TimeoutError(), True),
        (httpx.ConnectError("refused"), True),
        (httpx2.ReadTimeout("slow"), True),
        (WithStatus(503), True),
        (WithStatus(422), False),
        (ProvisionError("later", transient=True), True),
        (PolicyError("never", operation="policy", transient=False), False),
        (ValueError("a bug"), False),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_the_table_decides_from_deadline_transport_status_then_flag(
    exc: BaseException, transient: bool
) -> None:
    assert decide(exc).transient is transient


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after": "3"}, 3.0),
        ({"retry-after": "0.5"}, 0.5),
        ({"retry-after": "-4"}, 0.0),
        ({"retry-after-ms": "250", "retry-after": "9"}, 0.25),
        ({"retry-after-ms": "soon", "retry-after": "9"}, 9.0),
        ({"retry-after": "Mon, 23 Nov 2026 12:00:30 GMT"}, 30.0),
        ({"retry-after": "Mon, 23 Nov 2026 11:59:00 GMT"}, 0.0),
        ({"retry-after": "tomorrow"}, None),
        ({"retry-after": "inf"}, None),
        ({}, None),
    ],
)
def test_retry_after_reads_seconds_milliseconds_and_http_dates(
    headers: dict[str, str], expected: float | None
) -> None:
    assert retry_after_s(headers, now=NOW) == expected


def test_backoff_is_full_jitter_under_an_exponential_ceiling() -> None:
    waits = [backoff_s(4, initial_s=0.1, max_s=10.0) for _ in range(200)]
    assert all(0.0 <= w <= 0.8 for w in waits) and max(waits) > 0.4


def test_a_server_wish_replaces_the_backoff_up_to_the_cap() -> None:
    assert backoff_s(1, initial_s=0.1, max_s=10.0, retry_after=3.0) == 3.0
    assert backoff_s(1, initial_s=0.1, max_s=10.0, retry_after=60.0) == 10.0

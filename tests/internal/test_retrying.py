"""The one retry module: which failures are worth another attempt, how long to
wait, and every operation's retries through ``retrying.attempts`` (fast unit
tests: in-process fakes and ``httpx.MockTransport``, backoff 0 from the budget)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import anyio
import httpx
import httpx2
import pytest
import stamina.instrumentation
from fleet._async import exceptions as fe

from fleetroll._internal.retrying import (
    Budget,
    Operation,
    Retry,
    attempts,
    backoff_s,
    decide,
    reporting,
    retry_after_s,
    transient_status,
)
from fleetroll.client import FleetrollClient
from fleetroll.environments.fleet import verification
from fleetroll.errors import PolicyError, ProvisionError, ServiceError, ToolsError
from fleetroll.policies import OpenAIChatPolicy
from fleetroll.settings import load_settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry import Events, MemorySink, Redactor, Telemetry
from fleetroll.telemetry.retries import retry_emitter
from fleetroll.tools.session import open_tool_session

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


# -- retrying.attempts -------------------------------------------------------------

#: Three tries, no waits: tests never sleep for a backoff.
NO_WAIT = Budget(3, 0.0, 0.0)
TASK = TaskSpec(key="t", prompt="p", env_key="ledger", env_version="v1", data_key="seed")
SECRET = "sk-test-0123456789abcdef"


class Later(Exception):
    """A transient failure (a 503) that may carry the server's Retry-After."""

    def __init__(self, retry_after_s: float | None = None) -> None:
        super().__init__("HTTP 503: busy")
        self.status_code = 503
        self.retry_after_s = retry_after_s


async def run(
    operation: Operation,
    failures: list[BaseException],
    *,
    plan: Budget = NO_WAIT,
    deadline: float | None = None,
    report: Callable[[Retry], None] | None = None,
) -> int:
    """Run an operation that fails with ``failures`` (one per attempt), then succeeds.

    Returns how many attempts it took.
    """
    tries = 0
    async for attempt in attempts(operation, plan, deadline=deadline, report=report):
        with attempt:
            tries += 1
            if failures:
                raise failures.pop(0)
    return tries


async def test_a_transient_failure_is_retried_and_reported_once_with_its_operation() -> None:
    reports: list[Retry] = []
    assert await run("verify", [Later()], report=reports.append) == 2
    assert [(r.operation, r.attempt, type(r.error)) for r in reports] == [("verify", 1, Later)]


async def test_the_wait_is_the_servers_retry_after_when_longer_than_the_backoff() -> None:
    reports: list[Retry] = []
    await run("policy", [Later(retry_after_s=0.002)], report=reports.append)
    assert reports[0].delay_s == 0.002 and reports[0].decision.retry_after_s == 0.002


async def test_a_permanent_failure_is_not_retried_and_propagates_unchanged() -> None:
    reports: list[Retry] = []
    bug = ValueError("a bug")
    with pytest.raises(ValueError) as caught:
        await run("client", [bug], report=reports.append)
    assert caught.value is bug and reports == []


async def test_when_the_budget_runs_out_the_last_failure_propagates() -> None:
    reports: list[Retry] = []
    with pytest.raises(Later):
        await run("make", [Later(), Later(), Later(), Later()], report=reports.append)
    assert [r.attempt for r in reports] == [1, 2]  # 3 attempts, 2 retries


async def test_a_retry_that_could_not_start_before_the_deadline_is_not_made() -> None:
    reports: list[Retry] = []
    deadline = anyio.current_time() + 30
    with pytest.raises(Later):
        await run("policy", [Later(retry_after_s=60)], deadline=deadline, report=reports.append)
    assert reports == []


async def test_retries_go_to_the_reporter_bound_for_the_context() -> None:
    bound: list[Retry] = []
    with reporting(bound.append):
        await run("mcp_connect", [Later()])
    assert [r.operation for r in bound] == ["mcp_connect"]


async def test_without_a_reporter_a_retry_is_a_debug_record_on_the_retries_logger(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.DEBUG, logger="fleetroll.retries"):
        await run("client", [Later()])
    assert any("retry of client after attempt 1" in r.getMessage() for r in caplog.records)


@pytest.fixture
def stamina_defaults() -> Iterator[tuple[object, ...]]:
    """stamina's hooks as a fresh process has them (structlog's console line first)."""
    before = stamina.instrumentation.get_on_retry_hooks()
    stamina.instrumentation.set_on_retry_hooks(None)
    try:
        yield stamina.instrumentation.get_on_retry_hooks()
    finally:
        stamina.instrumentation.set_on_retry_hooks(before)


async def test_telemetry_and_retries_leave_stamina_s_process_wide_hooks_as_they_were(
    stamina_defaults: tuple[object, ...],
) -> None:
    """A library never changes a dependency's process-wide state: the retry is
    reported per call, to the telemetry bound where it happens."""
    sink = MemorySink()
    settings = load_settings(telemetry={"db_path": os.devnull, "send_to_logfire": False})
    with (
        Telemetry(
            settings.telemetry,
            secrets=settings.secrets(),
            logfire_token=settings.logfire_token,
            extra_sinks=[sink],
        ) as telemetry,
        reporting(retry_emitter(telemetry.events)),
    ):
        assert await run("verify", [Later()]) == 2
    assert stamina.instrumentation.get_on_retry_hooks() == stamina_defaults
    assert [e.attributes["operation"] for e in sink.named("fleet_retry")] == ["verify"]


def test_every_section_gives_its_operations_budgets_with_the_old_defaults() -> None:
    settings = load_settings()
    retries = settings.retries

    assert settings.provisioning.budget == Budget(5, 2.0, 60.0)  # creates and pre-flights
    assert retries.mcp_connect_budget == Budget(None, 0.05, 2.0)
    assert retries.list_tools_budget == Budget(3, 0.05, 2.0)
    assert retries.mcp_request_budget == Budget(3, 0.05, 2.0)
    assert retries.verify_budget == Budget(3, 0.2, 2.0)
    assert retries.judge_budget == Budget(3, 0.5, 10.0)


def test_fleet_retry_carries_the_operation_the_rollout_and_no_secret() -> None:
    sink = MemorySink()
    events = Events([sink], Redactor([SECRET]))
    failure = ExceptionGroup("a task group", [PolicyError(f"bad key {SECRET}", operation="policy")])
    retry = Retry("policy", 2, failure, 0.25, decide(Later()))
    with Events.bind(rollout_id="r-1", batch_id="b-1"):
        retry_emitter(events)(retry)
    (event,) = sink.named("fleet_retry")
    assert event.level == "debug"
    assert {k: event.attributes[k] for k in ("operation", "attempt", "error_type")} == {
        "operation": "policy",
        "attempt": 2,
        "error_type": "PolicyError",
    }
    assert event.attributes["retry_delay_s"] == 0.25 and event.attributes["status_code"] == 503
    assert (event.attributes["rollout_id"], event.attributes["batch_id"]) == ("r-1", "b-1")
    assert SECRET not in event.attributes["error_message"]
    assert "bad key" in event.attributes["error_message"]


# -- the policy ----------------------------------------------------------------------


def completion(content: str = "ok") -> httpx.Response:
    return httpx.Response(
        200, json={"choices": [{"message": {"role": "assistant", "content": content}}]}
    )


async def act_through(answers: list[httpx.Response]) -> tuple[list[Any], MemorySink, int]:
    """One policy turn against ``answers`` (in order); the outcome, the events, the requests."""
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return answers.pop(0)

    sink = MemorySink()
    outcome: list[Any] = []
    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http,
        OpenAIChatPolicy(
            base_url="http://model.test/v1",
            model="m",
            api_key=SECRET,
            max_retries=2,
            backoff_initial_s=0.0,
            backoff_max_s=0.0,
            timeout_s=30,
            http_client=http,
        ) as policy,
    ):
        with reporting(retry_emitter(Events([sink], Redactor([SECRET])))):
            try:
                outcome.append(await policy.act(TASK, [{"role": "user", "content": "hi"}], []))
            except PolicyError as exc:
                outcome.append(exc)
    return outcome, sink, len(requests)


async def test_a_policy_rate_limit_is_retried_after_its_retry_after_and_reported() -> None:
    limited = httpx.Response(429, text=f"slow down {SECRET}", headers={"retry-after-ms": "2"})
    (turn,), sink, requests = await act_through([limited, completion("recovered")])
    assert turn.content == "recovered" and requests == 2
    (event,) = sink.named("fleet_retry")
    attributes = event.attributes
    assert attributes["operation"] == "policy" and attributes["attempt"] == 1
    assert attributes["status_code"] == 429 and attributes["retry_delay_s"] == 0.002
    assert SECRET not in str(attributes)


async def test_a_policy_client_error_is_not_retried() -> None:
    (error,), sink, requests = await act_through([httpx.Response(400, text="too long")])
    assert isinstance(error, PolicyError) and error.transient is False
    assert requests == 1 and sink.named("fleet_retry") == []


async def test_a_policy_out_of_retries_fails_with_its_own_transient_error() -> None:
    (error,), sink, requests = await act_through([httpx.Response(503) for _ in range(3)])
    assert isinstance(error, PolicyError) and error.transient is True
    assert "HTTP 503" in str(error) and "(attempt 3 of 3)" in str(error)
    assert requests == 3 and len(sink.named("fleet_retry")) == 2


# -- the HTTP client of the service ------------------------------------------------


async def cancel_through(
    answers: list[httpx.Response], caplog: pytest.LogCaptureFixture
) -> tuple[ServiceError | None, int, list[str]]:
    """``DELETE /v1/batches/b1`` against ``answers``; its error, the requests, retry logs."""
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return answers.pop(0)

    error: ServiceError | None = None
    with caplog.at_level(logging.DEBUG, logger="fleetroll.retries"):
        async with (
            httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http,
            FleetrollClient(
                "http://service.test",
                max_retries=1,
                backoff_initial_s=0.0,
                backoff_max_s=0.0,
                http_client=http,
            ) as client,
        ):
            try:
                await client.batch("b1").cancel()
            except ServiceError as exc:
                error = exc
    logs = [r.getMessage() for r in caplog.records if r.name == "fleetroll.retries"]
    return error, len(requests), [m for m in logs if m.startswith("retry of")]


async def test_a_busy_service_is_retried_after_its_retry_after_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    busy = httpx.Response(503, json={"detail": "full"}, headers={"Retry-After": "0.002"})
    error, requests, logs = await cancel_through([busy, httpx.Response(200, json={})], caplog)
    assert error is None and requests == 2
    assert logs == ["retry of client after attempt 1 in 0.002 s: ServiceError"]


async def test_a_service_answer_that_says_never_is_not_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    error, requests, logs = await cancel_through(
        [httpx.Response(404, json={"detail": "no such batch"})], caplog
    )
    assert error is not None and error.status_code == 404 and requests == 1 and logs == []


async def test_a_service_busy_past_the_budget_fails_with_its_status(
    caplog: pytest.LogCaptureFixture,
) -> None:
    error, requests, logs = await cancel_through(
        [httpx.Response(503, json={"detail": "full"}) for _ in range(2)], caplog
    )
    assert error is not None and error.status_code == 503 and requests == 2 and len(logs) == 1


async def cancel_while_down(down: int, *, reconnect_s: float) -> tuple[ServiceError | None, int]:
    """``DELETE /v1/batches/b1`` to a service whose first ``down`` connections are
    refused (a restart), then answered; max_retries 1. Its error, the requests."""
    requests = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal requests
        requests += 1
        if requests <= down:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={})

    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http,
        FleetrollClient(
            "http://service.test",
            max_retries=1,
            backoff_initial_s=0.001,
            backoff_max_s=0.001,
            reconnect_s=reconnect_s,
            http_client=http,
        ) as client,
    ):
        try:
            with anyio.fail_after(30):
                await client.batch("b1").cancel()
        except ServiceError as exc:
            return exc, requests
    return None, requests


async def test_a_restarting_service_is_waited_for_past_max_retries_within_reconnect_s() -> None:
    error, requests = await cancel_while_down(20, reconnect_s=60)
    assert error is None and requests == 21


async def test_without_reconnect_s_an_unreachable_service_gets_max_retries_only() -> None:
    error, requests = await cancel_while_down(20, reconnect_s=0)
    assert error is not None and "gave up after 2 attempts" in str(error) and requests == 2


async def test_a_service_down_for_longer_than_reconnect_s_is_given_up_on() -> None:
    error, requests = await cancel_while_down(10**9, reconnect_s=0.05)
    assert error is not None and "ConnectError" in str(error) and requests > 2


def test_a_negative_reconnect_s_is_refused() -> None:
    with pytest.raises(ValueError, match="reconnect_s must be >= 0"):
        FleetrollClient("http://service.test", reconnect_s=-1)


# -- the verifier ----------------------------------------------------------------------


async def verify_through(
    failures: list[BaseException], monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, list[Retry], int]:
    """A verifier run whose remote execution fails with ``failures``, then scores 1."""
    calls: list[object] = []

    class RemoteFunction:  # the SDK's AsyncVerifierFunction, faked at the edge
        async def remote_with_response(self, env: object) -> SimpleNamespace:
            calls.append(env)
            if failures:
                raise failures.pop(0)
            return SimpleNamespace(
                success=True, execution_id="x1", stdout="", error=None, result=1.0
            )

    monkeypatch.setattr(
        verification, "_compile", lambda code, sha: verification._Compiled(RemoteFunction())
    )
    reports: list[Retry] = []
    verifier = verification.Verifier(
        timeout_s=30, max_source_bytes=10_000, budget=NO_WAIT, report=reports.append
    )
    task = TASK.model_copy(update={"verifier_func": "def verify(env):\n    return 1\n"})
    verdict = await verifier.verify(task, object(), None)
    return verdict, reports, len(calls)


async def test_a_verifier_run_rate_limited_once_is_retried_and_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    verdict, reports, calls = await verify_through([fe.FleetRateLimitError("slow")], monkeypatch)
    assert verdict.reward == 1.0 and calls == 2
    assert [(r.operation, r.attempt) for r in reports] == [("verify", 1)]


async def test_a_verifier_run_refused_as_a_bad_request_is_not_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    verdict, reports, calls = await verify_through([fe.FleetBadRequestError("bad")], monkeypatch)
    assert verdict.reward is None and verdict.error_type == "FleetBadRequestError"
    assert calls == 1 and reports == []


async def test_a_verifier_run_failing_past_the_budget_has_no_reward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    failures: list[BaseException] = [fe.FleetRateLimitError("slow") for _ in range(3)]
    verdict, reports, calls = await verify_through(failures, monkeypatch)
    assert verdict.reward is None and verdict.error_type == "FleetRateLimitError"
    assert calls == 3 and len(reports) == 2


# -- MCP connect ------------------------------------------------------------------------


async def connect_through(
    handler: Callable[[httpx2.Request], httpx2.Response], plan: Budget
) -> tuple[BaseException, list[Retry]]:
    reports: list[Retry] = []
    async with httpx2.AsyncClient(transport=httpx2.MockTransport(handler)) as http:
        with pytest.raises(Exception) as caught:
            async with open_tool_session(
                "http://mcp.test/mcp",
                http,
                connect_timeout_s=30,
                call_timeout_s=30,
                list_timeout_s=30,
                budget=plan,
                report=reports.append,
            ):
                pass
    return caught.value, reports


async def test_an_mcp_service_still_starting_is_retried_until_the_budget_runs_out() -> None:
    error, reports = await connect_through(lambda request: httpx2.Response(503), Budget(2, 0, 0))
    assert isinstance(error, ToolsError) and error.transient is True
    assert "in 2 attempts (retries.mcp_connect_attempts)" in str(error)
    assert [(r.operation, r.attempt, type(r.cause).__name__) for r in reports] == [
        ("mcp_connect", 1, "MCPError")
    ]


async def test_an_mcp_connect_failure_that_is_not_the_service_starting_is_not_retried() -> None:
    def handler(request: httpx2.Request) -> httpx2.Response:
        raise RuntimeError("a broken transport")

    error, reports = await connect_through(handler, NO_WAIT)
    assert isinstance(error, ToolsError) and error.transient is False and reports == []

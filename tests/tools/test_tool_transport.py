"""The MCP client's transport sends a request again only when it never left."""

from __future__ import annotations

import anyio
import httpx2
import pytest

from fleetroll._internal import retrying
from fleetroll._internal.retrying import Retry
from fleetroll.tools.session import RetryRefusedConnections

BUDGET = retrying.Budget(3, 0.0, 0.0)


def flaky(failures: list[Exception]) -> tuple[httpx2.MockTransport, list[bytes]]:
    """Raises ``failures`` in turn, then answers 200; records each body it got."""
    seen: list[bytes] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request.content)
        if failures:
            raise failures.pop(0)
        return httpx2.Response(200, json={"jsonrpc": "2.0", "id": 1, "result": {}})

    return httpx2.MockTransport(handler), seen


async def post(transport: httpx2.AsyncBaseTransport) -> httpx2.Response:
    async with httpx2.AsyncClient(transport=transport) as client:
        with anyio.fail_after(10):
            return await client.post("http://mcp.test/mcp", json={"method": "tools/call"})


async def test_a_call_whose_connection_was_refused_is_sent_again() -> None:
    inner, seen = flaky([httpx2.ConnectError("refused"), httpx2.ConnectTimeout("no SYN-ACK")])
    retried: list[Retry] = []
    response = await post(RetryRefusedConnections(inner, BUDGET, retried.append))
    assert response.status_code == 200 and len(seen) == 3 and len(set(seen)) == 1
    assert [r.operation for r in retried] == ["mcp_request", "mcp_request"]


@pytest.mark.parametrize(
    "failure", [httpx2.ReadError("reset after sending"), httpx2.ReadTimeout("no answer")]
)
async def test_a_call_that_failed_after_it_left_is_never_sent_again(failure: Exception) -> None:
    inner, seen = flaky([failure])
    with pytest.raises(type(failure)):
        await post(RetryRefusedConnections(inner, BUDGET))
    assert len(seen) == 1


async def test_refused_connections_stop_after_the_attempts() -> None:
    inner, seen = flaky([httpx2.ConnectError("refused") for _ in range(5)])
    with pytest.raises(httpx2.ConnectError):
        await post(RetryRefusedConnections(inner, BUDGET))
    assert len(seen) == 3


async def test_a_call_that_goes_through_first_time_opens_no_retry_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opened: list[str] = []
    real = retrying.attempts

    def counting(operation: retrying.Operation, *args: object, **kwargs: object) -> object:
        opened.append(operation)
        return real(operation, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(retrying, "attempts", counting)
    inner, seen = flaky([])
    response = await post(RetryRefusedConnections(inner, BUDGET))
    assert response.status_code == 200 and len(seen) == 1
    assert opened == []
    inner, seen = flaky([httpx2.ConnectError("refused")])
    response = await post(RetryRefusedConnections(inner, BUDGET))
    assert response.status_code == 200 and len(seen) == 2
    assert opened == ["mcp_request"]

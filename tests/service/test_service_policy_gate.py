"""The policy routes when a place policy calls start in does not confirm the gate
in time (an overloaded Ray actor): the route says so (504) and the service goes on.

The executor is the pool's test double with a gate that does not confirm
(``gate_synced`` raises as the Ray executor's does after ``timeouts.ray_call_s``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import httpx
import pytest

from fleetroll.errors import OperationTimeout
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.service import Service, create_app, serve_app
from fleetroll.settings import load_settings
from fleetroll.testing.fake_executor import FakeExecutor

pytestmark = pytest.mark.anyio


class Unconfirmed(FakeExecutor):
    """Its remote places stop confirming the policy gate once ``unconfirmed`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.unconfirmed = False

    async def gate_synced(self) -> None:
        if self.unconfirmed:
            raise OperationTimeout(
                "a Ray actor did not confirm the policy gate within 0.1 s (timeouts.ray_call_s)",
                operation="policy_gate",
                timeout_s=0.1,
            )


@pytest.fixture
async def service() -> AsyncIterator[tuple[httpx.AsyncClient, Unconfirmed]]:
    settings = load_settings()
    executor = Unconfirmed()
    async with RolloutPool(settings, executor=executor) as pool:
        service = Service(pool, settings)
        async with (
            serve_app(create_app(service), "127.0.0.1", 0, before_stop=service.stop) as url,
            httpx.AsyncClient(base_url=url, timeout=10) as http,
        ):
            yield http, executor


async def test_an_unconfirmed_version_or_pause_answers_504_and_the_service_goes_on(
    service: tuple[httpx.AsyncClient, Unconfirmed],
) -> None:
    http, executor = service
    with anyio.fail_after(10):
        held = await http.post("/v1/policy/pauses", json={"ttl_s": 60})
        executor.unconfirmed = True
        # Its end not confirmed: the pause is over here, and the service goes on.
        ended = await http.delete(f"/v1/policy/pauses/{held.json()['pause_id']}")
        version = await http.put("/v1/policy/version", json={"version": 5})
        pause = await http.post("/v1/policy/pauses", json={"ttl_s": 60})
        state = await http.get("/v1/policy")
    assert held.status_code == 201 and ended.status_code == 200
    assert version.status_code == 504 and "timeouts.ray_call_s" in version.json()["detail"]
    assert pause.status_code == 504
    # The version is set (it reaches the actor later); no pause is held.
    assert state.json() == {"version": 5, "paused": False, "pauses": 0}

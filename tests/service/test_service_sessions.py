"""Env-style sessions over HTTP: stepped, closed with a reward, expired when idle."""

from __future__ import annotations

import anyio
import pytest
from service_helpers import LEDGER, Running, running_service, task_record

from fleetroll.client import FleetrollClient
from fleetroll.emulator import Emulator
from fleetroll.results import FailureReason

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow


async def test_a_session_driven_step_by_step_closes_with_the_reward(
    served: Running, emulator: Emulator
) -> None:
    task = LEDGER[0]
    async with FleetrollClient(served.url) as client:
        with anyio.fail_after(60):
            async with client.session(task) as env:
                messages = await env.reset()
                assert messages == [{"role": "user", "content": task.prompt}]
                assert "record_transaction" in {t.name for t in env.tools}
                for step in task.solution or ():
                    result = await env.step({"name": step.name, "arguments": step.arguments})
                    assert not result.observation.is_error, result.observation.text
                    assert [m["role"] for m in result.messages] == ["assistant", "tool"]
                unknown = await env.step({"name": "no_such_tool", "arguments": {}})
                assert unknown.observation.is_error
                result = await env.close()
            assert await env.close() == result  # closing again: the same result
    assert result is not None and result.reward == 1.0
    assert result.task_key == task.key and result.steps == len(task.solution or ()) + 1
    assert emulator.ledger.running == 0


async def test_an_idle_session_expires_and_releases_its_instance(emulator: Emulator) -> None:
    async with (
        running_service(emulator, service={"session_idle_s": 0.2}) as served,
        served.http() as http,
    ):
        with anyio.fail_after(60):
            opened = await http.post("/v1/sessions", json={"task": task_record(LEDGER[1])})
            session_id = opened.json()["session_id"]
            assert opened.status_code == 201 and emulator.ledger.running >= 1
            await served.service.sessions.wait_ended(session_id)
            assert emulator.ledger.running == 0
            step = await http.post(
                f"/v1/sessions/{session_id}/step", json={"name": "list_accounts"}
            )
            closed = await http.delete(f"/v1/sessions/{session_id}")
            unknown = await http.delete("/v1/sessions/nope")
    assert step.status_code == 410 and "idle" in step.json()["detail"]
    result = closed.json()
    assert closed.status_code == 200 and result["failure_reason"] == FailureReason.ABANDONED
    assert result["reward"] == 0.0  # scored on close: nothing was done, a real zero
    assert unknown.status_code == 404


async def test_a_session_on_an_unknown_environment_is_a_422(served: Running) -> None:
    task = {**task_record(LEDGER[0]), "env_key": "no-such-env:v1"}
    async with served.http() as http:
        with anyio.fail_after(60):
            response = await http.post("/v1/sessions", json={"task": task})
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", "task", "env_key"]


async def test_a_session_ended_with_done_is_completed_and_one_closed_without_it_abandoned(
    served: Running, emulator: Emulator
) -> None:
    task = LEDGER[0]
    results = []
    async with FleetrollClient(served.url) as client:
        with anyio.fail_after(60):
            for say_done in (True, False):
                async with client.session(task) as env:
                    for step in task.solution or ():
                        await env.step({"name": step.name, "arguments": step.arguments})
                    if say_done:
                        await env.done()
                        after = await env.step({"name": "list_accounts", "arguments": {}})
                        assert after.done and after.observation.text == "The episode is over."
                results.append(await env.close())
        async with served.http() as http:
            unknown = await http.post("/v1/sessions/nope/done")
    completed, abandoned = results
    assert completed is not None and completed.status == "completed"
    assert completed.failure_reason is None and completed.reward == 1.0
    assert abandoned is not None and abandoned.failure_reason is FailureReason.ABANDONED
    assert unknown.status_code == 404
    assert emulator.ledger.running == 0

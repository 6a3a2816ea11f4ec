"""A rollout's live events over HTTP, MCP progress notifications and the client's follow."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
from mcp import Client
from service_helpers import LEDGER, GatedPolicy, Running, task_record
from test_service_batches import DroppingProxy, proxy  # noqa: F401  (a fixture)

from fleetroll.client import FleetrollClient
from fleetroll.emulator import Emulator
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import rollout_id
from fleetroll.service import app as service_app

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

PHASES = ["provisioning", "waiting", "resetting", "connecting", "acting"]
END_PHASES = ["verifying", "releasing", "done"]


def phases(events: list[dict[str, Any]]) -> list[str]:
    return [e["phase"] for e in events if e["kind"] == "phase"]


async def test_the_events_stream_delivers_every_phase_in_order_and_resumes_from_a_cursor(
    served: Running, emulator: Emulator
) -> None:
    task = LEDGER[5]
    async with FleetrollClient(served.url) as client, served.http() as http:
        batch = client.run_batch([task], ScriptedPolicy())
        with anyio.fail_after(60):
            await batch.results()
        rid = rollout_id(batch.batch_id, task.key, 0)
        whole = await http.get(f"/v1/rollouts/{rid}/events")
        rest = await http.get(f"/v1/rollouts/{rid}/events", params={"after": 3})
        ahead = await http.get(f"/v1/rollouts/{rid}/events", params={"after": 999})
        unknown = await http.get("/v1/rollouts/nope/events")

    assert whole.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in whole.text.splitlines()]
    events = [line["event"] for line in lines]
    assert [line["cursor"] for line in lines] == list(range(1, len(lines) + 1))
    assert phases(events) == PHASES + END_PHASES
    assert {"turn", "tool_call"} <= {e["kind"] for e in events}
    assert events[-1]["kind"] == "end" and events[-1]["reward"] == 1.0
    assert [json.loads(line) for line in rest.text.splitlines()] == lines[3:]
    assert ahead.status_code == 422 and "this rollout's" in ahead.text
    assert unknown.status_code == 404 and "no rollout 'nope'" in unknown.text
    assert emulator.ledger.running == 0


async def test_the_client_follows_a_rollout_across_a_cut_with_nothing_lost_or_twice(
    proxy: DroppingProxy,  # noqa: F811
    emulator: Emulator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    task = LEDGER[6]
    policy = GatedPolicy(held={task.key})
    monkeypatch.setattr(service_app, "build_policy", lambda config, settings: policy)
    async with FleetrollClient(proxy.url, backoff_initial_s=0.01) as client:
        batch = await client.run_batch([task]).submit()
        events = []
        with anyio.fail_after(60):
            async for event in client.follow(rollout_id(batch.batch_id, task.key, 0)):
                events.append(event)
                if event.kind == "phase" and event.data["phase"] == "acting":
                    proxy.drop()  # the policy is held: nothing else can have been sent
                    policy.release.set()
            await batch.results()

    assert client.event_reconnects >= 1 and proxy.connections >= 2
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert [e.data["phase"] for e in events if e.kind == "phase"] == PHASES + END_PHASES
    assert events[-1].kind == "end" and events[-1].data["status"] == "completed"
    assert emulator.ledger.running == 0


async def test_run_rollout_sends_progress_notifications_to_an_mcp_client(
    served: Running, emulator: Emulator
) -> None:
    received: list[tuple[float, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        received.append((progress, message))

    with anyio.fail_after(60):
        async with Client(f"{served.url}/mcp") as mcp:
            result = await mcp.call_tool(
                "run_rollout", {"task": task_record(LEDGER[7])}, progress_callback=on_progress
            )

    assert not result.is_error
    messages = [m or "" for _, m in received]
    assert [m.removeprefix("phase ") for m in messages if m.startswith("phase ")] == (
        PHASES + END_PHASES
    )
    assert any(m.startswith("tool ") for m in messages)
    assert messages[-1] == "end: completed"
    assert [p for p, _ in received] == sorted({p for p, _ in received})
    assert emulator.ledger.running == 0

"""Training data from batches over HTTP, built as ``fleetroll run`` builds it: an agent
command (the example agent, refused unless allowed), trajectories, token-in mode.

Real HTTP everywhere: the service on loopback, the vLLM-shaped fake server, the
embedded emulator and its MCP servers.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from service_helpers import LEDGER, running_service

from fleetroll.client import FleetrollClient, ServiceError
from fleetroll.emulator import Emulator
from fleetroll.testing.fake_openai import FakeChatServer, VllmShape
from training_helpers import sent_and_recorded, solving

pytestmark = pytest.mark.slow

AGENT = Path(__file__).resolve().parents[2] / "examples" / "agent_openai_mcp.py"
TASKS = LEDGER[:2]


def openai_policy(server: FakeChatServer, **more: Any) -> dict[str, Any]:
    return {"kind": "openai", "base_url": server.base_url, "model": "served", **more}


async def test_a_batch_with_an_agent_command_is_refused_unless_the_service_allows_it(
    emulator: Emulator,
) -> None:
    async with (
        FakeChatServer(solving(TASKS), vllm=VllmShape()) as server,
        running_service(emulator, policy=openai_policy(server)) as running,
        FleetrollClient(running.url, timeout_s=60) as client,
    ):
        batch = client.run_batch(TASKS, agent_command=[sys.executable, str(AGENT)])
        with anyio.fail_after(60), pytest.raises(ServiceError) as refused:
            await batch.submit()
        async with running.http() as http:
            answer = await http.post(
                "/v1/batches",
                json={"tasks_file": "none.jsonl", "agent_command": f"{sys.executable} agent.py"},
            )
    assert refused.value.status_code == 422
    assert "service.allow_command_tasks = false" in str(refused.value)
    assert answer.status_code == 422
    (problem,) = answer.json()["detail"]
    assert problem["loc"] == ["body", "agent_command"]
    assert "\n" not in problem["msg"]
    assert server.requests == []  # nothing ran
    assert emulator.ledger.running == 0


async def test_an_allowed_agent_command_scores_every_task_with_the_server_s_exact_token_ids(
    emulator: Emulator,
) -> None:
    training = {"return_token_ids": True, "logprobs": True}
    async with FakeChatServer(solving(TASKS), vllm=VllmShape()) as server:
        async with (
            running_service(
                emulator,
                service={"allow_command_tasks": True},
                policy=openai_policy(server, **training),
            ) as running,
            FleetrollClient(running.url, timeout_s=60) as client,
        ):
            batch = client.run_batch(
                TASKS, samples_per_task=2, agent_command=[sys.executable, str(AGENT)]
            )
            with anyio.fail_after(180):
                results = await batch.results()
        replies, requests = list(server.replies), list(server.requests)

    assert sorted((r.task_key, r.status, r.reward) for r in results) == sorted(
        (t.key, "completed", 1.0) for t in TASKS for _ in range(2)
    )
    sent, recorded = sent_and_recorded(replies, results)
    assert recorded == sent
    assert sum(len(r.turns) for r in results) == len(replies) == len(requests)
    # The agent's calls asked for the training data the service's settings ask for.
    assert all(q["return_token_ids"] and q["logprobs"] and q["model"] == "served" for q in requests)
    # Each result (as streamed over HTTP) keeps the tools the agent sent, and no system
    # prompt: the example agent sends none.
    assert requests[0]["tools"]
    assert all(r.tools == requests[0]["tools"] and r.system_prompt is None for r in results)
    assert emulator.ledger.running == 0


async def test_a_service_batch_builds_its_policy_as_the_cli_does_trajectory_and_token_in(
    emulator: Emulator,
) -> None:
    shape = VllmShape(drift=True, token_in=True)
    async with FakeChatServer(solving(TASKS), vllm=shape) as server:
        async with (
            running_service(
                emulator, policy=openai_policy(server, trajectory=True, token_in=True)
            ) as running,
            FleetrollClient(running.url, timeout_s=60) as client,
        ):
            with anyio.fail_after(120):
                results = await client.run_batch(TASKS).results()
        requests, tokenized = list(server.requests), list(server.tokenize_requests)

    assert [r.reward for r in results] == [1.0, 1.0]
    for result in results:
        trajectory = result.trajectory
        assert trajectory is not None and trajectory.input_ids
        # Token-in keeps the conversation as ids: a drifting template does not drift.
        assert trajectory.drift is False
        generated = [
            i for i, m in zip(trajectory.input_ids, trajectory.loss_mask, strict=True) if m
        ]
        assert generated == [i for t in result.turns for i in t.completion_token_ids or []]
    # Every call after a rollout's first went by the token route, with ids fleetroll sent.
    assert tokenized and any("tokens" in q for q in requests)
    assert emulator.ledger.running == 0

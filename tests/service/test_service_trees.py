"""Rollout trees over HTTP (``POST /v1/trees``): the same tree as ``RolloutPool.run_tree``.

Real HTTP everywhere: ``fleetroll serve`` as a child (or the service in this
process, for the refusals), the embedded emulator, and a vLLM-shaped fake
policy server whose answers make the branches go different ways.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from service_helpers import LEDGER, TOKEN, free_port, running_service, serving, task_record

from fleetroll.client import FleetrollClient, ServiceError
from fleetroll.emulator import Emulator
from fleetroll.policies import OpenAIChatPolicy
from fleetroll.pool.assembly import chat_policy_config
from fleetroll.pool.rollout_pool import RolloutPool, Tree, rollout_id
from fleetroll.results import FailureReason
from fleetroll.settings import load_settings
from fleetroll.testing.fake_openai import FakeChatServer, VllmShape, completion, tool_call

pytestmark = pytest.mark.slow

#: Three record_transaction-like steps and an invoice: rent first (the shared prefix).
MONTH_END = next(t for t in LEDGER if t.key == "ledger-010")


class Split:
    """A policy server's script: the root makes the month-end's first step; of the
    branches (numbered by their first own call), the even ones play the rest of the
    solution and the odd ones answer "done" at once."""

    def __init__(self) -> None:
        self.branches = 0

    def __call__(self, body: dict[str, Any]) -> Any:
        steps = MONTH_END.solution or ()
        made = sum(1 for m in body.get("messages") or () if m.get("role") == "assistant")
        if made == 1:  # a branch's first own call, just after the prefix
            self.branches += 1
            if self.branches % 2 == 0:
                return completion("done")
        if made < len(steps):
            step = steps[made]
            return completion(tool_calls=[tool_call(step.name, dict(step.arguments))])
        return completion("done")


def openai_policy(server: FakeChatServer) -> dict[str, Any]:
    return {"kind": "openai", "base_url": server.base_url, "model": "served"}


async def library_tree(emulator: Emulator) -> Tree:
    """The tree ``RolloutPool.run_tree`` gives, on its own policy server."""
    async with FakeChatServer(Split(), vllm=VllmShape()) as server:
        settings = load_settings(policy=openai_policy(server))
        async with (
            RolloutPool(settings, api_key=emulator.api_key, base_url=emulator.base_url) as pool,
            OpenAIChatPolicy.from_config(chat_policy_config(settings)) as policy,
        ):
            return await pool.run_tree(MONTH_END, policy, branch_at=1, width=4)


def shape(tree: Tree) -> dict[str, Any]:
    """What a tree is, ids aside: its root, and its branches in a stable order."""
    root = tree.root
    branches = sorted(tree.branches, key=lambda b: (b.reward or 0.0, len(b.transcript)))
    return {
        "root": (
            root.failure_reason,
            root.steps,
            root.reward,
            [m["role"] for m in root.transcript],
        ),
        "branches": [
            (b.failure_reason, b.status, b.reward, b.steps, b.branch_step, b.prefix_messages)
            for b in branches
        ],
        "groups": [sorted(g.rewards) for g in tree.groups],
    }


async def test_an_http_tree_from_fleetroll_serve_equals_the_library_s(
    emulator: Emulator, tmp_path: Path
) -> None:
    with anyio.fail_after(180):
        local = await library_tree(emulator)
        port = free_port()
        async with (
            FakeChatServer(Split(), vllm=VllmShape()) as server,
            serving(tmp_path, port, emu=emulator),
            FleetrollClient(f"http://127.0.0.1:{port}", token=TOKEN) as client,
        ):
            remote = client.start_tree(
                MONTH_END, openai_policy(server), branch_at=1, width=4, tree_id="month-end"
            )
            async with remote:
                streamed = [r async for r in remote]
                tree = await remote.tree()
            again = await client.run_tree(
                MONTH_END, openai_policy(server), branch_at=1, width=4, tree_id="month-end"
            )

    assert shape(tree) == shape(local)
    root = tree.root
    assert root.failure_reason is FailureReason.MAX_STEPS and root.steps == 1
    assert root.batch_id == "month-end-root" and remote.root_batch_id == "month-end-root"
    # The root first on the stream, then the branches as they ended: the tree's own order.
    assert [r.rollout_id for r in streamed] == [
        root.rollout_id,
        *(b.rollout_id for b in tree.branches),
    ]
    assert len(tree.branches) == 4
    for branch in tree.branches:
        assert branch.batch_id == "month-end-b1"
        assert branch.parent_rollout_id == root.rollout_id
        assert branch.branch_step == 1 and branch.prefix_messages == len(root.transcript)
        # The prefix replayed equal, then each its own way and its own verifier's reward.
        assert branch.transcript[: len(root.transcript)] == root.transcript
        assert branch.failure_reason is None, branch.error
    assert sorted(b.reward for b in tree.branches) == [0.0, 0.0, 1.0, 1.0]
    for branch in tree.branches:
        solved = len(branch.transcript) > len(root.transcript) + 1
        assert branch.reward == (1.0 if solved else 0.0)
    [group] = tree.groups
    assert sorted(r.rollout_id for r in group.results) == sorted(
        b.rollout_id for b in tree.branches
    )
    # The same request again is the same tree, not a second one.
    assert again.root.rollout_id == root.rollout_id
    assert [b.rollout_id for b in again.branches] == [b.rollout_id for b in tree.branches]


def _tree(**fields: Any) -> dict[str, Any]:
    return {"task": task_record(MONTH_END), "branch_at": 1, "width": 2, **fields}


async def test_bad_trees_are_refused_each_with_one_clear_line(emulator: Emulator) -> None:
    async with (
        running_service(emulator) as running,
        running.http() as http,
        FleetrollClient(running.url) as client,
    ):
        answers = {
            "branch_at": await http.post("/v1/trees", json=_tree(branch_at=0)),
            "width": await http.post("/v1/trees", json=_tree(width=0)),
            "agent_command": await http.post("/v1/trees", json=_tree(agent_command=["agent"])),
            "wide": await http.post("/v1/trees", json=_tree(width=100_000)),
            "task": await http.post("/v1/trees", json=_tree(task={"key": "k", "prompt": "p"})),
        }
        unknown = [
            await http.get("/v1/trees/nope"),
            await http.delete("/v1/trees/nope"),
            await http.get("/v1/trees/nope/results"),
        ]
        with pytest.raises(ServiceError) as refused:
            await client.run_tree(MONTH_END, branch_at=0, width=4)
    for name, answer in answers.items():
        assert answer.status_code == 422, name
        [problem] = answer.json()["detail"]
        assert "\n" not in problem["msg"], name
    where = {name: answer.json()["detail"][0]["loc"] for name, answer in answers.items()}
    assert where["branch_at"] == ["body", "branch_at"]
    assert where["width"] == ["body", "width"]
    assert where["wide"] == ["body", "width"]
    assert where["agent_command"] == ["body", "agent_command"]
    assert "cannot be branched" in answers["agent_command"].json()["detail"][0]["msg"]
    assert where["task"][:2] == ["body", "task"]
    for answer in unknown:
        assert answer.status_code == 404
        detail = answer.json()["detail"]
        assert "no tree 'nope'" in detail and "\n" not in detail
    assert refused.value.status_code == 422 and "branch_at" in str(refused.value)
    assert emulator.ledger.running == 0  # nothing ran


async def test_a_cancelled_tree_ends_its_root_cancelled_and_starts_no_branch(
    emulator: Emulator,
) -> None:
    slow = {"kind": "scripted", "think_time_s": 3600}
    async with running_service(emulator) as running, running.http() as http:
        created = await http.post("/v1/trees", json=_tree(tree_id="slow", policy=slow))
        twin = await http.post("/v1/trees", json=_tree(tree_id="slow", policy=slow))
        other = await http.post("/v1/trees", json=_tree(tree_id="slow", width=3, policy=slow))
        running_state = (await http.get("/v1/trees/slow")).json()
        # Its rollouts' live events are served as a batch's are.
        root_id = rollout_id("slow-root", MONTH_END.key, 0)
        with anyio.fail_after(30):
            async with http.stream("GET", f"/v1/rollouts/{root_id}/events") as events:
                first = json.loads(await anext(events.aiter_lines()))
        cancelled = await http.delete("/v1/trees/slow")
        with anyio.fail_after(60):
            lines = (await http.get("/v1/trees/slow/results")).text.splitlines()
        state = (await http.get("/v1/trees/slow")).json()
    assert created.status_code == 201 and created.json()["created"] is True
    assert created.json()["rollouts"] == 3
    assert created.json()["branches_batch_id"] == "slow-b1"
    assert twin.status_code == 200 and twin.json()["created"] is False
    assert other.status_code == 409 and "already exists" in other.json()["detail"]
    assert running_state["status"] == "running" and running_state["root"] is None
    assert events.status_code == 200
    assert first["type"] == "event" and first["event"]["kind"] == "phase"
    assert cancelled.status_code == 202 and cancelled.json()["cancel_requested"] is True
    [root_line, end] = [json.loads(line) for line in lines if "heartbeat" not in line]
    assert root_line["cursor"] == 1
    assert root_line["result"]["failure_reason"] == "cancelled"
    assert end == {"type": "end", "cursor": 1, "status": "cancelled"}
    assert state["status"] == "cancelled" and state["branches"] == [] and state["groups"] == []


async def test_a_client_that_leaves_a_tree_before_its_end_cancels_it(emulator: Emulator) -> None:
    slow = {"kind": "scripted", "think_time_s": 3600}
    async with running_service(emulator) as running, FleetrollClient(running.url) as client:
        with anyio.fail_after(60):
            async with client.start_tree(MONTH_END, slow, branch_at=1, width=2) as tree:
                assert (await tree.status()).status == "running"
            [root] = [
                r
                async for r in client.start_tree(
                    MONTH_END, slow, branch_at=1, width=2, tree_id=tree.tree_id
                )
            ]
            state = await tree.status()
    assert state.status == "cancelled" and state.cancel_requested
    assert root.failure_reason is FailureReason.CANCELLED
    assert state.root == root and state.branches == []

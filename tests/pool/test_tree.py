"""RolloutPool.run_tree: a prefix replayed on fresh or reset instances, then branches.

Against the emulator over loopback: the ledger's three-step month-end task,
branched after its first step into four branches that go on differently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from fleetroll.emulator import Emulator, FaultProfile
from fleetroll.policies import AssistantTurn, OpenAIChatPolicy, ScriptedPolicy, ToolSpec
from fleetroll.pool.assembly import chat_policy_config
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import TaskSpec, load_tasks
from fleetroll.testing.fake_openai import FakeChatServer, VllmShape, completion, tool_call
from fleetroll.training.trajectory import training_rows

pytestmark = pytest.mark.slow

SETTINGS = load_settings()
TASKS = {
    t.key: t
    for t in load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)
}
#: Three record_transaction-like steps and an invoice: rent first (the shared prefix).
MONTH_END = TASKS["ledger-010"]


class SplitPolicy:
    """Branches that differ: the even-numbered ones (in the order their first
    own call came) play the rest of the solution, the odd ones stop at once."""

    def __init__(self) -> None:
        self.scripted = ScriptedPolicy()
        self.branches: dict[int, tuple[int, Sequence[Any]]] = {}

    def number(self, messages: Sequence[Any]) -> int:
        # Each rollout has its own transcript object; holding it keeps its id unique.
        key = id(messages)
        if key not in self.branches:
            self.branches[key] = (len(self.branches), messages)
        return self.branches[key][0]

    async def act(
        self, task: TaskSpec, messages: Sequence[Any], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        if self.number(messages) % 2:
            return AssistantTurn(content="done")
        return await self.scripted.act(task, messages, tools)

    async def aclose(self) -> None:
        pass


def pool_for(emu: Emulator) -> RolloutPool:
    return RolloutPool(SETTINGS, api_key=emu.api_key, base_url=emu.base_url)


async def test_four_branches_replay_the_prefix_equal_then_diverge_each_with_its_own_reward() -> (
    None
):
    async with Emulator() as emu, pool_for(emu) as pool:
        with anyio.fail_after(120):
            # The root is rollout 0 of the split (it plays the solution's first step).
            tree = await pool.run_tree(MONTH_END, SplitPolicy(), branch_at=1, width=4)
    root = tree.root
    # The root is the prefix: stopped at its branch point, scored on that state.
    assert root.failure_reason is FailureReason.MAX_STEPS and root.steps == 1
    assert root.reward == 0.0 and root.parent_rollout_id is None
    assert len(tree.branches) == 4
    prefix = len(root.transcript)
    assert [m["role"] for m in root.transcript] == ["user", "assistant", "tool"]
    for branch in tree.branches:
        assert branch.parent_rollout_id == root.rollout_id
        assert branch.branch_step == 1 and branch.prefix_messages == prefix
        # The prefix replayed equal: the same call, the same answer (its random reference too).
        assert branch.transcript[:prefix] == root.transcript
        assert branch.failure_reason is None, branch.error
    # After the prefix they went their own ways, and each got its own verifier's reward.
    solved = [b for b in tree.branches if len(b.transcript) > prefix + 1]
    stopped = [b for b in tree.branches if len(b.transcript) == prefix + 1]
    assert len(solved) == 2 and len(stopped) == 2
    assert all(b.reward == 1.0 and b.steps == 4 for b in solved)
    assert all(b.reward == 0.0 and b.steps == 1 for b in stopped)
    assert all(b.transcript[prefix] == {"role": "assistant", "content": "done"} for b in stopped)
    # One group for the branch point: the four branches.
    [group] = tree.groups
    assert sorted(r.rollout_id for r in group.results) == sorted(
        b.rollout_id for b in tree.branches
    )
    assert sorted(group.rewards) == [0.0, 0.0, 1.0, 1.0] and not group.uniform
    assert {b.group_id for b in tree.branches} == {group.group_id}


async def test_a_nondeterministic_environment_gives_replay_diverged_never_a_reward() -> None:
    async with Emulator(FaultProfile(unseeded_random=True)) as emu, pool_for(emu) as pool:
        with anyio.fail_after(120):
            tree = await pool.run_tree(MONTH_END, ScriptedPolicy(), branch_at=1, width=4)
    assert tree.root.failure_reason is FailureReason.MAX_STEPS
    assert len(tree.branches) == 4
    for branch in tree.branches:
        assert branch.failure_reason is FailureReason.REPLAY_DIVERGED
        assert branch.reward is None and branch.status == "failed"
        assert branch.error is not None and "step 1" in branch.error
        assert "reference" in branch.error
        # It stopped at the divergence: nothing sampled after it.
        assert len(branch.transcript) == len(tree.root.transcript)
    [group] = tree.groups
    assert group.results == [] and group.failed == 4 and not group.complete


async def test_a_seeded_task_replays_equal_on_the_same_nondeterministic_environment() -> None:
    seeded = MONTH_END.model_copy(update={"seed": 7, "timestamp": 1_764_547_200})
    async with Emulator(FaultProfile(unseeded_random=True)) as emu, pool_for(emu) as pool:
        with anyio.fail_after(120):
            tree = await pool.run_tree(seeded, ScriptedPolicy(), branch_at=1, width=2)
    assert len(tree.branches) == 2
    for branch in tree.branches:
        assert branch.failure_reason is None and branch.reward == 1.0, branch.error
        assert branch.transcript[: branch.prefix_messages] == tree.root.transcript


async def test_a_root_that_ends_before_the_branch_point_has_no_branches() -> None:
    async with Emulator() as emu, pool_for(emu) as pool:
        with anyio.fail_after(60):
            tree = await pool.run_tree(TASKS["ledger-001"], ScriptedPolicy(), branch_at=3, width=2)
    assert tree.root.status == "completed" and tree.root.steps == 1
    assert tree.branches == [] and tree.groups == []


async def test_start_tree_gives_the_root_then_each_branch_as_it_ends_and_the_tree() -> None:
    async with Emulator() as emu, pool_for(emu) as pool:
        with anyio.fail_after(120):
            run = pool.start_tree(MONTH_END, ScriptedPolicy(), branch_at=1, width=2, tree_id="t")
            async with run:
                results = [r async for r in run]
    assert run.tree is not None
    assert [r.batch_id for r in results] == ["t-root", "t-b1", "t-b1"]
    assert results == [run.tree.root, *run.tree.branches]
    assert [b.batch_id for b in run.batches] == ["t-root", "t-b1"]
    [group] = run.tree.groups
    assert group.rewards == [1.0, 1.0]


async def test_a_tree_cancelled_once_its_root_ended_starts_no_branch() -> None:
    async with Emulator() as emu, pool_for(emu) as pool:
        with anyio.fail_after(60):
            run = pool.start_tree(MONTH_END, ScriptedPolicy(), branch_at=1, width=2)
            async with run:
                root = await anext(run)
                run.cancel()
                rest = [r async for r in run]
    assert root.failure_reason is FailureReason.MAX_STEPS
    assert rest == [] and len(run.batches) == 1
    assert run.tree is not None and run.tree.branches == [] and run.tree.groups == []


async def test_run_tree_refuses_a_branch_point_or_width_below_one() -> None:
    async with RolloutPool(SETTINGS, api_key="unused", base_url="http://127.0.0.1:9") as pool:
        with pytest.raises(ValueError, match="branch_at must be at least 1"):
            await pool.run_tree(MONTH_END, ScriptedPolicy(), branch_at=0, width=2)
        with pytest.raises(ValueError, match="width must be at least 1"):
            await pool.run_tree(MONTH_END, ScriptedPolicy(), branch_at=1, width=0)
        with pytest.raises(ValueError, match=r"an agent of its own .* cannot be branched"):
            await pool.run_tree(MONTH_END, OwnAgent(), branch_at=1, width=2)  # type: ignore[arg-type]


class OwnAgent:
    """An agent that acts by itself (as an agent command does)."""

    async def drive(self, rollout: Any) -> None:
        raise AssertionError("never run: refused before")


def _first_step_then_done(body: dict[str, Any]) -> Any:
    """The root's call makes the month-end's first step; a branch's own call answers."""
    step = (MONTH_END.solution or ())[0]
    if not any(m.get("role") == "assistant" for m in body.get("messages") or ()):
        return completion(tool_calls=[tool_call(step.name, dict(step.arguments), id="call_0")])
    return completion("done")


@pytest.mark.parametrize("token_in", [False, True], ids=["chat", "token_in"])
async def test_branch_rows_hold_the_prefix_once_masked_out_and_their_own_tokens(
    token_in: bool,
) -> None:
    async with (
        Emulator() as emu,
        FakeChatServer(_first_step_then_done, vllm=VllmShape(token_in=token_in)) as server,
    ):
        settings = load_settings(
            policy={
                "kind": "openai",
                "base_url": server.base_url,
                "return_token_ids": True,
                "logprobs": True,
                "trajectory": True,
                "token_in": token_in,
            }
        )
        async with (
            RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url) as pool,
            OpenAIChatPolicy.from_config(chat_policy_config(settings)) as policy,
        ):
            with anyio.fail_after(120):
                tree = await pool.run_tree(MONTH_END, policy, branch_at=1, width=4)
    [prefix_turn] = tree.root.turns
    prefix_ids = [*(prefix_turn.prompt_token_ids or []), *(prefix_turn.completion_token_ids or [])]
    assert len(tree.branches) == 4
    for branch in tree.branches:
        assert branch.failure_reason is None and branch.reward == 0.0, branch.error
        # Its turns are its own call only; its prompt continues the prefix's very tokens.
        [own] = branch.turns
        assert own.prompt_token_ids is not None and own.completion_token_ids is not None
        assert branch.prefix_tokens == len(own.prompt_token_ids) > len(prefix_ids)
        assert own.prompt_token_ids[: len(prefix_ids)] == prefix_ids
    rows = training_rows(tree.groups)
    assert len(rows) == 4
    by_id = {b.rollout_id: b for b in tree.branches}
    for row in rows:
        branch = by_id[row["rollout_id"]]
        shared, own_ids = branch.prefix_tokens or 0, branch.turns[0].completion_token_ids or []
        assert row["input_ids"] == [*(branch.turns[0].prompt_token_ids or []), *own_ids]
        assert row["loss_mask"] == [0] * shared + [1] * len(own_ids)
        assert row["group_id"] == tree.groups[0].group_id


async def test_a_tree_on_ray_actors_replays_and_branches_as_in_process(local_ray: None) -> None:
    from fleetroll.pool.ray.executor import ray_pool

    async with (
        Emulator() as emu,
        ray_pool(SETTINGS, api_key=emu.api_key, base_url=emu.base_url, num_actors=1) as pool,
    ):
        with anyio.fail_after(300):
            tree = await pool.run_tree(MONTH_END, ScriptedPolicy(), branch_at=2, width=2)
    root = tree.root
    assert root.failure_reason is FailureReason.MAX_STEPS and root.steps == 2
    assert len(tree.branches) == 2
    for branch in tree.branches:
        assert branch.failure_reason is None and branch.reward == 1.0, branch.error
        assert branch.parent_rollout_id == root.rollout_id and branch.branch_step == 2
        assert branch.transcript[: len(root.transcript)] == root.transcript
    [group] = tree.groups
    assert group.rewards == [1.0, 1.0]

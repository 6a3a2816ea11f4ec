"""The prefix a branch replays, read off its root's result, and how a replay's
difference is told."""

from __future__ import annotations

import pickle

import pytest

from fleetroll.policies import ScriptedPolicy
from fleetroll.results import RolloutResult, Turn
from fleetroll.rollout.branching import BranchPolicy, first_difference, prefix_of

CALL = {
    "id": "call_0",
    "type": "function",
    "function": {"name": "get_balance", "arguments": '{"account": "Checking"}'},
}
TRANSCRIPT = [
    {"role": "user", "content": "What is in Checking?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_0", "content": '{"balance": 12500.0}'},
    {"role": "assistant", "content": "12500"},
]


def root(turns: list[Turn] | None = None) -> RolloutResult:
    return RolloutResult(
        rollout_id="root",
        batch_id="t-root",
        task_key="k",
        env_key="ledger",
        modality="tool_use",
        status="completed",
        transcript=TRANSCRIPT,
        turns=turns or [],
    )


def test_a_prefix_holds_its_steps_turns_and_the_answers_they_got() -> None:
    prefix = prefix_of(root(), 1)
    assert prefix.parent_rollout_id == "root" and prefix.steps == 1 and prefix.messages == 3
    [turn] = prefix.turns
    [call] = turn.tool_calls
    assert (call.id, call.name, dict(call.arguments)) == (
        "call_0",
        "get_balance",
        {"account": "Checking"},
    )
    assert call.raw_arguments == '{"account": "Checking"}' and turn.data is None
    assert prefix.answers == ((TRANSCRIPT[2],),)


def test_a_prefix_keeps_the_token_ids_of_its_turns_for_the_branch_to_continue() -> None:
    turns = [
        Turn(index=0, prompt_token_ids=[1, 2], completion_token_ids=[3, 4]),
        Turn(index=1, prompt_token_ids=[1, 2, 3, 4, 5], completion_token_ids=[6]),
    ]
    [turn] = prefix_of(root(turns), 1).turns
    assert turn.data is not None
    assert turn.data.prompt_token_ids == (1, 2) and turn.data.completion_token_ids == (3, 4)


def test_a_prefix_longer_than_the_root_is_refused() -> None:
    with pytest.raises(ValueError, match="has 2 assistant turns; a prefix of 3 steps"):
        prefix_of(root(), 3)


def test_a_replay_s_difference_names_the_answer_and_both_values() -> None:
    want = (TRANSCRIPT[2],)
    assert first_difference(list(want), want) is None
    other = {**TRANSCRIPT[2], "content": '{"balance": 0.0}'}
    where = first_difference([other], want)
    assert where is not None
    assert where.startswith("answer 1 was")
    assert '{\\"balance\\": 0.0}' in where and '{\\"balance\\": 12500.0}' in where
    assert first_difference([], want) == "0 answer messages where the prefix had 1"


def test_a_branch_policy_pickles_for_a_ray_actor() -> None:
    branch = BranchPolicy(prefix_of(root(), 1), ScriptedPolicy())
    again = pickle.loads(pickle.dumps(branch))
    assert again.prefix == branch.prefix

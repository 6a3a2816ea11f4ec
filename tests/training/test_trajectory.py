"""Trajectories: turns stitched into one token sequence, drift split into segments,
and the training rows a trainer reads (pure functions, no server)."""

from __future__ import annotations

import statistics
from typing import Any

import anyio
import pytest

import fleetroll
from fleetroll.errors import PolicyError
from fleetroll.policies import OpenAIChatPolicy, ToolSpec
from fleetroll.pool.assembly import chat_policy_config
from fleetroll.results import RolloutResult, Trajectory, TrajectorySegment, Turn
from fleetroll.rollout.progress import Progress
from fleetroll.settings import load_settings
from fleetroll.tasks import TaskSpec
from fleetroll.testing.fake_openai import (
    THINK,
    FakeChatServer,
    VllmShape,
    tool_calling_script,
    toy_tokenize,
)
from fleetroll.tools.session import ToolResult
from fleetroll.training.groups import Group
from fleetroll.training.trajectory import stitch, training_rows


def turn(
    index: int,
    prompt: list[int],
    completion: list[int],
    *,
    version: int = 0,
    logprobs: list[float] | None = None,
) -> Turn:
    if logprobs is None:
        logprobs = [-0.1 * (i + 1) for i in range(len(completion))]
    return Turn(
        index=index,
        policy_version=version,
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        logprobs=logprobs,
    )


#: Three turns whose prompts each extend the last prompt and completion.
CONSISTENT = [
    turn(0, [1, 2, 3], [10, 11], version=4),
    turn(1, [1, 2, 3, 10, 11, 5, 6], [12], version=4),
    turn(2, [1, 2, 3, 10, 11, 5, 6, 12, 7], [13, 14, 15], version=5),
]


def result(rollout_id: str, reward: float | None, turns: list[Turn]) -> RolloutResult:
    return RolloutResult(
        rollout_id=rollout_id,
        batch_id="b",
        task_key="t",
        env_key="e",
        modality="tool_use",
        status="completed" if reward is not None else "failed",
        reward=reward,
        turns=turns,
        group_id="g",
    )


def test_a_consistent_rollout_is_the_last_prompt_and_completion_with_completions_masked_in() -> (
    None
):
    trajectory = stitch(CONSISTENT)

    assert trajectory is not None and not trajectory.drift and trajectory.drift_turn is None
    last = CONSISTENT[-1]
    assert trajectory.input_ids == [
        *(last.prompt_token_ids or []),
        *(last.completion_token_ids or []),
    ]
    assert sum(trajectory.loss_mask) == sum(len(t.completion_token_ids or []) for t in CONSISTENT)
    masked_in = [i for i, m in zip(trajectory.input_ids, trajectory.loss_mask, strict=True) if m]
    assert masked_in == [10, 11, 12, 13, 14, 15]
    # Logprobs and versions aligned with the tokens: the turn's where the model spoke, else null.
    assert trajectory.logprobs == [None] * 3 + [-0.1, -0.2] + [None] * 2 + [-0.1, None] + [
        -0.1,
        -0.2,
        -0.30000000000000004,
    ]
    assert trajectory.policy_versions == [None] * 3 + [4, 4] + [None] * 2 + [4, None] + [5] * 3
    assert trajectory.segments == []


def test_a_prompt_that_re_renders_history_is_drift_at_that_turn_and_splits_the_trajectory() -> None:
    turns = [
        CONSISTENT[0],
        CONSISTENT[1],
        # The template dropped token 10 of turn 0's completion from the history.
        turn(2, [1, 2, 3, 11, 5, 6, 12, 7], [13, 14], version=5),
        turn(3, [1, 2, 3, 11, 5, 6, 12, 7, 13, 14, 8], [16]),
    ]

    trajectory = stitch(turns)

    assert trajectory is not None and trajectory.drift and trajectory.drift_turn == 2
    first, second = trajectory.segments
    assert (first.first_turn, first.last_turn) == (0, 1)
    assert (second.first_turn, second.last_turn) == (2, 3)
    assert first.input_ids == [1, 2, 3, 10, 11, 5, 6, 12] == trajectory.input_ids
    assert second.input_ids == [1, 2, 3, 11, 5, 6, 12, 7, 13, 14, 8, 16]
    # Every generated token is in exactly one segment, never spliced onto a wrong prefix.
    assert sum(first.loss_mask) + sum(second.loss_mask) == 3 + 3
    assert [i for i, m in zip(second.input_ids, second.loss_mask, strict=True) if m] == [13, 14, 16]


def test_turns_without_token_ids_have_no_trajectory() -> None:
    assert stitch([]) is None
    assert stitch([CONSISTENT[0], Turn(index=1, completion_token_ids=[3])]) is None


def test_a_turn_without_logprobs_leaves_them_null_but_keeps_its_tokens_in_the_loss() -> None:
    trajectory = stitch([turn(0, [1], [2, 3], logprobs=[])])

    assert trajectory is not None
    assert trajectory.loss_mask == [0, 1, 1] and trajectory.logprobs == [None, None, None]


def test_training_rows_hold_group_normalised_advantages_and_leave_out_unscored_rollouts() -> None:
    rewards = [1.0, 0.0, 0.5]
    group = [result(f"r{i}", r, CONSISTENT) for i, r in enumerate(rewards)]
    group.append(result("lost", None, CONSISTENT))

    rows = fleetroll.training_rows([group])

    assert [row["rollout_id"] for row in rows] == ["r0", "r1", "r2"]
    mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
    for row, reward in zip(rows, rewards, strict=True):
        assert row["advantage"] == pytest.approx((reward - mean) / (std + 1e-6))
        assert row["input_ids"] == stitch(CONSISTENT).input_ids  # type: ignore[union-attr]
        assert len(row["loss_mask"]) == len(row["logprobs"]) == len(row["input_ids"])
    assert sum(row["advantage"] for row in rows) == pytest.approx(0.0, abs=1e-9)


def test_training_rows_of_a_uniform_group_have_zero_advantage_and_take_group_objects() -> None:
    results = [result(f"r{i}", 1.0, CONSISTENT) for i in range(2)]
    group = Group.of(
        group_id="g",
        batch_id="b",
        task_key="t",
        expected=2,
        results=results,
        failed=0,
        superseded=0,
    )

    rows = training_rows([group])

    assert [row["advantage"] for row in rows] == [0.0, 0.0]


def test_a_drifted_rollout_gives_one_training_row_per_segment_with_the_same_advantage() -> None:
    drifted = [CONSISTENT[0], turn(1, [9, 9], [4])]
    rows = training_rows([[result("a", 1.0, drifted), result("b", 0.0, CONSISTENT)]])

    assert [(row["rollout_id"], row["segment"]) for row in rows] == [("a", 0), ("a", 1), ("b", 0)]
    assert rows[0]["advantage"] == rows[1]["advantage"] > 0
    assert rows[1]["input_ids"] == [9, 9, 4] and rows[1]["loss_mask"] == [0, 0, 1]


# -- through OpenAIChatPolicy, against the vLLM-shaped fake server over loopback ---------

TEST_DEADLINE_S = 10.0
#: The toy template's message start and end tokens.
START, END = 1, 2
TASK = TaskSpec(key="t", prompt="Pay the rent.", env_key="ledger")
TOOLS = (ToolSpec(name="pay", description="Pay.", input_schema={"type": "object"}),)
CALLS = [("pay", {"amount": 5}), ("pay", {"amount": 7}), ("pay", {"amount": 9})]


async def converse(server: FakeChatServer, images: tuple[str, ...] = (), **policy: Any) -> Progress:
    """A rollout's acting loop without an environment: each call answered "paid"."""
    progress = Progress()
    progress.transcript.add_prompt(TASK.prompt, images)
    with anyio.fail_after(TEST_DEADLINE_S):
        async with OpenAIChatPolicy(
            base_url=server.base_url, model="m", logprobs=True, timeout_s=5, **policy
        ) as model:
            for version in range(10):
                answer = await model.act(TASK, progress.transcript.messages, TOOLS)
                progress.record_turn(answer, policy_version=version, latency_s=0.0)
                progress.transcript.add_turn(answer)
                if not answer.tool_calls:
                    return progress
                for call in answer.tool_calls:
                    progress.transcript.add_answer(call, ToolResult(text=f"paid {version}"))
    raise AssertionError("the conversation did not end")


def generated(trajectory: Trajectory | TrajectorySegment) -> list[int]:
    return [i for i, m in zip(trajectory.input_ids, trajectory.loss_mask, strict=True) if m]


async def test_with_a_consistent_server_the_trajectory_is_the_last_prompt_and_completion() -> None:
    async with FakeChatServer(tool_calling_script(CALLS), vllm=VllmShape()) as server:
        progress = await converse(server, return_token_ids=True)

    trajectory = stitch(progress.turns)
    last = progress.turns[-1]
    assert trajectory is not None and not trajectory.drift and len(progress.turns) == 4
    assert trajectory.input_ids == [
        *(last.prompt_token_ids or []),
        *(last.completion_token_ids or []),
    ]
    completions = [i for t in progress.turns for i in t.completion_token_ids or []]
    assert sum(trajectory.loss_mask) == len(completions)
    assert generated(trajectory) == completions
    assert [lp for lp in trajectory.logprobs if lp is not None] == [
        lp for t in progress.turns for lp in t.logprobs or []
    ]
    assert {v for v in trajectory.policy_versions if v is not None} == {0, 1, 2, 3}


async def test_a_drifting_chat_template_is_drift_at_the_second_turn_in_the_default_mode() -> None:
    async with FakeChatServer(tool_calling_script(CALLS), vllm=VllmShape(drift=True)) as server:
        progress = await converse(server, return_token_ids=True)

    trajectory = stitch(progress.turns)
    assert trajectory is not None and trajectory.drift and trajectory.drift_turn == 1
    # Every turn re-renders the history without its thinking: a segment per turn.
    assert [s.first_turn for s in trajectory.segments] == [0, 1, 2, 3]
    assert [generated(s) for s in trajectory.segments] == [
        t.completion_token_ids for t in progress.turns
    ]


async def test_token_in_keeps_the_ids_sent_back_so_a_drifting_template_does_not_drift() -> None:
    shape = VllmShape(drift=True, token_in=True)
    async with FakeChatServer(tool_calling_script(CALLS), vllm=shape) as server:
        progress = await converse(server, token_in=True)
        requests = list(server.requests)

    trajectory = stitch(progress.turns)
    assert trajectory is not None and not trajectory.drift and trajectory.segments == []
    completions = [t.completion_token_ids or [] for t in progress.turns]
    # Every generated token, thinking included, unchanged and in the loss.
    assert all(ids[0] == THINK for ids in completions)
    assert generated(trajectory) == [i for ids in completions for i in ids]
    last = progress.turns[-1]
    assert trajectory.input_ids == [
        *(last.prompt_token_ids or []),
        *(last.completion_token_ids or []),
    ]
    # The first call is a plain chat completion; the others send the tokens back.
    assert "tokens" not in requests[0]
    assert [r["tokens"] for r in requests[1:]] == [t.prompt_token_ids for t in progress.turns[1:]]
    # Each sent back: the last prompt and completion as returned, then the tool's
    # answer and the answer's start as the server's /tokenize renders them.
    for before, after, request in zip(
        progress.turns[:-1], progress.turns[1:], requests[1:], strict=True
    ):
        answer = [START, *toy_tokenize(f"tool paid {before.index}"), END]
        answer += [START, *toy_tokenize("assistant")]
        sent = [*(before.prompt_token_ids or []), *(before.completion_token_ids or []), *answer]
        assert request["tokens"] == sent == after.prompt_token_ids


async def test_token_in_sends_a_conversation_with_images_as_messages_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    shape = VllmShape(token_in=True)
    async with FakeChatServer(tool_calling_script(CALLS), vllm=shape) as server:
        progress = await converse(server, images=("data:image/png;base64,AAAA",), token_in=True)
        requests = list(server.requests)

    assert len(requests) == 4 and not any("tokens" in r for r in requests)
    assert server.tokenize_requests == []
    warned = [r for r in caplog.records if "does not expand image placeholders" in r.message]
    assert len(warned) == 1
    trajectory = stitch(progress.turns)
    assert trajectory is not None and not trajectory.drift


async def test_token_in_against_a_server_without_its_routes_says_what_to_do() -> None:
    async with FakeChatServer(tool_calling_script(CALLS), vllm=VllmShape()) as server:
        with pytest.raises(PolicyError) as caught:
            await converse(server, token_in=True)

    message = str(caught.value)
    assert "HTTP 404" in message and "/tokenize" in message
    assert "set policy.token_in = false" in message and not caught.value.transient


async def test_the_settings_ask_for_token_ids_when_trajectories_or_token_in_are_on() -> None:
    async with FakeChatServer(tool_calling_script([]), vllm=VllmShape(token_in=True)) as server:
        for policy in ({"trajectory": True}, {"token_in": True}, {}):
            settings = load_settings(
                policy={"kind": "openai", "base_url": server.base_url, **policy}
            )
            async with OpenAIChatPolicy.from_config(chat_policy_config(settings)) as model:
                with anyio.fail_after(TEST_DEADLINE_S):
                    await model.act(TASK, [{"role": "user", "content": "hi"}], TOOLS)
                assert model.token_in is policy.get("token_in", False)
        asked = [r.get("return_token_ids") for r in server.requests]
    assert asked == [True, True, None]


def test_of_a_call_s_several_choices_the_trajectory_follows_the_one_the_next_call_continues() -> (
    None
):
    first, second, third = CONSISTENT
    # The first call asked for two choices; the next call continued the second.
    skipped = first.model_copy(update={"completion_token_ids": [30, 31]})
    taken = first.model_copy(update={"index": 1, "choice": 1})
    later = [second.model_copy(update={"index": 2}), third.model_copy(update={"index": 3})]
    branched, plain = stitch([skipped, taken, *later]), stitch(CONSISTENT)
    assert branched is not None and plain is not None
    assert branched == plain and not branched.drift

    # The last call's choices: no call tells which was taken, so the first is.
    extra = third.model_copy(update={"index": 3, "choice": 1, "completion_token_ids": [40]})
    assert stitch([*CONSISTENT, extra]) == plain

"""``training_rows(..., group_size=G)``: exactly G rows per group in the trainer's shape
(one sequence per rollout split into prompt and completion), failures as mask-0 rows,
oversampling resolved, and each drift policy (pure functions, no server)."""

from __future__ import annotations

import statistics
from typing import Any

import pytest

import fleetroll
from fleetroll.results import FailureReason, RolloutResult, Turn
from fleetroll.training.groups import Group
from fleetroll.training.trajectory import ROW_STATUSES, stitch, training_rows

ROW_KEYS = {
    "rollout_id",
    "group_id",
    "task_key",
    "sample_index",
    "prompt_ids",
    "completion_ids",
    "completion_mask",
    "completion_logprobs",
    "completion_policy_versions",
    "completion_token_versions",
    "reward",
    "advantage",
    "status",
    "failure_reason",
    "dropped_tokens",
    "drift",
}


def turn(
    index: int,
    prompt: list[int],
    completion: list[int],
    *,
    version: int = 0,
    choice: int = 0,
    logprobs: list[float] | None = None,
    error: str | None = None,
) -> Turn:
    return Turn(
        index=index,
        policy_version=version,
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        logprobs=[-0.1 * (index + 1) - 0.01 * i for i in range(len(completion))]
        if logprobs is None
        else logprobs,
        choice=choice,
        training_data_error=error,
    )


#: Three turns whose prompts each extend the last prompt and completion.
CONSISTENT = [
    turn(0, [1, 2, 3], [10, 11], version=4),
    turn(1, [1, 2, 3, 10, 11, 5, 6], [12], version=4),
    turn(2, [1, 2, 3, 10, 11, 5, 6, 12, 7], [13, 14, 15], version=5),
]
#: Turns 0 and 1 consistent; turn 2's prompt re-renders the history (drift at turn 2).
DRIFTED = [
    turn(0, [1, 2, 3], [10, 11]),
    turn(1, [1, 2, 3, 10, 11, 5], [12, 13]),
    turn(2, [1, 2, 3, 99, 5, 12, 13, 6], [14, 15, 16], version=1),
]


def result(
    sample: int,
    reward: float | None,
    turns: list[Turn] | None = None,
    *,
    reason: FailureReason | None = None,
    task: str = "t",
) -> RolloutResult:
    if reward is None and reason is None:
        reason = FailureReason.POLICY_ERROR
    return RolloutResult(
        rollout_id=f"{task}-r{sample}",
        batch_id="b",
        task_key=task,
        sample_index=sample,
        group_id=f"g-{task}",
        env_key="e",
        modality="tool_use",
        status="completed" if reason is None else "failed",
        failure_reason=reason,
        reward=reward,
        turns=CONSISTENT if turns is None else turns,
    )


def advantages(rewards: list[float]) -> list[float]:
    mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
    return [(r - mean) / (std + 1e-6) for r in rewards]


def test_a_group_gives_exactly_g_rows_in_sample_order_with_a_failure_as_a_mask_0_row() -> None:
    group = [
        result(3, 0.5),
        result(1, None, [turn(0, [1, 2, 3], [10])]),  # failed after one call
        result(0, 1.0),
        result(2, 0.0),
    ]

    rows = fleetroll.training_rows([group], group_size=4)

    assert [row["sample_index"] for row in rows] == [0, 1, 2, 3]
    assert all(set(row) == ROW_KEYS for row in rows)
    assert [row["status"] for row in rows] == ["scored", "failed", "scored", "scored"]
    failed = rows[1]
    assert failed["reward"] is None and failed["advantage"] == 0.0
    assert failed["failure_reason"] == "policy_error"
    assert failed["prompt_ids"] == [1, 2, 3]  # turn 0's prompt
    assert failed["completion_ids"] == failed["completion_mask"] == []
    assert failed["dropped_tokens"] == 1  # the model's one token, not trained on
    scored = [rows[0], rows[2], rows[3]]
    expected = advantages([1.0, 0.0, 0.5])
    assert [row["advantage"] for row in scored] == pytest.approx(expected)
    assert [row["reward"] for row in scored] == [1.0, 0.0, 0.5]


def test_a_failure_before_any_call_is_a_row_with_no_ids() -> None:
    rows = training_rows(
        [[result(0, 1.0), result(1, None, [], reason=FailureReason.INIT_ERROR)]], group_size=2
    )

    assert rows[1]["prompt_ids"] == rows[1]["completion_ids"] == []
    assert rows[1]["status"] == "failed" and rows[1]["failure_reason"] == "init_error"
    assert rows[1]["dropped_tokens"] == 0
    assert rows[0]["advantage"] == 0.0  # one scored sample: nothing to compare it with


def test_a_row_s_ids_masks_logprobs_and_versions_are_the_stitched_sequence_split_at_the_first_generated_token() -> (  # noqa: E501
    None
):
    (row,) = training_rows([[result(0, 1.0)]], group_size=1)
    whole = stitch(CONSISTENT)
    assert whole is not None

    assert row["prompt_ids"] == [1, 2, 3]
    assert row["prompt_ids"] + row["completion_ids"] == whole.input_ids
    assert row["completion_ids"] == [10, 11, 5, 6, 12, 7, 13, 14, 15]
    assert row["completion_mask"] == [1, 1, 0, 0, 1, 0, 1, 1, 1]
    n = len(row["completion_ids"])
    assert len(row["completion_mask"]) == len(row["completion_logprobs"]) == n
    assert len(row["completion_policy_versions"]) == n
    assert row["completion_policy_versions"] == [4, 4, None, None, 4, None, 5, 5, 5]
    generated = [
        lp for lp, m in zip(row["completion_logprobs"], row["completion_mask"], strict=True) if m
    ]
    assert generated == [lp for t in CONSISTENT for lp in t.logprobs or ()]
    assert all(
        lp is None
        for lp, m in zip(row["completion_logprobs"], row["completion_mask"], strict=True)
        if not m
    )
    assert row["dropped_tokens"] == 0 and row["drift"] is None and row["status"] == "scored"


def test_logprobs_the_server_did_not_return_are_none_but_the_tokens_stay_in_the_loss() -> None:
    turns = [turn(0, [1, 2], [7, 8], logprobs=[])]
    (row,) = training_rows([[result(0, 1.0, turns)]], group_size=1)

    assert row["completion_mask"] == [1, 1] and row["completion_logprobs"] == [None, None]


def test_oversampling_keeps_the_lowest_ranked_scored_samples_and_never_a_superseded_one() -> None:
    superseded = FailureReason.SUPERSEDED
    # G = 2 with two extras: sample 0 failed, extra 2 took its place, extra 3 was superseded.
    group = [
        result(0, None, reason=FailureReason.INSTANCE_LOST),
        result(1, 0.0),
        result(2, 1.0),
        result(3, None, reason=superseded),
    ]
    rows = training_rows([group], group_size=2)

    assert [row["sample_index"] for row in rows] == [1, 2]
    assert [row["advantage"] for row in rows] == pytest.approx(advantages([0.0, 1.0]))
    # G = 3, two failures among the samples and no extra to stand in: the lowest-ranked fill.
    group = [
        result(4, None, reason=superseded),
        result(2, None, reason=FailureReason.TOOL_FAILURE),
        result(1, 1.0),
        result(0, None, reason=FailureReason.INSTANCE_LOST),
        result(3, None, reason=FailureReason.TOOL_FAILURE),
    ]
    rows = training_rows([group], group_size=3)

    assert [(row["sample_index"], row["status"]) for row in rows] == [
        (0, "failed"),
        (1, "scored"),
        (2, "failed"),
    ]
    assert "t-r4" not in {row["rollout_id"] for row in rows}


def test_more_scored_samples_than_g_keep_the_g_lowest_ranked() -> None:
    group = [result(i, float(i)) for i in (4, 0, 3, 1, 2)]

    rows = training_rows([group], group_size=3)

    assert [row["sample_index"] for row in rows] == [0, 1, 2]
    assert [row["advantage"] for row in rows] == pytest.approx(advantages([0.0, 1.0, 2.0]))


def test_a_group_short_of_g_results_is_padded_and_the_padding_says_so() -> None:
    group = [result(0, 1.0), result(1, None, reason=FailureReason.SUPERSEDED)]

    rows = training_rows([group], group_size=3)

    assert [row["status"] for row in rows] == ["scored", "padding", "padding"]
    for pad in rows[1:]:
        assert pad["rollout_id"] is None and pad["sample_index"] is None
        assert (pad["task_key"], pad["group_id"]) == ("t", "g-t")
        assert pad["reward"] is None and pad["advantage"] == 0.0
        assert pad["prompt_ids"] == pad["completion_ids"] == pad["completion_mask"] == []


def test_group_objects_hold_only_scored_results_so_their_failures_are_padding() -> None:
    scored = [result(0, 1.0), result(2, 0.0)]
    group = Group.of(
        group_id="g-t",
        batch_id="b",
        task_key="t",
        expected=3,
        results=scored,
        failed=1,
        superseded=0,
    )

    rows = training_rows([group], group_size=3)

    assert [row["status"] for row in rows] == ["scored", "scored", "padding"]
    assert [row["advantage"] for row in rows[:2]] == pytest.approx(advantages([1.0, 0.0]))


def test_groups_follow_one_another_each_with_its_own_statistics() -> None:
    a = [result(i, r, task="a") for i, r in enumerate([1.0, 0.0])]
    b = [result(i, r, task="b") for i, r in enumerate([1.0, 1.0])]

    rows = training_rows([a, b], group_size=2)

    assert [row["task_key"] for row in rows] == ["a", "a", "b", "b"]
    assert [row["advantage"] for row in rows] == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)


def drifted_row(policy: str) -> dict[str, Any]:
    (row,) = training_rows([[result(0, 1.0, DRIFTED)]], group_size=1, drift=policy)  # type: ignore[arg-type]
    return row


def test_first_segment_keeps_the_turns_before_the_drift_and_counts_the_tokens_dropped() -> None:
    row = drifted_row("first_segment")

    assert row["status"] == "scored"
    assert row["prompt_ids"] == [1, 2, 3]
    assert row["completion_ids"] == [10, 11, 5, 12, 13]
    assert row["completion_mask"] == [1, 1, 0, 1, 1]
    assert row["dropped_tokens"] == 3
    assert row["drift"] == {
        "turn": 2,
        "segments": 2,
        "policy": "first_segment",
        "dropped_tokens": 3,
    }


def test_last_turn_is_the_last_turn_alone() -> None:
    row = drifted_row("last_turn")

    assert row["prompt_ids"] == DRIFTED[2].prompt_token_ids
    assert row["completion_ids"] == [14, 15, 16] and row["completion_mask"] == [1, 1, 1]
    assert row["completion_logprobs"] == DRIFTED[2].logprobs
    assert row["completion_policy_versions"] == [1, 1, 1]
    assert row["dropped_tokens"] == 4 and row["drift"]["policy"] == "last_turn"


def test_drop_makes_the_drifted_rollout_a_mask_0_row_whose_reward_still_counts() -> None:
    group = [result(0, 1.0, DRIFTED), result(1, 0.0)]
    rows = training_rows([group], group_size=2, drift="drop")

    assert rows[0]["status"] == "drift_dropped"
    assert rows[0]["prompt_ids"] == [1, 2, 3] and rows[0]["completion_ids"] == []
    assert rows[0]["dropped_tokens"] == 7
    # Its reward is the policy's: it stays in the group's baseline.
    assert [row["advantage"] for row in rows] == pytest.approx(advantages([1.0, 0.0]))


def test_without_drift_every_policy_gives_the_whole_sequence() -> None:
    rows = {
        policy: training_rows([[result(0, 1.0)]], group_size=1, drift=policy)[0]  # type: ignore[arg-type]
        for policy in ("drop", "first_segment", "last_turn")
    }

    assert rows["drop"] == rows["first_segment"] == rows["last_turn"]
    assert rows["drop"]["drift"] is None


def test_of_a_call_s_several_choices_last_turn_takes_the_one_the_rollout_followed() -> None:
    turns = [
        turn(0, [1, 2], [10]),
        turn(1, [1, 2], [11], choice=1),
        turn(2, [5, 5], [12]),  # drift: neither choice is extended
        turn(3, [5, 5], [13], choice=1),
    ]
    row = training_rows([[result(0, 1.0, turns)]], group_size=1, drift="last_turn")[0]

    assert row["prompt_ids"] == [5, 5] and row["completion_ids"] == [12]
    assert row["dropped_tokens"] == 1  # choice 0 of the first call; other choices are not counted


def test_scored_rollouts_without_usable_token_data_are_mask_0_rows_whose_reward_counts() -> None:
    no_ids = [Turn(index=0, policy_version=0)]
    bad = [turn(0, [1, 2], [3], error="logprobs held NaN")]
    group = [result(0, 1.0, no_ids), result(1, 0.0, bad), result(2, 0.5)]

    rows = training_rows([group], group_size=3)

    assert [row["status"] for row in rows] == ["no_token_ids", "unusable", "scored"]
    assert rows[0]["completion_mask"] == rows[1]["completion_mask"] == []
    assert rows[1]["prompt_ids"] == [1, 2]
    assert [row["advantage"] for row in rows] == pytest.approx(advantages([1.0, 0.0, 0.5]))
    assert set(ROW_STATUSES) >= {row["status"] for row in rows}


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"group_size": 0}, "group_size must be an integer >= 1"),
        ({"group_size": True}, "group_size must be an integer >= 1"),
        ({"group_size": 2, "drift": "splice"}, "drift must be one of 'drop', 'first_segment'"),
        ({"drift": "splice"}, "drift must be one of"),
    ],
)
def test_bad_arguments_are_one_clear_value_error(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        training_rows([[result(0, 1.0)]], **arguments)


def test_a_list_mixing_groups_is_refused() -> None:
    with pytest.raises(ValueError, match=r"one group .* 'a', 'b'"):
        training_rows([[result(0, 1.0, task="a"), result(0, 1.0, task="b")]], group_size=2)


def test_without_group_size_the_rows_are_as_before() -> None:
    group = [result(0, 1.0, DRIFTED), result(1, 0.0), result(2, None)]

    rows = training_rows([group])

    assert [(row["rollout_id"], row["segment"]) for row in rows] == [
        ("t-r0", 0),
        ("t-r0", 1),
        ("t-r1", 0),
    ]

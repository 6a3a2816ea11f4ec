"""Per-token policy versions (``policy.weight_update``), without servers: what a
turn records when the server reports versions or not, the stitched trajectory
and rows, the gate's modes and ``policy.max_token_staleness``."""

from __future__ import annotations

import httpx
import pytest

from fleetroll.errors import WeightSyncError
from fleetroll.policies.completions import token_versions
from fleetroll.policies.gate import PolicyGate
from fleetroll.policies.turns import AssistantTurn, TurnData
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout import staleness
from fleetroll.rollout.progress import Progress
from fleetroll.settings import load_settings
from fleetroll.training.trajectory import stitch, training_rows
from fleetroll.training.weight_sync import abort_generations


def turn(
    ids: tuple[int, ...],
    versions: tuple[int | None, ...] | None,
    prompt: tuple[int, ...] = (1, 2),
) -> AssistantTurn:
    data = TurnData(
        prompt_token_ids=prompt,
        completion_token_ids=ids,
        logprobs=tuple(-0.5 for _ in ids),
        token_versions=versions,
    )
    return AssistantTurn(content="x", data=data)


def test_a_choices_token_versions_are_read_only_when_aligned_with_its_ids() -> None:
    assert token_versions({"token_versions": [0, 0, 1]}, (5, 6, 7)) == (0, 0, 1)
    assert token_versions({"token_versions": [0, 1]}, (5, 6, 7)) is None
    assert token_versions({"token_versions": ["0"]}, (5,)) is None
    assert token_versions({}, (5,)) is None


def test_a_turn_keeps_the_servers_versions_else_the_calls_where_proven_else_nulls() -> None:
    progress = Progress()
    progress.record_turn(turn((5, 6, 7), (3, 3, 4)), policy_version=3, latency_s=0.1)
    second_prompt = (1, 2, 5, 6, 7, 20)  # the first call's, then an observation
    third_prompt = (*second_prompt, 8, 9, 21)
    progress.record_turn(turn((8, 9), None, second_prompt), policy_version=4, latency_s=0.1)
    progress.record_turn(
        turn((10,), None, third_prompt), policy_version=4, latency_s=0.1, proven=False
    )
    first, second, third = progress.turns
    assert (first.token_versions, first.token_versions_note) == ([3, 3, 4], None)
    assert (second.token_versions, second.token_versions_note) == ([4, 4], None)
    assert third.token_versions == [None]
    assert third.token_versions_note is not None and "in_flight" in third.token_versions_note

    trajectory = stitch(progress.turns)
    assert trajectory is not None and not trajectory.drift
    expected = [None, None, 3, 3, 4, None, 4, 4, None, None]
    assert trajectory.token_versions == expected
    assert trajectory.input_ids == [*third_prompt, 10]
    result = RolloutResult(
        rollout_id="r",
        batch_id="b",
        task_key="t",
        env_key="e",
        modality="tool_use",
        status="completed",
        reward=1.0,
        turns=progress.turns,
        group_id="g",
    )
    rows = training_rows([[result]])
    assert [row["token_versions"] for row in rows] == [expected]
    (row,) = training_rows([[result]], group_size=1)
    assert row["prompt_ids"] == [1, 2]
    assert row["completion_token_versions"] == expected[2:]


async def test_in_flight_pauses_hold_no_call_but_count_as_updates() -> None:
    gate = PolicyGate(mode="in_flight")
    async with gate.paused_calls():
        assert not gate.paused
        assert await gate.admit() == (0, 0.0)
        assert gate.updates == 1
    assert gate.updates == 2
    held = PolicyGate(mode="abort")
    async with held.paused_calls():
        assert held.paused
    with pytest.raises(ValueError, match=r"policy\.weight_update"):
        PolicyGate(mode="later")  # type: ignore[arg-type]


def test_a_rollout_whose_oldest_token_is_past_max_token_staleness_fails_as_stale() -> None:
    progress = Progress()
    progress.record_turn(turn((5, 6), (1, 2)), policy_version=1, latency_s=0.1)
    progress.record_turn(turn((7,), (None,)), policy_version=3, latency_s=0.1)
    staleness.check_tokens(progress, 2, now=3)
    assert progress.reason is None  # oldest 1: 2 behind, within the bound
    staleness.check_tokens(progress, 1, now=3)
    assert progress.reason == FailureReason.STALE
    assert progress.error is not None and "max_token_staleness = 1" in progress.error


def test_the_settings_default_to_todays_pause() -> None:
    policy = load_settings().policy
    assert (policy.weight_update, policy.max_token_staleness) == ("pause", None)
    assert load_settings(policy={"weight_update": "in_flight"}).policy.weight_update == "in_flight"


async def test_aborting_on_a_server_without_abort_request_fails_naming_it() -> None:
    seen: list[tuple[str, bytes]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url), request.content))
        if request.url.host == "sglang":
            return httpx.Response(200)
        return httpx.Response(404, json={"detail": "Not Found"})

    servers = ["http://sglang:30000/v1", "http://vllm:8000/v1"]
    with pytest.raises(WeightSyncError) as caught:
        await abort_generations(
            servers, api_key="sk-abort-secret", transport=httpx.MockTransport(answer)
        )
    assert sorted(url for url, _ in seen) == [
        "http://sglang:30000/abort_request",
        "http://vllm:8000/abort_request",
    ]
    assert all(body == b'{"abort_all":true}' for _, body in seen)
    assert list(caught.value.failed) == ["http://vllm:8000"]
    assert "no /abort_request route" in str(caught.value)
    assert "sk-abort-secret" not in str(caught.value)

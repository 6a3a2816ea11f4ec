"""Routed experts (MoE routing replay): from the server, per token, into turns,
trajectories and the trainer's rows.

The fast tests stitch hand-made turns; the slow one runs a rollout on the
emulator against a mixture-of-experts tiny model behind the vLLM-shaped test
server and recomputes every token's experts with one forward pass of the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetroll.policies.completions import routed_experts
from fleetroll.results import RolloutResult, RoutedExperts, Turn
from fleetroll.training.trajectory import routed_experts_list, stitch, training_rows

LAYERS, TOP_K = 2, 2


def rows_for(ids: list[int]) -> list[list[list[int]]]:
    """Distinct experts per token (from its id), so a misalignment shows."""
    return [[[i % 7, (i + layer) % 5] for layer in range(LAYERS)] for i in ids]


def turn(index: int, prompt: list[int], completion: list[int], *, experts: bool = True) -> Turn:
    routed = (
        RoutedExperts.from_rows(rows_for(prompt + completion), layers=LAYERS, top_k=TOP_K)
        if experts
        else None
    )
    return Turn(
        index=index,
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        routed_experts=routed,
    )


def test_routed_experts_round_trip_compactly_as_int16() -> None:
    rows = rows_for([1, 2, 3, 40000 % 30000])
    packed = RoutedExperts.from_rows(rows, layers=LAYERS, top_k=TOP_K)
    assert packed.tokens == 4 and packed.rows() == rows
    assert len(packed.raw()) == 4 * LAYERS * TOP_K * 2
    with pytest.raises(ValueError, match="2 layers x 2"):
        RoutedExperts.from_rows([[[1, 2]]], layers=LAYERS, top_k=TOP_K)


def test_a_multi_turn_trajectory_carries_each_tokens_experts_aligned_with_input_ids() -> None:
    first = turn(0, [10, 11, 12], [13, 14])
    second = turn(1, [10, 11, 12, 13, 14, 15, 16], [17])
    trajectory = stitch([first, second])
    assert trajectory is not None and trajectory.routed_experts is not None
    assert trajectory.input_ids == [10, 11, 12, 13, 14, 15, 16, 17]
    assert routed_experts_list(trajectory.routed_experts) == rows_for(trajectory.input_ids)
    (row,) = training_rows([[result_with([first, second])]])
    assert routed_experts_list(row["routed_experts"]) == rows_for(row["input_ids"])


def result_with(turns: list[Turn]) -> RolloutResult:
    """A scored result whose trajectory the rows stitch from its turns."""
    return RolloutResult(
        rollout_id="r",
        batch_id="b",
        task_key="t",
        env_key="e",
        modality="tool_use",
        status="completed",
        reward=1.0,
        turns=turns,
    )


def test_a_turn_without_experts_gives_minus_one_rows_and_drift_gives_each_segment_its_own() -> None:
    first = turn(0, [10, 11], [12])
    second = turn(1, [10, 99, 12, 5], [6], experts=False)  # drifted, no experts
    trajectory = stitch([first, second])
    assert trajectory is not None and trajectory.drift
    one, two = trajectory.segments
    assert one.routed_experts is not None and two.routed_experts is not None
    assert routed_experts_list(one.routed_experts) == rows_for([10, 11, 12])
    assert routed_experts_list(two.routed_experts) == [[[-1, -1]] * LAYERS] * 5


def test_without_experts_nothing_changes_not_even_a_key() -> None:
    plain = turn(0, [1, 2], [3], experts=False)
    trajectory = stitch([plain])
    assert trajectory is not None and trajectory.routed_experts is None
    assert "routed_experts" not in json.loads(trajectory.model_dump_json())
    assert "routed_experts" not in json.loads(plain.model_dump_json())
    (row,) = training_rows([[result_with([plain])]])
    assert "routed_experts" not in row


def test_misaligned_experts_are_dropped_with_a_reason() -> None:
    experts, problem = routed_experts(rows_for([1]), rows_for([2, 3, 4]), [1], [2])
    assert experts is None and problem is not None and "not aligned" in problem
    experts, problem = routed_experts(None, rows_for([2]), [1], [2, 3])  # the last not fed back
    assert problem is None and experts is not None
    assert experts.rows() == [[[-1, -1]] * LAYERS, *rows_for([2]), [[-1, -1]] * LAYERS]
    assert routed_experts(None, None, [1], [2]) == (None, None)


# -- a real router ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_a_moe_servers_routed_experts_reach_turns_trajectories_and_rows(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from fleetroll.emulator import Emulator
    from fleetroll.policies import OpenAIChatPolicy
    from fleetroll.pool.assembly import chat_policy_config, fleet_provider, rollout_config
    from fleetroll.rollout.engine import RolloutEngine
    from fleetroll.rollout.machine import RolloutIds
    from fleetroll.settings import load_settings
    from fleetroll.telemetry import Events, MemorySink
    from fleetroll.testing.model_server import ForcedRequest, ModelServer, routed_experts_of
    from fleetroll.testing.tiny_model import TinyModelSpec, save_tiny_model
    from training_helpers import TASKS

    path = save_tiny_model(tmp_path / "tiny-moe", TinyModelSpec(num_experts=4))
    task = TASKS["ledger-010"]
    steps = (task.solution or ())[:2]

    def forced(request: ForcedRequest) -> str:
        """The task's first two steps as tool calls, then "done": three turns."""
        turn = sum(1 for m in request.body["messages"] if m.get("role") == "assistant")
        if turn >= len(steps):
            return "done"
        call = {"name": steps[turn].name, "arguments": dict(steps[turn].arguments)}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"

    async with (
        Emulator() as emu,
        # Room for a forced tool call: a forced text is cut at max_tokens, as a real server's.
        ModelServer(
            path, return_routed_experts=True, forced=forced, default_max_tokens=256
        ) as server,
    ):
        policy = {
            "kind": "openai",
            "base_url": server.base_url,
            "model": server.model_name,
            "trajectory": True,
            "token_in": True,
            "logprobs": True,
        }
        settings = load_settings(policy=policy)
        events = Events([MemorySink()])
        provider = fleet_provider(settings, events, api_key=emu.api_key, base_url=emu.base_url)
        async with (
            RolloutEngine.open(rollout_config(settings), events, provider) as eng,
            OpenAIChatPolicy.from_config(chat_policy_config(settings)) as model,
        ):
            ids = RolloutIds(batch_id="b", rollout_id="r0", sample_index=0)
            result = await eng.rollout(task, ids).run(model)
        served = server.model

    assert len(result.turns) == 3 and result.trajectory is not None
    assert not result.trajectory.drift
    for t in result.turns:
        assert t.routed_experts is not None and t.training_data_error is None
        tokens = [*(t.prompt_token_ids or []), *(t.completion_token_ids or [])]
        assert t.routed_experts.tokens == len(tokens)
        assert t.routed_experts.rows() == routed_experts_of(served, tokens)
    trajectory = result.trajectory
    assert trajectory.routed_experts is not None
    assert trajectory.routed_experts.rows() == routed_experts_of(served, trajectory.input_ids)
    rows = training_rows([[result.model_copy(update={"reward": 1.0})]])
    assert rows and all(
        routed_experts_list(row["routed_experts"]) == routed_experts_of(served, row["input_ids"])
        for row in rows
    )

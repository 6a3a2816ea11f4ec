"""verl's agent loop on fleetroll: the installed verl's ``AgentLoopBase``, a rollout per sample.

The tiny random model (no download) is served by the vLLM-shaped test server;
verl's own base class is subclassed and its own output type answered, each
sample a rollout on the embedded emulator. Skipped without the ``verl`` extra.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

torch = pytest.importorskip("torch")
agent_loop = pytest.importorskip(
    "verl.experimental.agent_loop.agent_loop", reason="verl is not installed: pip install '.[verl]'"
)

from adapter_helpers import (  # noqa: E402
    TASKS,
    assert_logprobs_are_the_models,
    failing_for,
    served_model,
    settings_overrides,
)
from omegaconf import OmegaConf  # noqa: E402

from fleetroll.errors import ConfigError  # noqa: E402
from fleetroll.integrations import verl as fleetroll_verl  # noqa: E402
from fleetroll.testing.model_server import ModelServer  # noqa: E402
from fleetroll.testing.tiny_model import load_tiny_model, save_tiny_model  # noqa: E402


def test_the_loop_is_verls_own_agent_loop_registered_by_name() -> None:
    base = agent_loop.AgentLoopBase
    assert issubclass(fleetroll_verl.FleetrollAgentLoop, base)
    assert base.__abstractmethods__ == {"run"}
    assert not inspect.isabstract(fleetroll_verl.FleetrollAgentLoop)
    assert inspect.iscoroutinefunction(fleetroll_verl.FleetrollAgentLoop.run)
    # verl instantiates registered loops by their import path (hydra's _target_).
    assert agent_loop._agent_loop_registry["fleetroll"] == {
        "_target_": "fleetroll.integrations.verl.FleetrollAgentLoop"
    }


def test_records_name_their_task_and_the_fleetroll_loop() -> None:
    rows = fleetroll_verl.records(TASKS)
    assert rows[0]["agent_name"] == "fleetroll"
    assert [r["extra_info"]["index"] for r in rows] == list(range(len(rows)))
    assert len({r["extra_info"]["task_key"] for r in rows}) == len(rows)
    assert rows[0]["prompt"][-1]["role"] == "user"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, ModelServer]]:
    with served_model(tmp_path) as served:
        yield served


def make_loop(tokenizer: Any, fleetroll: dict[str, Any] | None) -> Any:
    """The loop as verl's AgentLoopWorker builds it (hydra.utils.instantiate's arguments)."""
    config = OmegaConf.create(
        {"actor_rollout_ref": {"rollout": {"temperature": 1.0}}, "data": {}}
        | ({"fleetroll": fleetroll} if fleetroll is not None else {})
    )
    return fleetroll_verl.FleetrollAgentLoop(
        trainer_config=agent_loop.DictConfigWrap(config=config),
        server_manager=None,
        tokenizer=tokenizer,
        processor=None,
        dataset_cls=None,
        data_config=agent_loop.DictConfigWrap(config.data),
    )


async def test_a_config_without_fleetroll_tasks_is_refused_in_one_line(tmp_path: Path) -> None:
    # async: verl's base class takes the running loop (a worker's), else makes one.
    _, tokenizer = load_tiny_model(save_tiny_model(tmp_path / "tiny", seed=0))
    with pytest.raises(ConfigError, match=r"\+fleetroll\.tasks="):
        make_loop(tokenizer, None)


@pytest.mark.slow
async def test_each_sample_is_a_rollout_answered_as_verls_agent_loop_output(
    served: tuple[Path, ModelServer],
) -> None:
    path, server = served
    model, tokenizer = load_tiny_model(path)
    fleetroll = {"tasks": str(TASKS), "settings": settings_overrides(server)}
    rows = fleetroll_verl.records(TASKS)[:2]
    loops = [make_loop(tokenizer, fleetroll) for _ in range(4)]  # verl: one loop per sample
    try:
        assert loops[0].rollouts is loops[3].rollouts  # one pool per worker process
        outputs: list[Any] = [None] * 4
        async with anyio.create_task_group() as tg:  # verl runs a worker's samples concurrently
            for i, loop in enumerate(loops):

                async def one(i: int = i, loop: Any = loop) -> None:
                    row = rows[i // 2]
                    outputs[i] = await loop.run({"temperature": 1.0}, **row)

                tg.start_soon(one)
        for output in outputs:
            assert type(output) is agent_loop.AgentLoopOutput
            assert output.extra_fields["fleetroll_status"] == "completed"
            n = len(output.response_ids)
            assert n > 0 and len(output.response_mask) == n == len(output.response_logprobs)
            assert set(output.response_mask) <= {0, 1} and output.response_mask[0] == 1
            assert output.reward_score == output.extra_fields["fleetroll_reward"] is not None
            assert output.num_turns >= 2
            # Exactly what the server generated, with the model's own logprobs.
            assert_logprobs_are_the_models(
                model,
                output.prompt_ids,
                output.response_ids,
                output.response_mask,
                output.response_logprobs,
            )
            # verl's own conversion to its batch tensors takes it as is.
            batch = output.as_dict()
            assert batch["responses"].tolist() == output.response_ids
            assert batch["response_mask"].tolist() == output.response_mask
        with pytest.raises(ConfigError, match=r"temperature 0\.5"):
            await loops[0].run({"temperature": 0.5}, **rows[0])
    finally:
        await anyio.to_thread.run_sync(loops[0].rollouts.close)


@pytest.mark.slow
async def test_a_failed_rollout_answers_a_masked_output(tmp_path: Path) -> None:
    from fleetroll.testing.fake_openai import FakeChatServer, VllmShape

    _, tokenizer = load_tiny_model(save_tiny_model(tmp_path / "tiny", seed=0))
    row = fleetroll_verl.records(TASKS)[0]
    broken = row["prompt"][-1]["content"]
    async with FakeChatServer(failing_for(broken), vllm=VllmShape()) as server:
        fleetroll = {
            "tasks": str(TASKS),
            "settings": {
                "policy": {"kind": "openai", "base_url": server.base_url, "max_retries": 0},
                "telemetry": {"db_path": os.devnull},
            },
        }
        loop = make_loop(tokenizer, fleetroll)
        try:
            output = await loop.run({}, **row)
        finally:
            await anyio.to_thread.run_sync(loop.rollouts.close)
    assert type(output) is agent_loop.AgentLoopOutput
    assert output.extra_fields["fleetroll_status"] == "policy_error"
    assert output.extra_fields["fleetroll_reward"] is None and output.reward_score == 0.0
    assert output.response_mask and not any(output.response_mask)
    assert len(output.response_ids) == len(output.response_mask) == len(output.response_logprobs)
    assert broken in tokenizer.decode(output.prompt_ids)  # the task's prompt, for verl's padding
    assert output.num_turns == 1

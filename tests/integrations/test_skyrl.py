"""SkyRL's generator on fleetroll: the installed skyrl's ``GeneratorInterface``, rollouts.

The tiny random model (no download) is served by the vLLM-shaped test server;
SkyRL's own interface is implemented and its own output type answered, each
trajectory a rollout on the embedded emulator. Skipped without the ``skyrl``
extra.

skyrl 0.3.0 says Python >= 3.11, but its base module does not import on 3.11:
pydantic refuses its ``typing.TypedDict`` before Python 3.12. On 3.11 this test
imports it with ``typing.TypedDict`` standing for ``typing_extensions.TypedDict``
(what pydantic asks for) during that import only, then restores it; the
classes tested are skyrl's own either way.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest
import typing_extensions

torch = pytest.importorskip("torch")
pytest.importorskip("skyrl", reason="skyrl is not installed: pip install '.[skyrl]'")

if sys.version_info < (3, 12):
    _stdlib_typeddict = typing.TypedDict
    typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]
try:
    from skyrl.train.generators import base

    from fleetroll.integrations import skyrl as fleetroll_skyrl
finally:
    if sys.version_info < (3, 12):
        typing.TypedDict = _stdlib_typeddict  # type: ignore[misc]

from adapter_helpers import (  # noqa: E402
    TASKS,
    assert_logprobs_are_the_models,
    failing_for,
    served_model,
    settings_overrides,
)

from fleetroll.errors import ConfigError  # noqa: E402
from fleetroll.settings import load_settings  # noqa: E402
from fleetroll.testing.model_server import ModelServer  # noqa: E402
from fleetroll.testing.tiny_model import load_tiny_model  # noqa: E402


def test_the_generator_implements_skyrls_own_interface() -> None:
    assert issubclass(fleetroll_skyrl.FleetrollGenerator, base.GeneratorInterface)
    assert base.GeneratorInterface.__abstractmethods__ == {"generate"}
    assert not inspect.isabstract(fleetroll_skyrl.FleetrollGenerator)
    assert inspect.iscoroutinefunction(fleetroll_skyrl.FleetrollGenerator.generate)


@pytest.mark.slow
@pytest.mark.skipif(sys.version_info >= (3, 12), reason="skyrl imports on Python 3.12")
def test_on_python_3_11_the_adapter_says_in_one_line_that_skyrl_needs_3_12() -> None:
    answer = subprocess.run(
        [sys.executable, "-c", "import fleetroll.integrations.skyrl"],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert answer.returncode == 1
    last = answer.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: fleetroll.integrations.skyrl: skyrl does not import")
    assert "needs Python 3.12" in last


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, ModelServer]]:
    with served_model(tmp_path) as served:
        yield served


@pytest.mark.slow
async def test_a_batch_is_rollouts_answered_as_skyrls_generator_output(
    served: tuple[Path, ModelServer],
) -> None:
    path, server = served
    model, tokenizer = load_tiny_model(path)
    settings = load_settings(**settings_overrides(server))
    rows = fleetroll_skyrl.records(TASKS, settings)[:2]
    # SkyRL's batch: each prompt repeated G = 2 times, the dataset's other columns as env_extras.
    batch: dict[str, Any] = {
        "prompts": [row["prompt"] for row in rows for _ in range(2)],
        "env_classes": [row["env_class"] for row in rows for _ in range(2)],
        "env_extras": [{"task_key": row["task_key"]} for row in rows for _ in range(2)],
        "sampling_params": {"temperature": 1.0},
        "trajectory_ids": [
            base.TrajectoryID(instance_id=row["task_key"], repetition_id=r)
            for row in rows
            for r in range(2)
        ],
        "batch_metadata": base.BatchMetadata(global_step=0, training_phase="train"),
    }
    generator = fleetroll_skyrl.FleetrollGenerator(TASKS, settings, tokenizer=tokenizer)
    try:
        output = await generator.generate(batch)
        with pytest.raises(ConfigError, match=r"temperature 0\.5"):
            await generator.generate(batch | {"sampling_params": {"temperature": 0.5}})
        unknown = batch | {"env_extras": [{"task_key": "no-such-task"}] * 4}
        with pytest.raises(ConfigError, match="no-such-task"):
            await generator.generate(unknown)
    finally:
        await anyio.to_thread.run_sync(generator.close)

    assert set(output) == set(base.GeneratorOutput.__annotations__)
    assert output["trajectory_ids"] == batch["trajectory_ids"]
    assert output["stop_reasons"] == ["completed"] * 4
    assert output["rollout_metrics"]["fleetroll/failed"] == 0
    for i in range(4):
        prompt, response = output["prompt_token_ids"][i], output["response_ids"][i]
        mask, logprobs = output["loss_masks"][i], output["rollout_logprobs"][i]
        assert len(response) == len(mask) == len(logprobs) > 0
        assert set(mask) <= {0, 1} and mask[0] == 1
        assert output["rewards"][i] == output["env_metrics"][i]["fleetroll_reward"] is not None
        assert_logprobs_are_the_models(model, prompt, response, mask, logprobs)
    # Each trajectory ran its own task: the prompt the server saw is that task's.
    for i, key in enumerate(k for row in rows for k in [row["task_key"]] * 2):
        task_prompt = rows[i // 2]["prompt"][-1]["content"]
        assert key == batch["env_extras"][i]["task_key"]
        assert task_prompt in tokenizer.decode(output["prompt_token_ids"][i])


@pytest.mark.slow
async def test_a_failed_rollout_is_a_masked_entry_in_its_place(tmp_path: Path) -> None:
    from fleetroll.testing.fake_openai import FakeChatServer, VllmShape
    from fleetroll.testing.tiny_model import save_tiny_model

    _, tokenizer = load_tiny_model(save_tiny_model(tmp_path / "tiny", seed=0))
    rows = fleetroll_skyrl.records(TASKS)[:2]
    broken = rows[1]["prompt"][-1]["content"]
    async with FakeChatServer(failing_for(broken), vllm=VllmShape()) as server:
        settings = load_settings(
            policy={"kind": "openai", "base_url": server.base_url, "max_retries": 0},
            telemetry={"db_path": os.devnull},
        )
        generator = fleetroll_skyrl.FleetrollGenerator(TASKS, settings, tokenizer=tokenizer)
        batch: dict[str, Any] = {
            "prompts": [row["prompt"] for row in rows for _ in range(2)],
            "env_classes": ["fleetroll"] * 4,
            "env_extras": [{"task_key": row["task_key"]} for row in rows for _ in range(2)],
            "sampling_params": None,
            "trajectory_ids": None,
            "batch_metadata": None,
        }
        try:
            output = await generator.generate(batch)
        finally:
            await anyio.to_thread.run_sync(generator.close)
    assert output["stop_reasons"][:2] == ["completed"] * 2
    assert output["stop_reasons"][2:] == ["policy_error"] * 2
    assert output["rollout_metrics"]["fleetroll/failed"] == 2
    for i in (2, 3):  # in their places, masked, the prompt still the task's
        assert output["loss_masks"][i] and not any(output["loss_masks"][i])
        assert output["rewards"][i] == 0.0 and output["env_metrics"][i]["fleetroll_reward"] is None
        assert broken in tokenizer.decode(output["prompt_token_ids"][i])
        assert len(output["response_ids"][i]) == len(output["rollout_logprobs"][i])
    for i in (0, 1):
        assert (
            any(output["loss_masks"][i])
            and output["env_metrics"][i]["fleetroll_reward"] is not None
        )

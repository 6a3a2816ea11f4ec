"""A result says what the model saw: its system prompt and tools as sent, so turn 0's
prompt ids re-render from the result alone with the model's chat template.

The tiny model behind its vLLM-shaped server (:class:`~fleetroll.testing.model_server.ModelServer`),
fleetroll's OpenAI policy, the emulator's ledger tasks, on both executors (Ray
pickles the results). Skipped without the ``train`` extra (torch, transformers).
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from fleetroll.emulator.process import EmulatorProcess
from fleetroll.policies import OpenAIChatPolicy
from fleetroll.pool.assembly import chat_policy_config
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import RolloutResult
from fleetroll.settings import load_settings
from fleetroll.testing.model_server import ModelServer
from fleetroll.testing.tiny_model import load_tiny_model, save_tiny_model
from fleetroll.training.trajectory import training_rows
from training_helpers import TASKS

#: Integration tests (a model server, the emulator over loopback): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

SYSTEM = "You are a careful bookkeeper. Use the tools."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-qwen2", seed=0)


def rendered(tokenizer: Any, result: RolloutResult, *, shown: bool = True) -> list[int]:
    """Turn 0's prompt ids from the result alone (``shown``: with its system prompt
    and tools; without them, as a result of earlier versions would allow)."""
    first_answer = next(
        (i for i, m in enumerate(result.transcript) if m["role"] == "assistant"),
        len(result.transcript),
    )
    messages = list(result.transcript[:first_answer])
    if shown and result.system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": result.system_prompt})
    text = tokenizer.apply_chat_template(
        messages,
        tools=result.tools if shown else None,
        tokenize=False,
        add_generation_prompt=True,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("executor", ["local", "ray"])
async def test_turn_0_re_renders_exactly_from_each_result_alone(
    model_dir: Path, executor: str, request: pytest.FixtureRequest
) -> None:
    _, tokenizer = load_tiny_model(model_dir)
    tasks = [t for t in TASKS.values() if t.env_key == "ledger"][:4]
    async with (
        ModelServer(model_dir, default_max_tokens=8) as server,
        EmulatorProcess() as emu,
        AsyncExitStack() as stack,
    ):
        settings = load_settings(
            provisioning={"creates_per_second": 1000, "max_concurrent_creates": 16},
            policy={
                "kind": "openai",
                "base_url": server.base_url,
                "model": server.model_name,
                "max_tokens": 8,
                "return_token_ids": True,
                "logprobs": True,
                "temperature": 1.0,
                "system_prompt": SYSTEM,
            },
        )
        if executor == "ray":
            pytest.importorskip("ray")
            request.getfixturevalue("local_ray")
            from fleetroll.pool.ray.executor import ray_pool

            opened = ray_pool(settings, api_key=emu.api_key, base_url=emu.base_url, num_actors=2)
        else:
            opened = RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url)
        pool = await stack.enter_async_context(opened)
        policy = OpenAIChatPolicy.from_config(chat_policy_config(settings))
        await stack.enter_async_context(policy)
        with anyio.fail_after(300):
            results = await pool.run_batch(tasks, policy, samples_per_task=4).results()
        first_tools = next(b.get("tools") for path, b in server.requests if "chat" in path)

    assert len(results) == 16
    assert all(r.turns and r.turns[0].prompt_token_ids for r in results), [r.error for r in results]
    assert all(r.system_prompt == SYSTEM for r in results)
    assert all(r.tools == first_tools for r in results)  # the ledger's tools, as sent
    exact = [rendered(tokenizer, r) == r.turns[0].prompt_token_ids for r in results]
    assert exact == [True] * 16
    # In the trainer's shape, each row's prompt is what re-renders: turn 0's prompt ids.
    groups: dict[str | None, list[RolloutResult]] = {}
    for r in results:
        groups.setdefault(r.group_id, []).append(r)
    rows = training_rows(groups.values(), group_size=4)
    assert len(rows) == 16
    for row in rows:
        (r,) = [r for r in results if r.rollout_id == row["rollout_id"]]
        assert row["prompt_ids"] == rendered(tokenizer, r)
        generated = sum(len(t.completion_token_ids or ()) for t in r.turns)
        assert sum(row["completion_mask"]) + row["dropped_tokens"] == generated
    # Without what the model saw, no result re-renders (as before these fields).
    assert not any(
        rendered(tokenizer, r, shown=False) == r.turns[0].prompt_token_ids for r in results
    )

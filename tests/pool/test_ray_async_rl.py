"""Asynchronous RL's data on the Ray executor, as on the local one: weight
updates under ``abort`` and ``in_flight`` (each token's version), images with
their placeholder spans, and routed experts, all made on the actors and carried
back in the results. A real tiny model behind
:class:`~fleetroll.testing.model_server.ModelServer`, rollouts on the emulator.

One module, so Ray starts once (``local_ray``) for its tests.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from fleetroll.emulator import Emulator  # noqa: E402
from fleetroll.policies import OpenAIChatPolicy  # noqa: E402
from fleetroll.pool.assembly import chat_policy_config  # noqa: E402
from fleetroll.pool.ray.executor import ray_pool  # noqa: E402
from fleetroll.results import RolloutResult  # noqa: E402
from fleetroll.rollout.agent_command import CommandAgent  # noqa: E402
from fleetroll.settings import load_settings  # noqa: E402
from fleetroll.tasks import TaskSpec  # noqa: E402
from fleetroll.testing.model_server import (  # noqa: E402
    ForcedRequest,
    ModelServer,
    routed_experts_of,
)
from fleetroll.testing.tiny_model import (  # noqa: E402
    TinyModelSpec,
    load_tiny_model,
    save_tiny_model,
)
from fleetroll.training.trajectory import training_rows  # noqa: E402
from training_helpers import TASKS  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def forced_solutions(tasks: list[TaskSpec], steps: int = 2) -> Any:
    """The forced answers of ``tasks``: each task's first ``steps`` solution steps
    as hermes tool calls, by the turn number, then "done"."""
    by_prompt = {t.prompt: t for t in tasks}

    def forced(request: ForcedRequest) -> str:
        body = request.body
        prompt = next(m["content"] for m in body["messages"] if m.get("role") == "user")
        solution = (by_prompt[prompt].solution or ())[:steps]
        turn = sum(1 for m in body["messages"] if m.get("role") == "assistant")
        if turn >= len(solution):
            return "done"
        call = {"name": solution[turn].name, "arguments": dict(solution[turn].arguments)}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"

    return forced


async def on_ray(
    server: ModelServer,
    tasks: list[TaskSpec],
    policy: dict[str, Any],
    *,
    update: Path | None = None,
    agent: list[str] | None = None,
) -> list[RolloutResult]:
    """``tasks`` on two Ray actors with the built-in openai policy on ``server``
    (the agent command ``agent`` instead, when given); with ``update``, the
    weights are updated (``pool.policy_paused()``, version 1) a few tokens into
    the first generation."""
    base = {"kind": "openai", "base_url": server.base_url, "model": server.model_name}
    settings = load_settings(
        provisioning={"backoff_initial_s": 0.05, "backoff_max_s": 0.5},
        policy={**base, "trajectory": True, "logprobs": True, **policy},
    )
    async with (
        Emulator() as emu,
        ray_pool(settings, api_key=emu.api_key, base_url=emu.base_url, num_actors=2) as pool,
        (
            OpenAIChatPolicy.from_config(chat_policy_config(settings))
            if agent is None
            else CommandAgent.from_config(agent, chat_policy_config(settings))
        ) as model,
    ):
        with anyio.fail_after(400):
            batch = pool.run_batch(tasks, model)
            if update is not None:
                while not any(p.endswith("/chat/completions") for p, _ in server.requests):
                    await anyio.sleep(0.01)
                await anyio.sleep(8 * 0.03)  # a few tokens into the first generation
                async with pool.policy_paused():
                    await server.update_weights(update)
                    await pool.set_policy_version(1)
            return await batch.results()


def recomputed(model: Any, prompt: list[int], completion: list[int]) -> list[float]:
    """Each completion token's raw logprob under ``model``: one forward pass."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    raw = torch.log_softmax(logits, dim=-1)
    return [float(raw[len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]


@pytest.mark.parametrize("mode", ["abort", "in_flight"])
async def test_on_ray_every_token_carries_the_version_of_the_weights_that_produced_it(
    local_ray: None, tmp_path: Path, mode: str
) -> None:
    model_dir = save_tiny_model(tmp_path / "tiny", seed=0)
    step = save_tiny_model(tmp_path / "step-1", seed=1)  # the same shape, other weights
    models = {0: load_tiny_model(model_dir)[0], 1: load_tiny_model(step)[0]}
    tasks = [t for t in TASKS.values() if t.env_key == "ledger"][:3]
    server = ModelServer(model_dir, in_flight_updates=mode == "in_flight", decode_delay_s=0.03)
    async with server:
        policy = {"weight_update": mode, "max_tokens": 32, "temperature": 1.0}
        results = await on_ray(server, tasks, policy, update=step)
        resumed = [b for p, b in server.requests if p == "/v1/chat/completions/tokens"]
        aborted = server.aborted
    assert server.version == 1
    assert sorted(r.task_key for r in results) == sorted(t.key for t in tasks)
    turns = [turn for r in results for turn in r.turns]
    straddling = 0
    for turn in turns:
        prompt, ids, versions = (
            turn.prompt_token_ids,
            turn.completion_token_ids,
            turn.token_versions,
        )
        assert prompt and ids and versions is not None and None not in versions, turn
        assert len(versions) == len(ids) == len(turn.logprobs or [])
        for version in set(versions):
            expected = recomputed(models[version], prompt, ids)  # type: ignore[index]
            for got, want, v in zip(turn.logprobs or [], expected, versions, strict=True):
                if v == version:
                    assert got == pytest.approx(want, abs=1e-4)
        straddling += len(set(versions)) > 1
    assert straddling >= 1  # the update landed in the middle of a generation
    if mode == "abort":
        assert aborted >= 1 and len(resumed) == aborted
        assert any("aborted after" in (t.token_versions_note or "") for t in turns)
    for result in results:
        assert result.trajectory is not None
        masked = zip(result.trajectory.token_versions, result.trajectory.loss_mask, strict=True)
        generated = [v for v, m in masked if m]
        assert generated == [v for t in result.turns for v in t.token_versions or []]


async def test_on_ray_each_image_keeps_its_exact_span_and_the_pixels_the_server_received(
    local_ray: None, tmp_path: Path
) -> None:
    tasks = [t for t in TASKS.values() if t.modality == "computer_use"][:2]
    max_pixels = 28 * 28 * 12
    path = save_tiny_model(tmp_path / "tiny-vl", TinyModelSpec(vision=True))
    server = ModelServer(
        path, vision=True, image_max_pixels=max_pixels, forced=forced_solutions(tasks)
    )
    async with server:
        policy = {"token_in": True, "image_max_pixels": max_pixels}
        results = await on_ray(server, tasks, policy)
        received = {image.sha256: image.png for image in server.received_images}
        pad = server.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert all(r.status == "completed" and len(r.turns) == 3 for r in results), [
        r.error for r in results
    ]
    for result in results:
        for turn in result.turns:
            assert turn.images and turn.training_data_error is None
            prompt = turn.prompt_token_ids or []
            runs = [i for i, t in enumerate(prompt) if t == pad]
            assert sorted(i for im in turn.images for i in range(im.start, im.end)) == runs
            assert all(received[image.sha256] == image.png() for image in turn.images)
        trajectory = result.trajectory
        assert trajectory is not None and trajectory.images == result.turns[-1].images
        (row,) = training_rows([[result]])
        assert row["images"] == [image.model_dump() for image in trajectory.images]


async def test_on_ray_the_routed_experts_of_every_token_reach_turns_and_trajectories(
    local_ray: None, tmp_path: Path
) -> None:
    task = TASKS["ledger-010"]
    path = save_tiny_model(tmp_path / "tiny-moe", TinyModelSpec(num_experts=4))
    server = ModelServer(
        path, return_routed_experts=True, forced=forced_solutions([task]), default_max_tokens=256
    )
    async with server:
        (result,) = await on_ray(server, [task], {"token_in": True})
        served = server.model
    assert len(result.turns) == 3, result.error
    for turn in result.turns:
        assert turn.routed_experts is not None and turn.training_data_error is None
        tokens = [*(turn.prompt_token_ids or []), *(turn.completion_token_ids or [])]
        assert turn.routed_experts.rows() == routed_experts_of(served, tokens)
    trajectory = result.trajectory
    assert trajectory is not None and trajectory.routed_experts is not None
    assert trajectory.routed_experts.rows() == routed_experts_of(served, trajectory.input_ids)


#: One chat completion through the gateway (not streamed); its ending and token
#: ids as the final answer.
ONE_CALL = """
import json, os, urllib.request
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
body = {"model": "any", "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}]}
request = urllib.request.Request(base + "/chat/completions", json.dumps(body).encode(), {
    "Authorization": "Bearer " + key, "Content-Type": "application/json"})
choice = json.load(urllib.request.urlopen(request, timeout=120))["choices"][0]
with open(os.environ["FLEETROLL_ANSWER_FILE"], "w") as f:
    json.dump({"finish": choice["finish_reason"], "token_ids": choice.get("token_ids")}, f)
"""


async def test_on_ray_an_agent_s_aborted_call_is_resumed_and_its_tokens_carry_their_versions(
    local_ray: None, tmp_path: Path
) -> None:
    model_dir = save_tiny_model(tmp_path / "tiny", seed=0)
    step = save_tiny_model(tmp_path / "step-1", seed=1)
    server = ModelServer(model_dir, decode_delay_s=0.03)
    async with server:
        policy = {"weight_update": "abort", "temperature": 1.0, "return_token_ids": True}
        argv = [sys.executable, "-c", ONE_CALL]
        (result,) = await on_ray(server, [TASKS["ledger-001"]], policy, update=step, agent=argv)
        paths = [p for p, _ in server.requests]
        aborted = server.aborted
    assert result.status == "completed", result.error
    (turn,) = result.turns
    ids, versions = turn.completion_token_ids or [], turn.token_versions or []
    assert aborted == 1 and paths.count("/v1/chat/completions/tokens") == 1
    assert versions[0] == 0 and versions[-1] == 1 and sorted(versions) == versions
    assert len(versions) == len(ids) and "aborted after" in (turn.token_versions_note or "")
    answer = json.loads(result.final_answer or "{}")
    assert answer["finish"] != "abort" and answer["token_ids"] == ids

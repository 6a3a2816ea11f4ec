"""Token-in on a plain server (``policy.token_in = "completions"``): the chat
template rendered and tool calls parsed on fleetroll's side, every prompt sent
as token ids to ``/v1/completions`` of a vLLM-shaped server of the tiny model
that has no token route. The model's tool calls are forced texts (the random
model never writes one) whose logprobs are still the model's own; the last
turn of one rollout is sampled freely. Skipped without the ``train`` extra.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from fleetroll.emulator.process import EmulatorProcess  # noqa: E402
from fleetroll.errors import PolicyError  # noqa: E402
from fleetroll.policies import OpenAIChatPolicy  # noqa: E402
from fleetroll.pool.assembly import chat_policy_config  # noqa: E402
from fleetroll.pool.preflight import check_policy  # noqa: E402
from fleetroll.pool.rollout_pool import RolloutPool  # noqa: E402
from fleetroll.results import RolloutResult  # noqa: E402
from fleetroll.settings import load_settings  # noqa: E402
from fleetroll.testing.model_server import ForcedRequest, ModelServer  # noqa: E402
from fleetroll.testing.tiny_model import load_tiny_model, save_tiny_model  # noqa: E402
from fleetroll.training.trajectory import stitch, training_rows  # noqa: E402
from training_helpers import TASKS  # noqa: E402

#: Integration tests (real servers, the emulator over loopback): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

LEDGER = [t for t in TASKS.values() if t.env_key == "ledger"][:3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-qwen2", seed=0)


def call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def ledger_agent(model_dir: Path) -> Any:
    """Forced texts: turn 0 looks around (text and two calls), turn 1 plays the
    task's solution, then a last answer without calls ends the rollout: sampled
    freely for the first task, forced for the others."""
    _, tokenizer = load_tiny_model(model_dir)

    def forced(request: ForcedRequest) -> str | None:
        text = tokenizer.decode(list(request.prompt_ids), skip_special_tokens=False)
        task = next(t for t in LEDGER if t.prompt in text)
        answered = text.count("</tool_response>")
        if answered == 0:
            return "Let me look at the accounts first.\n" + "\n".join(
                [call("list_accounts", {}), call("get_balance", {"account": "Checking"})]
            )
        if answered == 2:
            step = (task.solution or ())[0]
            return call(step.name, dict(step.arguments))
        # One task's last turn is sampled freely (slow on a shared CPU: one is enough).
        return None if task is LEDGER[0] else "The transaction is recorded."

    return forced


def tool_answers_rendered(tokenizer: Any, answers: Sequence[str]) -> list[int]:
    """What the Qwen2.5 template puts after an assistant message's end: its
    newline, the tool answers in one user turn, then the generation prompt."""
    text = "\n<|im_start|>user"
    text += "".join(f"\n<tool_response>\n{a}\n</tool_response>" for a in answers)
    text += "<|im_end|>\n<|im_start|>assistant\n"
    return list(tokenizer.encode(text, add_special_tokens=False))


def masked_runs(row: dict[str, Any]) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    """The row's runs of tokens in the loss, with their logprobs."""
    runs: list[tuple[list[int], list[float]]] = []
    previous = 0
    for token, mask, logprob in zip(
        row["input_ids"], row["loss_mask"], row["logprobs"], strict=True
    ):
        if mask and not previous:
            runs.append(([], []))
        if mask:
            runs[-1][0].append(token)
            runs[-1][1].append(logprob)
        previous = mask
    return [(tuple(ids), tuple(lps)) for ids, lps in runs]


def recomputed(model: Any, prompt: list[int], completion: list[int]) -> list[float]:
    """What a trainer computes: one forward pass, the raw log-softmax."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    raw = torch.log_softmax(logits, dim=-1)
    return [float(raw[len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]


def settings_for(server: ModelServer, **policy: Any) -> Any:
    return load_settings(
        provisioning={"creates_per_second": 1000, "max_concurrent_creates": 16},
        policy={
            "kind": "openai",
            "base_url": server.base_url,
            "model": server.model_name,
            "tokenizer": str(server.model_path),
            "token_in": "completions",
            "max_tokens": 96,
            "logprobs": True,
            "temperature": 1.0,
            **policy,
        },
    )


def check_rollouts(results: Sequence[RolloutResult], server: ModelServer, tokenizer: Any) -> None:
    """No drift, every generated token in exactly one row under the mask with the
    server's logprob, and each turn's prompt the last one's plus the tool answers."""
    assert len(results) == len(LEDGER)
    # Only /v1/completions was asked: no chat route, no /tokenize.
    assert {path for path, _ in server.requests} == {"/v1/completions"}
    for result in results:
        assert result.reward == 1.0, result.error  # the solution played through the parsed call
        turns = result.turns
        assert len(turns) == 3  # look around, solve, then the free sample ends it
        trajectory = stitch(turns)
        assert trajectory is not None and not trajectory.drift
        calls = [m for m in result.transcript if m.get("role") == "assistant"]
        assert [len(m.get("tool_calls") or ()) for m in calls] == [2, 1, 0]
        assert calls[0]["content"] == "Let me look at the accounts first.\n"
        answered: list[list[str]] = []  # the tool answers after each assistant message
        for message in result.transcript:
            if message.get("role") == "assistant":
                answered.append([])
            elif message.get("role") == "tool":
                answered[-1].append(message["content"])
        for number, (before, after) in enumerate(itertools.pairwise(turns)):
            assert before.prompt_token_ids and before.completion_token_ids
            assert after.prompt_token_ids
            done = [*before.prompt_token_ids, *before.completion_token_ids]
            assert after.prompt_token_ids[: len(done)] == done
            rest = after.prompt_token_ids[len(done) :]
            assert rest == tool_answers_rendered(tokenizer, answered[number])
    # Each request's prompt is the turn's prompt; the first is the template's own.
    prompts = [tuple(body["prompt"]) for _, body in server.requests if body]  # {}: pre-flight
    assert Counter(prompts) == Counter(tuple(t.prompt_token_ids) for r in results for t in r.turns)
    rows = training_rows([results])
    assert len(rows) == len(results)  # one row each: nothing drifted
    runs = Counter(run for row in rows for run in masked_runs(row))
    generated = Counter((g.token_ids, g.logprobs) for _, g in server.generations)
    assert runs == generated  # every generated token once, under the mask, its logprob
    assert sum(len(ids) for ids, _ in generated) == sum(sum(r["loss_mask"]) for r in rows)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("executor", ["local", "ray"])
async def test_rollouts_on_a_server_without_the_token_route_never_drift_and_lose_no_token(
    model_dir: Path, executor: str, request: pytest.FixtureRequest
) -> None:
    _, tokenizer = load_tiny_model(model_dir)
    forced = ledger_agent(model_dir)
    async with (
        ModelServer(model_dir, token_route=False, forced=forced) as server,
        EmulatorProcess() as emu,
        AsyncExitStack() as stack,
    ):
        settings = settings_for(server)
        assert await check_policy(settings.policy, api_key=None, timeout_s=30) == []
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
        with anyio.fail_after(240):
            results = await pool.run_batch(LEDGER, policy).results()
    check_rollouts(results, server, tokenizer)
    if executor == "local":  # forced or sampled, each logprob is the model's own
        model, _ = load_tiny_model(model_dir)
        for turn in (t for r in results for t in r.turns):
            assert turn.prompt_token_ids and turn.completion_token_ids and turn.logprobs
            assert turn.logprobs == pytest.approx(
                recomputed(model, turn.prompt_token_ids, turn.completion_token_ids), abs=1e-4
            )
    for result in results:  # the first prompt: the task's, then the generation prompt
        text = tokenizer.decode(result.turns[0].prompt_token_ids)
        assert result.task_key and text.endswith("<|im_start|>assistant\n")


async def test_a_plain_server_s_missing_route_and_a_wrong_tokenizer_fail_the_pre_flight(
    model_dir: Path, tmp_path: Path
) -> None:
    async with ModelServer(model_dir, token_route=False) as server:
        settings = settings_for(server, tokenizer=str(tmp_path / "nowhere"))
        problems = await check_policy(settings.policy, api_key=None, timeout_s=30)
        assert len(problems) == 1
        assert problems[0].startswith(f"policy.tokenizer {str(tmp_path / 'nowhere')!r}")
        bare = settings_for(server, base_url=server.root_url + "/nothing/v1")
        problems = await check_policy(bare.policy, api_key=None, timeout_s=30)
        assert problems and "/nothing/v1/models" in problems[0]
        policy = OpenAIChatPolicy.from_config(chat_policy_config(settings))
        async with policy:
            with pytest.raises(PolicyError, match="could not be loaded"):
                await policy.act(LEDGER[0], [{"role": "user", "content": "hi"}], [])

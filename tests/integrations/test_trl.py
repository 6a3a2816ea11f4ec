"""TRL's GRPOTrainer trains on fleetroll's rollouts: a tiny model, its server, the emulator.

The model is the tiny random Qwen2 built from a config (no download), served
by the vLLM-shaped test server of that same model; TRL's own ``GRPOTrainer``
(CPU, no vLLM) trains it for 2 optimizer steps with
``fleetroll.integrations.trl``, each completion a rollout on the embedded
emulator. The trainer's script is TRL's usual one plus the integration's
few lines (marked ``# fleetroll``). Skipped without the ``train`` extra.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from fleetroll.integrations import trl as fleetroll_trl  # noqa: E402
from fleetroll.settings import Settings, config_dir, load_settings  # noqa: E402
from fleetroll.testing.model_server import ModelServer  # noqa: E402
from fleetroll.testing.tiny_model import load_tiny_model, save_tiny_model  # noqa: E402
from fleetroll.training.weight_sync import VLLMReloadSync  # noqa: E402

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = [
    pytest.mark.slow,
    # transformers 5 renamed what TRL still calls `gradient_checkpointing*`.
    pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning"),
]

TASKS = config_dir() / "tasks" / "ledger.jsonl"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, ModelServer]]:
    path = save_tiny_model(tmp_path / "tiny", seed=0)
    with anyio.from_thread.start_blocking_portal() as portal:
        server = ModelServer(path, default_max_tokens=8)
        with portal.wrap_async_context_manager(server):
            yield path, server


def settings_for(server: ModelServer, **policy: Any) -> Settings:
    return load_settings(
        policy={
            "kind": "openai",
            "base_url": server.base_url,
            "model": server.model_name,
            "temperature": 1.0,
            "max_tokens": 8,
            **policy,
        },
        telemetry={"db_path": os.devnull},
    )


def token_mean(
    completion_ids: list[list[int]], fleetroll_reward: list[float | None], **kwargs: Any
) -> list[float | None]:
    """A reward function of the trainer's own beside fleetroll's: the random
    model never solves a task, and this one differs between samples, so the
    advantages are not all 0 and the weights move. None where fleetroll's is."""
    return [
        None if r is None else sum(ids) / len(ids) / 1000
        for ids, r in zip(completion_ids, fleetroll_reward, strict=True)
    ]


def recomputed(
    weights: dict[str, Any], model: Any, prompt: list[int], completion: list[int]
) -> Any:
    """Each completion token's logprob, from one forward pass of ``model`` with ``weights``."""
    model.load_state_dict(weights)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    start = len(prompt) - 1
    logprobs = torch.log_softmax(logits[start : start + len(completion)], dim=-1)
    return logprobs.gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1)


Call = tuple[dict[str, Any], list[Any], dict[str, Any]]


def train_two_steps(
    task_records: list[dict[str, Any]],
    settings: Settings,
    model: Any,
    tokenizer: Any,
    tmp_path: Path,
    batch_size: int,
) -> tuple[Any, list[Call], int]:
    """TRL's usual script plus the integration's lines (marked ``# fleetroll``), for
    2 steps of 2 generations a prompt; each call to the rollout function kept with
    the weights it ran with. Returns the trainer, the calls and the last policy version."""
    from trl import GRPOConfig, GRPOTrainer

    calls: list[Call] = []
    with fleetroll_trl.RolloutFunc(  # fleetroll
        task_records, settings, weight_sync=VLLMReloadSync(settings.policy.servers)
    ) as rollouts:

        def recorded(prompts: list[Any], trainer: Any) -> dict[str, Any]:
            out = rollouts(prompts, trainer)
            calls.append((copy.deepcopy(trainer.model.state_dict()), prompts, out))
            return out

        args = GRPOConfig(
            output_dir=str(tmp_path / "out"),
            num_generations=2,
            per_device_train_batch_size=batch_size,
            max_steps=2,
            learning_rate=1e-2,
            temperature=1.0,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_steps=1,
        )
        trainer = GRPOTrainer(
            model=model,
            args=args,
            processing_class=tokenizer,
            train_dataset=fleetroll_trl.dataset(task_records),  # fleetroll
            rollout_func=recorded,  # fleetroll: `rollouts` itself in a user's script
            reward_funcs=[fleetroll_trl.reward, token_mean],  # fleetroll (+ the trainer's own)
        )
        trainer.train()
        return trainer, calls, rollouts.policy_version


def test_grpo_trains_two_steps_on_fleetroll_rollouts_with_exact_logprobs_and_versions(
    served: tuple[Path, ModelServer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental"
    path, server = served
    settings = settings_for(server)
    model, tokenizer = load_tiny_model(path)
    task_records = _records()[:2]

    trainer, calls, version = train_two_steps(task_records, settings, model, tokenizer, tmp_path, 4)

    assert trainer.state.global_step == 2
    assert version == 1 and server.version == 1
    assert len(calls) == 2
    fresh, _ = load_tiny_model(path)
    for step, (weights, prompts, out) in enumerate(calls):
        # Exactly TRL's prompts, in its order: each task's two repeats a group.
        keys = [next(m["task_key"] for m in p) for p in prompts]
        assert len(keys) == 4 and keys[0] == keys[1] and keys[2] == keys[3]
        for name in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "fleetroll_reward"):
            assert len(out[name]) == len(prompts)
        for i in range(len(prompts)):
            mask = out["env_mask"][i]
            assert len(mask) == len(out["completion_ids"][i]) == len(out["logprobs"][i])
            assert out["fleetroll_status"][i] == "scored"
            assert out["fleetroll_reward"][i] is not None
            versions = out["fleetroll_policy_versions"][i]
            generated = [v for v, m in zip(versions, mask, strict=True) if m]
            assert generated and set(generated) == {step}  # turns after step 1: version 1
            ours = recomputed(weights, fresh, out["prompt_ids"][i], out["completion_ids"][i])
            served_logprobs = torch.tensor(out["logprobs"][i])
            on = torch.tensor(mask, dtype=torch.bool)
            assert torch.allclose(ours[on], served_logprobs[on], atol=1e-4)
    # The trainer moved: the two steps' weights differ.
    assert any(not torch.equal(calls[0][0][name], calls[1][0][name]) for name in calls[0][0])


@pytest.fixture
def served_without_token_route(tmp_path: Path) -> Iterator[tuple[Path, ModelServer]]:
    """A plain server: /v1/chat/completions and /v1/completions, no token route."""
    path = save_tiny_model(tmp_path / "tiny", seed=0)
    with anyio.from_thread.start_blocking_portal() as portal:
        server = ModelServer(path, default_max_tokens=8, token_route=False)
        with portal.wrap_async_context_manager(server):
            yield path, server


def test_on_a_faulty_fleet_and_a_plain_server_each_batch_has_g_rows_per_prompt(
    served_without_token_route: tuple[Path, ModelServer],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Token-in through /v1/completions (no token route on the server), verifiers
    that fail half the time: every TRL batch still has exactly G rows per prompt,
    a failed rollout a row with nothing under the mask and no reward, and every
    other row's logprobs are the model's."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    path, server = served_without_token_route
    settings = load_settings(
        policy={
            "kind": "openai",
            "base_url": server.base_url,
            "model": server.model_name,
            "temperature": 1.0,
            "max_tokens": 8,
            "token_in": "completions",
            "tokenizer": str(path),
        },
        emulator={
            "profile": "faulty",
            "profiles": {"faulty": {"seed": 3, "p_verifier_error": 0.5}},
        },
        # Each verifier call tried once: half the rollouts fail, and with 16 of
        # them, both kinds of row are all but sure to be there (2 in 65536 not).
        retries={"verifier_attempts": 1},
        telemetry={"db_path": os.devnull},
    )
    model, tokenizer = load_tiny_model(path)
    task_records = _records()[:4]
    trainer, calls, _ = train_two_steps(task_records, settings, model, tokenizer, tmp_path, 8)

    assert trainer.state.global_step == 2 and len(calls) == 2
    assert not any(route == "/v1/chat/completions/tokens" for route, _ in server.requests)
    fresh, _ = load_tiny_model(path)
    statuses = []
    for weights, prompts, out in calls:
        keys = [next(m["task_key"] for m in p) for p in prompts]
        assert len(keys) == 8 and all(keys[i] == keys[i + 1] for i in range(0, 8, 2))
        for name in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "fleetroll_reward"):
            assert len(out[name]) == len(prompts)
        for i in range(len(prompts)):
            mask = out["env_mask"][i]
            status = out["fleetroll_status"][i]
            statuses.append(status)
            assert len(mask) == len(out["completion_ids"][i]) == len(out["logprobs"][i])
            if status == "scored":
                assert out["fleetroll_reward"][i] is not None and any(mask)
                ours = recomputed(weights, fresh, out["prompt_ids"][i], out["completion_ids"][i])
                on = torch.tensor(mask, dtype=torch.bool)
                assert torch.allclose(ours[on], torch.tensor(out["logprobs"][i])[on], atol=1e-4)
            else:
                assert status == "failed" and out["fleetroll_reward"][i] is None
                assert not any(mask)
    assert "failed" in statuses and "scored" in statuses


def _records() -> list[dict[str, Any]]:
    import json

    return [json.loads(line) for line in TASKS.read_text(encoding="utf-8").splitlines() if line]

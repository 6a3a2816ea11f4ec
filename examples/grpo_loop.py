"""A GRPO-style training loop on fleetroll, runnable without a GPU.

What a trainer does with fleetroll, end to end, against stand-ins for the two
outside services: the embedded emulator (the environments) and a vLLM-shaped
fake chat server (the inference server: token ids, logprobs, usage).

Each step:

0. draws its tasks with the task sampler (``fleetroll.training.sampler``): a
   seeded pass over the ledger tasks, ``--tasks`` a step, each task once per
   epoch, with the difficulty filter on (a task whose groups come back uniform
   twice in a row rests a few steps: it has nothing left to teach for now);
1. runs a batch with ``samples_per_task`` samples per task (plus ``oversample``
   extras, which stand in for samples that fail for infrastructure reasons;
   the rest end ``superseded``);
2. consumes ``batch.groups(complete_only=True)`` as each group completes
   (dropping groups failures left short), shows each to the sampler, skipping ``uniform``
   groups (every sample the same reward: zero advantage) and computing
   group-normalised advantages ``(r - mean) / (std + eps)``;
3. gathers, per turn, the token ids and logprobs the server sent (what a
   policy-gradient loss needs, with no re-tokenising) and the policy version
   that produced them;
4. swaps the "weights" inside ``pool.policy_paused()`` and bumps
   ``pool.policy_version``.

The fake model solves a share ``skill`` of its attempts at each task (it gives
up at once on the others), and each weight swap makes it solve more. Its
attempts at a task past ``samples_per_task`` in a step are refused by the
server (an infrastructure failure: no reward), so an extra rollout has
something to stand in for. Groups keep their lowest-ranked scored samples
(``fleetroll.training.groups``), never the fastest, so without oversampling every
number printed is fixed by the tasks and the arguments and the same on every
run. With oversampling, which attempt a rollout makes depends on which calls
the server first, so an extra may be the refused one (the group is its own
samples) or may have ended before the sample it would replace was refused
(the group is then short and dropped).

    python examples/grpo_loop.py --steps 3 --tasks 4 --samples 4
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from fleetroll import (
    OpenAIChatPolicy,
    RolloutPool,
    TaskSpec,
    chat_policy_config,
    load_settings,
    load_tasks,
)
from fleetroll.emulator import Emulator
from fleetroll.settings import config_dir
from fleetroll.testing.fake_openai import (
    FakeChatServer,
    FakeError,
    VllmShape,
    completion,
    tool_call,
)
from fleetroll.training.sampler import SamplerConfig, TaskSampler

EPS = 1e-6


@dataclass
class Model:
    """The fake weights: the share of its attempts at a task the model solves.

    ``answering`` attempts at a task answer per set of weights; later ones are refused.
    """

    skill: float
    answering: int
    attempts: Counter[str] = field(default_factory=Counter)

    def load(self, skill: float) -> None:
        """New weights: a new skill, and every task's attempts counted afresh."""
        self.skill = skill
        self.attempts.clear()

    def attempt(self, prompt: str) -> int:
        """The number of this attempt at ``prompt`` with these weights, from 0."""
        k = self.attempts[prompt]
        self.attempts[prompt] += 1
        return k

    def solves(self, k: int) -> bool:
        """Deterministic: of the first ``k + 1`` attempts, a ``skill`` share solve it."""
        return math.floor((k + 1) * self.skill) > math.floor(k * self.skill)

    def chat(self, tasks: Sequence[TaskSpec]) -> Any:
        """The chat server's script: play a task's solution, or give up at the first turn."""
        solutions = {
            t.prompt: [(s.name, dict(s.arguments)) for s in t.solution or ()] for t in tasks
        }

        def answer(body: dict[str, Any]) -> Any:
            messages = body["messages"]
            prompt = next(m["content"] for m in messages if m["role"] == "user")
            turn = sum(1 for m in messages if m["role"] == "assistant")
            steps = solutions[prompt]
            if turn == 0:
                k = self.attempt(prompt)
                if k >= self.answering:
                    return FakeError(400, "no capacity for this attempt")  # no reward
                if not self.solves(k):
                    return completion("I give up.")
            if turn >= len(steps):
                return completion("done")
            name, arguments = steps[turn]
            return completion(tool_calls=[tool_call(name, arguments, id=f"call_{turn}")])

        return answer


@dataclass
class TrainingTurn:
    """One policy call, ready for a loss: exactly the server's tokens, no re-tokenising."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]  # the sampling policy's, per completion token
    advantage: float  # its rollout's, group-normalised
    policy_version: int | None  # the weights that produced it


@dataclass
class Step:
    """What one step consumed; ``main`` prints it as one line."""

    step: int
    policy_version: int
    epoch: int = 0
    tasks: list[str] = field(default_factory=list)
    groups: int = 0
    uniform: int = 0
    samples: int = 0
    superseded: int = 0
    rewards: list[float] = field(default_factory=list)
    #: Per non-uniform group: its advantages (they sum to ~0).
    advantages: list[list[float]] = field(default_factory=list)
    data: list[TrainingTurn] = field(default_factory=list)

    @property
    def turn_versions(self) -> set[int | None]:
        return {t.policy_version for t in self.data}

    @property
    def completion_tokens(self) -> int:
        return sum(len(t.completion_token_ids) for t in self.data)

    @property
    def loss(self) -> float:
        """A stand-in for the policy-gradient loss: -mean(advantage * sum of logprobs)."""
        terms = [t.advantage * sum(t.logprobs) for t in self.data]
        return -statistics.fmean(terms) if terms else 0.0


async def train(*, steps: int, tasks: int, samples: int, oversample: int) -> list[Step]:
    ledger = config_dir() / "tasks" / "ledger.jsonl"
    everything = load_tasks(ledger, modalities=load_settings().modalities)
    model = Model(skill=0.5, answering=samples)
    summaries: list[Step] = []
    async with FakeChatServer(model.chat(everything), vllm=VllmShape()) as server:
        settings = load_settings(
            policy={
                "kind": "openai",
                "base_url": server.base_url,
                "return_token_ids": True,  # vLLM's return_token_ids
                "logprobs": True,
            },
            sampling={"seed": 0, "rest_uniform": True, "uniform_groups": 2, "rest_steps": 4},
        )
        # A trainer saves sampler.state() with its checkpoint and passes it back here.
        sampler = TaskSampler(everything, SamplerConfig.from_settings(settings.sampling, tasks))
        async with (
            Emulator() as emu,
            RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url) as pool,
            OpenAIChatPolicy.from_config(chat_policy_config(settings)) as policy,
        ):
            for _ in range(steps):
                draw = sampler.draw()
                batch = pool.run_batch(
                    draw.tasks, policy, samples_per_task=samples, oversample=oversample
                )
                s = Step(draw.step, pool.policy_version, draw.epoch, sorted(draw.keys))
                # In the order groups complete; a group failures left short is dropped.
                async for group in batch.groups(complete_only=True):
                    sampler.observe(group)  # uniform twice in a row: the task rests
                    s.groups += 1
                    s.superseded += group.superseded
                    s.rewards += group.rewards
                    if group.uniform or group.reward_mean is None or group.reward_std is None:
                        s.uniform += 1  # zero advantage: no signal
                        continue
                    mean, std = group.reward_mean, group.reward_std
                    advantages = [(r - mean) / (std + EPS) for r in group.rewards]
                    s.advantages.append(advantages)
                    for result, advantage in zip(group.results, advantages, strict=True):
                        s.samples += 1
                        for turn in result.turns:  # one per policy call
                            s.data.append(
                                TrainingTurn(
                                    turn.prompt_token_ids or [],
                                    turn.completion_token_ids or [],
                                    turn.logprobs or [],
                                    advantage,
                                    turn.policy_version,
                                )
                            )
                summaries.append(s)  # a real trainer would take its optimiser step here
                async with pool.policy_paused():  # new policy calls wait for the swap
                    model.load(min(1.0, model.skill + 0.2))  # "load the new weights"
                    pool.policy_version += 1
    return summaries


def main(argv: Sequence[str] | None = None) -> list[Step]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=4, help="tasks per batch")
    parser.add_argument("--samples", type=int, default=4, help="samples per task (group size)")
    parser.add_argument("--oversample", type=int, default=0, help="extra rollouts per group")
    args = parser.parse_args(argv)
    summaries = anyio.run(
        lambda: train(
            steps=args.steps,
            tasks=args.tasks,
            samples=args.samples,
            oversample=args.oversample,
        )
    )
    for s in summaries:
        reward = statistics.fmean(s.rewards) if s.rewards else math.nan
        print(
            f"step {s.step}  version {s.policy_version}  epoch {s.epoch}"
            f"  tasks {','.join(s.tasks)}  groups {s.groups}"
            f" ({s.uniform} uniform, skipped)  reward {reward:.2f}"
            f"  trained on {s.samples} samples, {len(s.data)} turns, {s.completion_tokens} tokens"
            f"  loss {s.loss:+.3f}"
        )
    return summaries


if __name__ == "__main__":
    main()

"""A verifiers environment (what prime-rl trains on) whose rollouts are fleetroll rollouts.

:func:`load_environment` returns a :class:`FleetrollEnv`, a subclass of the
installed verifiers' own ``verifiers.Environment`` (the 0.2 API prime-rl
loads: ``vf.load_environment("fleetroll.integrations.verifiers", tasks=...)``
finds it by module name). Its dataset is the tasks (``prompt``, and
``info.task_key``); its ``rollout(input, client, model, sampling_args)`` runs
the row's task as one fleetroll rollout against fleetroll's policy servers
(``policy.base_url``: the servers prime-rl's inference serves; verifiers'
``client`` is not used) and returns verifiers' ``State`` with one
``trajectory`` step whose ``tokens`` are the rollout's: ``prompt_ids`` (turn
0's prompt as the server tokenized it), ``completion_ids`` (the model's
tokens and the tool answers between turns), ``completion_mask`` (1 exactly on
the model's tokens) and ``completion_logprobs`` (the server's; 0.0 under mask
0). Its rubric's one reward function is the task's verifier's reward. A failed
rollout (an infrastructure failure) comes back with its mask all 0, reward
0.0 and ``state["error"]`` saying why, so verifiers counts it as an error.

Needs verifiers 0.2.0 (``pip install 'fleetroll[verifiers]'``), which cannot
share a venv with the ``train`` extra's TRL (it pins ``datasets<4.7``); the
newest verifiers (0.4.0, the ``verifiers.v1`` API) pins an mcp fleetroll
cannot use. ``import fleetroll`` needs none of it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from fleetroll.integrations.core import (
    BlockingRollouts,
    check_temperature,
    outcome_of,
    prompt_messages,
)
from fleetroll.settings import Settings, load_settings
from fleetroll.tasks import TaskSpec

try:
    import verifiers as vf
    from datasets import Dataset
except ImportError as exc:  # one line, what to install
    raise ImportError(
        "fleetroll.integrations.verifiers needs verifiers:"
        f" pip install 'fleetroll[verifiers]' ({exc})"
    ) from exc

__all__ = ["FleetrollEnv", "load_environment"]

Tasks = Sequence[TaskSpec] | Sequence[Mapping[str, Any]] | str | os.PathLike[str]


def load_environment(
    tasks: Tasks,
    settings: Settings | Mapping[str, Any] | None = None,
    **options: Any,
) -> FleetrollEnv:
    """The environment for ``tasks`` (what verifiers' and prime-rl's loaders call).

    Args:
        tasks: TaskSpecs, task records or a task file's path.
        settings: fleetroll's settings, or overrides for :func:`fleetroll.load_settings`
            (a dict, as an environment's arguments in a prime-rl config are);
            ``policy.kind = "openai"``, its servers the trainer's model's.
        **options: :class:`fleetroll.integrations.core.Rollouts`' (``emulator_profile``,
            ``preflight``, ``drift``...).

    Raises:
        ConfigError, TaskFileError, ValueError: as :class:`~fleetroll.integrations.core.Rollouts`.
    """
    if not isinstance(settings, Settings):
        settings = load_settings(**dict(settings or {}))
    return FleetrollEnv(BlockingRollouts(tasks, settings, **options))


class FleetrollEnv(vf.Environment):  # type: ignore[misc]  # verifiers is untyped here
    """verifiers' ``Environment``: each rollout a fleetroll rollout (see the module)."""

    def __init__(self, rollouts: BlockingRollouts, **kwargs: Any) -> None:
        #: The core it runs on (its own loop; closes at exit or on :meth:`close`).
        self.rollouts = rollouts
        settings = rollouts.core.settings
        tasks = list(rollouts.core.tasks.values())
        dataset = Dataset.from_list(
            [
                {
                    "prompt": prompt_messages(task, settings.policy.system_prompt),
                    "answer": "",
                    "info": {"task_key": task.key},
                    "example_id": index,
                }
                for index, task in enumerate(tasks)
            ]
        )
        super().__init__(
            dataset=dataset,
            rubric=vf.Rubric(funcs=[fleetroll_reward]),
            env_id="fleetroll",
            **kwargs,
        )

    async def rollout(
        self,
        input: Any,
        client: Any,
        model: str,
        sampling_args: dict[str, Any] | None = None,
    ) -> Any:
        """Run the input's task as one fleetroll rollout; its state has the tokens.

        Raises:
            verifiers.Error: the row names no known task.
            ConfigError: ``sampling_args``' temperature is not ``policy.temperature``.
        """
        state = await self.init_state(input, client, model, sampling_args)
        info = state.get("info") or {}
        key = info.get("task_key") if isinstance(info, Mapping) else None
        if key is None or key not in self.rollouts.core.tasks:
            raise vf.Error(f"a row names task {key!r}, which is not among fleetroll's tasks")
        wanted = (sampling_args or {}).get("temperature")
        check_temperature(self.rollouts.core.settings, wanted, trainer="verifiers")
        (row,) = await self.rollouts.run_from_loop([(str(key), 0)])
        mask = list(row["completion_mask"])
        tokens = {
            "prompt_ids": list(row["prompt_ids"]),
            "prompt_mask": [0] * len(row["prompt_ids"]),
            "completion_ids": list(row["completion_ids"]),
            "completion_mask": mask,
            "completion_logprobs": [
                0.0 if lp is None else float(lp) for lp in row["completion_logprobs"]
            ],
            "overlong_prompt": False,
            "is_truncated": False,
            "routed_experts": None,
        }
        state["trajectory"] = [
            {
                "prompt": state["prompt"],
                "completion": [],
                "response": None,
                "tokens": tokens,
                "reward": None,
                "advantage": None,
                "is_truncated": False,
                "trajectory_id": state["trajectory_id"],
                "extras": {"fleetroll_rollout_id": row["rollout_id"]},
            }
        ]
        state["completion"] = []
        state["fleetroll_reward"] = row["reward"]
        state["fleetroll_status"] = outcome_of(row)
        state["fleetroll_rollout_id"] = row["rollout_id"]
        if row["reward"] is None:
            state["error"] = vf.InfraError(f"fleetroll rollout failed: {outcome_of(row)}")
        state["is_completed"] = True
        state["stop_condition"] = outcome_of(row)
        return state

    def close(self) -> None:
        """Close fleetroll (every instance released)."""
        self.rollouts.close()


def fleetroll_reward(state: Any, **kwargs: Any) -> float:
    """The task's verifier's reward (0.0 for a failed rollout)."""
    reward = state.get("fleetroll_reward")
    return 0.0 if reward is None else float(reward)

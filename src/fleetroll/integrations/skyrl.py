"""SkyRL's generator on fleetroll: each trajectory of a SkyRL batch a fleetroll rollout.

:class:`FleetrollGenerator` implements SkyRL's own
``skyrl.train.generators.base.GeneratorInterface``: ``generate(input_batch)``
runs the batch's trajectories as fleetroll rollouts (one batch, each task's
trajectories its group) against fleetroll's policy servers (``policy.base_url``:
the servers SkyRL's inference engines serve) and answers SkyRL's
``GeneratorOutput``, one entry per trajectory in the input's order:
``prompt_token_ids`` (turn 0's prompt as the server tokenized it),
``response_ids`` (the model's tokens and the tool answers between turns),
``loss_masks`` (1 exactly on the model's tokens), ``rollout_logprobs`` (the
server's; 0.0 under mask 0), ``rewards`` (the task's verifier's),
``stop_reasons`` (``completed`` or the failure reason) and ``trajectory_ids``
(the input's). A failed rollout (an infrastructure failure) still answers,
its mask all 0 and its reward 0.0 (SkyRL has no "no reward"; with the mask 0
it moves nothing); ``rollout_metrics["fleetroll/failed"]`` counts them.

Which task a trajectory runs: ``env_extras[i]["task_key"]`` (what
:func:`records` puts in the dataset), else its ``trajectory_ids[i].instance_id``;
its sample index in the group: ``trajectory_ids[i].repetition_id``, else its
rank among the batch's trajectories of that task.

SkyRL samples at fleetroll's ``policy.temperature``, which must be the
batch's ``sampling_params["temperature"]`` (a mismatch is refused). Needs skyrl
(``pip install 'fleetroll[skyrl]'``) on Python 3.12: skyrl 0.3.0 declares 3.11
but its base module does not import there (pydantic refuses its
``typing.TypedDict`` before 3.12); ``import fleetroll`` needs none of it.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Self

from pydantic.errors import PydanticUserError

from fleetroll.errors import ConfigError
from fleetroll.integrations.core import (
    BlockingRollouts,
    Request,
    Row,
    check_temperature,
    fill_empty_row,
    load_task_list,
    outcome_of,
    prompt_messages,
)
from fleetroll.settings import Settings, load_settings
from fleetroll.tasks import TaskSpec

try:
    from skyrl.train.generators.base import GeneratorInput, GeneratorInterface, GeneratorOutput
except ImportError as exc:  # one line, what to install
    raise ImportError(
        f"fleetroll.integrations.skyrl needs skyrl: pip install 'fleetroll[skyrl]' ({exc})"
    ) from exc
except PydanticUserError as exc:  # pydantic refuses skyrl's typing.TypedDict before 3.12
    raise ImportError(
        "fleetroll.integrations.skyrl: skyrl does not import on this Python"
        f" (skyrl 0.3.0 needs Python 3.12): {type(exc).__name__}: {str(exc).splitlines()[0]}"
    ) from exc

__all__ = ["FleetrollGenerator", "records"]

Tasks = Sequence[TaskSpec] | Sequence[Mapping[str, Any]] | str | os.PathLike[str]


def records(tasks: Tasks, settings: Settings | None = None) -> list[dict[str, Any]]:
    """SkyRL dataset rows for ``tasks``: ``prompt`` (the task's turn-0 messages),
    ``env_class`` (``"fleetroll"``) and ``task_key`` (SkyRL hands a row's other
    columns to the generator as its ``env_extras``).

    Raises:
        TaskFileError, ValueError: as :func:`fleetroll.integrations.core.load_task_list`.
    """
    settings = settings or load_settings()
    return [
        {
            "prompt": prompt_messages(task, settings.policy.system_prompt),
            "env_class": "fleetroll",
            "task_key": task.key,
        }
        for task in load_task_list(tasks, settings)
    ]


class FleetrollGenerator(GeneratorInterface):  # type: ignore[misc]  # skyrl is untyped here
    """SkyRL's ``GeneratorInterface`` over fleetroll (see the module).

    Args:
        tasks: the tasks the dataset's rows name (TaskSpecs, records or a task file's path).
        settings: fleetroll's settings (default :func:`fleetroll.load_settings`);
            ``policy.kind = "openai"``, its servers the trainer's model's.
        tokenizer: the trainer's tokenizer, to give a rollout that never reached
            the model its prompt's ids (None: such a row's prompt stays empty).
        **options: :class:`fleetroll.integrations.core.Rollouts`' (``events``,
            ``emulator_profile``, ``preflight``, ``drift``, ``ray_address``...).

    Raises:
        ConfigError, TaskFileError, ValueError: as :class:`~fleetroll.integrations.core.Rollouts`.
    """

    def __init__(
        self,
        tasks: Tasks,
        settings: Settings | None = None,
        *,
        tokenizer: Any = None,
        **options: Any,
    ) -> None:
        #: The core it runs on (its own loop; closes on :meth:`close` or at exit).
        self.rollouts = BlockingRollouts(tasks, settings, **options)
        self.tokenizer = tokenizer

    async def generate(self, input_batch: GeneratorInput) -> GeneratorOutput:
        """Run the batch's trajectories and answer one entry each, in their order.

        Raises:
            ConfigError: a trajectory names no known task, or the batch's
                temperature is not fleetroll's ``policy.temperature``.
        """
        core = self.rollouts.core
        sampling = input_batch.get("sampling_params") or {}
        check_temperature(core.settings, sampling.get("temperature"), trainer="SkyRL")
        requests = _requests(input_batch, core.tasks)
        rows = [self._filled(row) for row in await self.rollouts.run_from_loop(requests)]
        failed = sum(1 for row in rows if row["reward"] is None)
        rewards = [0.0 if row["reward"] is None else float(row["reward"]) for row in rows]
        scored = [row["reward"] for row in rows if row["reward"] is not None]
        output: GeneratorOutput = {
            "prompt_token_ids": [list(row["prompt_ids"]) for row in rows],
            "response_ids": [list(row["completion_ids"]) for row in rows],
            "rewards": rewards,
            "loss_masks": [list(row["completion_mask"]) for row in rows],
            "stop_reasons": [outcome_of(row) for row in rows],
            "rollout_metrics": {
                "fleetroll/failed": failed,
                "fleetroll/reward_mean": sum(scored) / len(scored) if scored else None,
            },
            "rollout_logprobs": [
                [0.0 if lp is None else float(lp) for lp in row["completion_logprobs"]]
                for row in rows
            ],
            "trajectory_ids": input_batch.get("trajectory_ids"),
            "trajectory_generation_times": None,
            "rollout_expert_indices": None,
            "is_last_step": None,
            "env_metrics": [
                {"fleetroll_rollout_id": row["rollout_id"], "fleetroll_reward": row["reward"]}
                for row in rows
            ],
            "pixel_values": None,
            "image_grid_thw": None,
        }
        return output

    def _filled(self, row: Row) -> Row:
        if (row["prompt_ids"] and row["completion_ids"]) or self.tokenizer is None:
            return row
        core = self.rollouts.core
        messages = prompt_messages(core.tasks[row["task_key"]], core.settings.policy.system_prompt)
        ids = self.tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        return fill_empty_row(
            row, prompt_ids=list(ids), end_token_id=int(self.tokenizer.eos_token_id)
        )

    def close(self) -> None:
        """Close fleetroll (every instance released)."""
        self.rollouts.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _requests(batch: Mapping[str, Any], tasks: Mapping[str, TaskSpec]) -> list[Request]:
    prompts = batch.get("prompts") or []
    extras = batch.get("env_extras") or [None] * len(prompts)
    ids = batch.get("trajectory_ids") or [None] * len(prompts)
    taken: Counter[str] = Counter()
    requests: list[Request] = []
    for extra, trajectory in zip(extras, ids, strict=True):
        key = extra.get("task_key") if isinstance(extra, Mapping) else None
        if key is None and trajectory is not None:
            key = trajectory.instance_id
        if key is None or str(key) not in tasks:
            raise ConfigError(
                f"a SkyRL trajectory names task {key!r}, which is not among fleetroll's tasks:"
                " give each dataset row a task_key (fleetroll.integrations.skyrl.records)"
            )
        key = str(key)
        index = trajectory.repetition_id if trajectory is not None else taken[key]
        taken[key] += 1
        requests.append(Request(key, int(index)))
    return requests

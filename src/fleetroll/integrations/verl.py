"""verl's agent loop on fleetroll: each sample of a verl batch a fleetroll rollout.

:class:`FleetrollAgentLoop` subclasses verl's own
``verl.experimental.agent_loop.agent_loop.AgentLoopBase`` and is registered
with verl's ``@register("fleetroll")``. A dataset row whose ``agent_name`` is
``"fleetroll"`` and whose ``extra_info`` names a task (``task_key``) runs as
one rollout of that task on fleetroll's pool (the process's one, shared by
every sample of the agent-loop worker: :func:`~fleetroll.integrations.core.shared_rollouts`),
against fleetroll's policy servers (``policy.base_url``: the same vLLM or
SGLang servers verl's rollout workers serve). The loop answers verl's
``AgentLoopOutput``: ``prompt_ids`` (turn 0's prompt as the server tokenized
it), ``response_ids`` (the model's tokens and the tool answers between turns),
``response_mask`` (1 exactly on the model's tokens), ``response_logprobs``
(the server's; 0.0 under mask 0), ``reward_score`` (the task's verifier's) and
``num_turns`` (the messages after the prompt). A failed rollout (an
infrastructure failure) still answers, its mask all 0 and ``reward_score``
0.0 (verl has no "no reward" per sample; with the mask 0 it moves nothing),
with ``extra_fields["fleetroll_status"]`` saying why.

Configuration goes in verl's own config, under ``fleetroll`` (Hydra:
``+fleetroll.tasks=config/tasks/ledger.jsonl``):

- ``tasks`` (required): the task file's path, readable on every worker;
- ``settings``: overrides of fleetroll's settings (what ``load_settings``
  takes; ``FLEETROLL_*`` variables work too), ``policy.kind = "openai"``;
- ``drift``, ``emulator_profile``, ``preflight``: as
  :class:`fleetroll.integrations.core.Rollouts`.

The sampling temperature is fleetroll's ``policy.temperature`` and must be
verl's ``rollout.temperature`` (a mismatch is refused). :func:`records` gives
the dataset rows for verl's ``RLHFDataset`` (write them to parquet).

Needs verl (``pip install 'fleetroll[verl]'``); ``import fleetroll`` does not.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from fleetroll.errors import ConfigError
from fleetroll.integrations.core import (
    BlockingRollouts,
    Row,
    check_temperature,
    fill_empty_row,
    load_task_list,
    outcome_of,
    prompt_messages,
    shared_rollouts,
    turns_of,
)
from fleetroll.settings import Settings, load_settings
from fleetroll.tasks import TaskSpec

try:
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopBase,
        AgentLoopMetrics,
        AgentLoopOutput,
        register,
    )
except ImportError as exc:  # one line, what to install
    raise ImportError(
        f"fleetroll.integrations.verl needs verl: pip install 'fleetroll[verl]' ({exc})"
    ) from exc

__all__ = ["AGENT_NAME", "FleetrollAgentLoop", "records"]

#: The ``agent_name`` of the dataset rows this loop runs.
AGENT_NAME = "fleetroll"


def records(
    tasks: Sequence[TaskSpec] | Sequence[Mapping[str, Any]] | str | os.PathLike[str],
    settings: Settings | None = None,
) -> list[dict[str, Any]]:
    """verl dataset rows for ``tasks`` (``pandas.DataFrame(records(...)).to_parquet(...)``):
    ``data_source``, ``prompt`` (the task's turn-0 messages), ``agent_name``
    (``"fleetroll"``), ``extra_info`` (``task_key``, ``index``) and ``reward_model``.

    Raises:
        TaskFileError, ValueError: as :func:`fleetroll.integrations.core.load_task_list`.
    """
    settings = settings or load_settings()
    return [
        {
            "data_source": "fleetroll",
            "prompt": prompt_messages(task, settings.policy.system_prompt),
            "agent_name": AGENT_NAME,
            "extra_info": {"task_key": task.key, "index": index},
            "reward_model": {"style": "fleetroll", "ground_truth": task.key},
        }
        for index, task in enumerate(load_task_list(tasks, settings))
    ]


@register(AGENT_NAME)
class FleetrollAgentLoop(AgentLoopBase):  # type: ignore[misc]  # verl is untyped
    """verl's ``AgentLoopBase``: one sample, one fleetroll rollout (see the module).

    Raises:
        ConfigError: (on construction) verl's config has no ``fleetroll.tasks``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        section = self.config.get("fleetroll")
        if section is None or not section.get("tasks"):
            raise ConfigError(
                "verl's config has no fleetroll.tasks: add +fleetroll.tasks=<task file>"
                " (and +fleetroll.settings.policy.base_url=<your servers>)"
            )
        options = OmegaConf.to_container(section, resolve=True)
        assert isinstance(options, dict)
        tasks = str(options.pop("tasks"))
        settings = load_settings(**options.pop("settings", None) or {})
        #: The process's core (shared by every sample of this worker).
        self.rollouts: BlockingRollouts = shared_rollouts(tasks, settings, **options)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        """Run the sample's task as one fleetroll rollout and answer verl's output.

        Raises:
            ConfigError: the row names no task, or verl's temperature is not fleetroll's.
        """
        core = self.rollouts.core
        key = _task_key(kwargs.get("extra_info"))
        if key not in core.tasks:
            raise ConfigError(f"a verl row names task {key!r}, not in fleetroll.tasks")
        check_temperature(core.settings, sampling_params.get("temperature"), trainer="verl")
        (row,) = await self.rollouts.run_from_loop([(key, 0)])
        row = self._filled(row)
        mask = list(row["completion_mask"])
        return AgentLoopOutput(
            prompt_ids=list(row["prompt_ids"]),
            response_ids=list(row["completion_ids"]),
            response_mask=mask,
            response_logprobs=[
                0.0 if lp is None else float(lp) for lp in row["completion_logprobs"]
            ],
            reward_score=0.0 if row["reward"] is None else float(row["reward"]),
            num_turns=1 + turns_of(row),
            metrics=AgentLoopMetrics(),
            extra_fields={
                "fleetroll_rollout_id": row["rollout_id"],
                "fleetroll_status": outcome_of(row),
                "fleetroll_reward": row["reward"],
            },
        )

    def _filled(self, row: Row) -> Row:
        if row["prompt_ids"] and row["completion_ids"]:
            return row
        core = self.rollouts.core
        messages = prompt_messages(core.tasks[row["task_key"]], core.settings.policy.system_prompt)
        ids = self.tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        return fill_empty_row(
            row, prompt_ids=list(ids), end_token_id=int(self.tokenizer.eos_token_id)
        )


def _task_key(extra_info: Any) -> str:
    if isinstance(extra_info, Mapping) and extra_info.get("task_key"):
        return str(extra_info["task_key"])
    raise ConfigError(
        "a verl row for the fleetroll agent loop has no extra_info.task_key:"
        " build the dataset with fleetroll.integrations.verl.records(tasks)"
    )

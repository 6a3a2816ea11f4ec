"""TRL's ``GRPOTrainer`` on fleetroll: each completion a fleetroll rollout, exactly.

The trainer's usual script, plus these lines::

    from fleetroll.integrations import trl as fleetroll_trl

    tasks = "config/tasks/ledger.jsonl"
    rollouts = fleetroll_trl.RolloutFunc(tasks, settings, weight_sync=sync)
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        args=GRPOConfig(..., num_generations=4),
        train_dataset=fleetroll_trl.dataset(tasks),
        rollout_func=rollouts,
        reward_funcs=fleetroll_trl.reward,
    )
    trainer.train()

What each piece does:

- :func:`dataset`: a ``datasets.Dataset`` with a conversational ``prompt``
  column (the task's prompt as a user message that also carries the task's
  key) and a ``task_key`` column. TRL passes only the prompt column to a
  rollout function; the key inside the message is how each prompt maps back
  to its task exactly, even when two tasks share a prompt's text.
- :class:`RolloutFunc`: called by TRL with a generation batch's prompts, each
  repeated ``num_generations`` times consecutively; it runs one fleetroll
  rollout per prompt (a group per repeat run: G samples of a task) on the
  pool it holds, and answers exactly ``len(prompts)`` rows, row i for
  ``prompts[i]``: ``prompt_ids`` (turn 0's prompt as the model server
  tokenized it), ``completion_ids`` (the rest of the conversation: the
  model's tokens and the tool answers between turns), ``logprobs`` (the
  server's; 0.0 where the mask is 0, never read there), ``env_mask`` (1 for
  the model's tokens: tool answers get no loss), and ``fleetroll_reward``,
  ``fleetroll_rollout_id``, ``fleetroll_status`` and
  ``fleetroll_policy_versions`` (per completion token, None where the mask is
  0), which reach the reward functions as keyword arguments. It hosts
  fleetroll's event loop on a thread of its own, opens on its first call (or
  ``with``), and closes on ``close()``, at the end of a ``with`` block, or at
  interpreter exit.
- :func:`reward`: the verifier's reward of each row's rollout; ``None`` for a
  failed rollout (an infrastructure failure, no reward). TRL 1.16 counts a
  row whose every reward function says ``None`` as unscorable (so a reward
  function of your own beside it should say ``None`` where
  ``fleetroll_reward`` is ``None``): NaN in
  ``nanmean``/``nanstd``, so the group's baseline is its scored samples', and
  its advantage is 0. With its mask all 0 too, a failed rollout neither moves
  the policy nor biases its group. (A 0.0 instead would count the failure as
  a wrong answer: it would lower the baseline and push up the others.)

With ``weight_sync`` (a ``fleetroll.training.weight_sync`` sync, e.g.
``VLLMReloadSync(settings.policy.servers)``), before a step's rollouts, when
the trainer's ``global_step`` has moved since the last sync, it saves the
trainer's model (``save_pretrained``, in ``weights_dir`` or a temporary
folder the servers must be able to read) and pushes it to every policy
server while new policy calls wait (with several trainer processes, the main
one saves and pushes, the others wait for it and record the same version:
not run here, on one CPU); turns after it carry the next policy
version (1 after the first step). TRL's own vLLM weight sync is NCCL-only
(CUDA); this one goes by disk.

What TRL does not do for a rollout function, and fleetroll does instead:
``max_completion_length`` does not bound a rollout (``policy.max_tokens``
bounds each model call, a task's ``max_steps`` its turns, and
``policy.max_context_tokens`` its whole sequence); the sampling temperature
is fleetroll's ``policy.temperature``, and must be set to the trainer's
(``GRPOConfig.temperature``): a mismatch, or no ``policy.temperature`` (the
server's default, e.g. the model's ``generation_config`` on vLLM), is refused
at the first call.
"""

from __future__ import annotations

import os
import queue
import random
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from fleetroll.errors import ConfigError
from fleetroll.integrations.core import (
    BlockingRollouts,
    Request,
    Row,
    fill_empty_row,
    load_task_list,
    prompt_messages,
)
from fleetroll.settings import Settings, load_settings
from fleetroll.tasks import TaskSpec
from fleetroll.training.weight_sync import WeightSync

if TYPE_CHECKING:
    from datasets import Dataset

__all__ = ["RolloutFunc", "RolloutWorker", "dataset", "reward"]

#: The key of the prompt message that names its task (and of the dataset's column).
TASK_KEY = "task_key"

Tasks = Sequence[TaskSpec] | Sequence[Mapping[str, Any]] | str | os.PathLike[str]


def dataset(tasks: Tasks, settings: Settings | None = None) -> Dataset:
    """A ``datasets.Dataset`` of ``tasks`` for ``GRPOTrainer(train_dataset=...)``.

    Columns: ``prompt`` (``[{"role": "user", "content": <prompt>, "task_key":
    <key>}]``) and ``task_key``.

    Raises:
        TaskFileError, ValueError: as :func:`fleetroll.integrations.core.load_task_list`.
    """
    from datasets import Dataset

    loaded = load_task_list(tasks, settings or load_settings())
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": task.prompt, TASK_KEY: task.key}],
                TASK_KEY: task.key,
            }
            for task in loaded
        ]
    )


def reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    fleetroll_reward: Sequence[float | None] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """The reward function for ``GRPOTrainer(reward_funcs=...)``: each row's
    fleetroll reward, ``None`` for a failed rollout (see the module's docstring).

    Raises:
        ValueError: the rows did not come from a :class:`RolloutFunc`.
    """
    if fleetroll_reward is None:
        raise ValueError(
            "fleetroll.integrations.trl.reward reads the rewards of fleetroll's rollouts:"
            " pass rollout_func=fleetroll.integrations.trl.RolloutFunc(...) to the GRPOTrainer"
        )
    return [None if r is None else float(r) for r in fleetroll_reward]


class RolloutFunc:
    """``GRPOTrainer(rollout_func=...)``: TRL's prompts run as fleetroll rollouts.

    Args:
        tasks: the tasks the dataset's prompts come from (TaskSpecs, records or a
            task file's path; :func:`dataset` of the same tasks).
        settings: fleetroll's settings (default :func:`fleetroll.load_settings`);
            ``policy.kind = "openai"``, its servers the trainer's model's.
        weight_sync: pushes the trainer's weights to the policy servers before
            each step's rollouts (None: the servers' weights are never changed).
        weights_dir: where the weights are saved for the servers (default: a
            temporary folder, removed at close).
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
        weight_sync: WeightSync | None = None,
        weights_dir: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> None:
        #: The core it runs on (``rollouts.core.pool`` once open).
        self.rollouts = BlockingRollouts(tasks, settings, **options)
        self.weight_sync = weight_sync
        self._weights_dir = Path(weights_dir) if weights_dir is not None else None
        self._made_dir: Path | None = None
        self._synced_step = 0  # the servers start with the trainer's initial weights
        self._last_weights: Path | None = None
        tasks_by_key = self.rollouts.core.tasks
        self._by_prompt: dict[str, list[str]] = {}
        for key, task in tasks_by_key.items():
            self._by_prompt.setdefault(task.prompt, []).append(key)

    @property
    def settings(self) -> Settings:
        """The settings it runs with (token ids and logprobs on)."""
        return self.rollouts.core.settings

    @property
    def policy_version(self) -> int:
        """The policy version turns record from now on (0 until the first weight sync)."""
        return self.rollouts.call(_version, self.rollouts)

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """Run ``prompts`` (TRL's generation batch) and answer one row per prompt.

        Raises:
            ConfigError: a prompt names no known task, or the trainer's
                temperature is not ``policy.temperature``.
            WeightSyncError: the weights could not be pushed.
        """
        self._check_temperature(trainer)
        keys = [self._key_of(prompt) for prompt in prompts]
        requests = _requests(keys, _group_size(trainer, len(prompts)))
        if self.weight_sync is not None:
            self._sync(trainer)
        rows = self.rollouts.run(requests)
        tokenizer = getattr(trainer, "processing_class", None)
        out: dict[str, list[Any]] = {
            "prompt_ids": [],
            "completion_ids": [],
            "logprobs": [],
            "env_mask": [],
            "fleetroll_reward": [],
            "fleetroll_rollout_id": [],
            "fleetroll_status": [],
            "fleetroll_policy_versions": [],
        }
        for row in rows:
            row = self._filled(row, tokenizer)
            out["prompt_ids"].append(row["prompt_ids"])
            out["completion_ids"].append(row["completion_ids"])
            out["logprobs"].append(
                [0.0 if lp is None else float(lp) for lp in row["completion_logprobs"]]
            )
            out["env_mask"].append(list(row["completion_mask"]))
            out["fleetroll_reward"].append(row["reward"])
            out["fleetroll_rollout_id"].append(row["rollout_id"])
            out["fleetroll_status"].append(row["status"])
            out["fleetroll_policy_versions"].append(list(row["completion_policy_versions"]))
        return out

    def _key_of(self, prompt: Any) -> str:
        text: Any = prompt
        if isinstance(prompt, list):
            for message in prompt:
                if isinstance(message, Mapping) and message.get(TASK_KEY):
                    key = str(message[TASK_KEY])
                    if key not in self.rollouts.core.tasks:
                        raise ConfigError(
                            f"a prompt names task {key!r}, which is not among the tasks"
                            " RolloutFunc was given"
                        )
                    return key
            users = [m for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
            text = users[-1].get("content") if users else None
        keys = self._by_prompt.get(text, []) if isinstance(text, str) else []
        if len(keys) == 1:
            return keys[0]
        shown = repr(text)[:80]
        if keys:
            raise ConfigError(
                f"tasks {', '.join(keys)} share the prompt {shown}: use"
                " fleetroll.integrations.trl.dataset(tasks), whose prompts carry their task's key"
            )
        raise ConfigError(
            f"the prompt {shown} is no task's: the dataset must come from the tasks"
            " RolloutFunc was given (fleetroll.integrations.trl.dataset(tasks))"
        )

    def _check_temperature(self, trainer: Any) -> None:
        wanted = getattr(trainer, "temperature", None)
        ours = self.settings.policy.temperature
        if wanted is not None and ours is None:
            raise ConfigError(
                f"set policy.temperature to the trainer's temperature ({wanted:g}): without"
                " it the server samples at its own default (vLLM takes the model's"
                " generation_config), and the trainer's logprobs would not be the sampler's"
            )
        if wanted is not None and ours is not None and abs(float(wanted) - ours) > 1e-9:
            raise ConfigError(
                f"the trainer samples at temperature {wanted:g} but fleetroll's"
                f" policy.temperature is {ours:g}: set them the same (the trainer's"
                " logprobs are taken at its own temperature)"
            )

    def _sync(self, trainer: Any) -> None:
        step = int(trainer.state.global_step)
        if step == self._synced_step:
            return
        assert self.weight_sync is not None
        accelerator = trainer.accelerator
        # Every process takes part in gathering the weights (sharded ones too);
        # the main one saves and pushes them, the others set the same version.
        state = accelerator.get_state_dict(trainer.model)
        if accelerator.is_main_process:
            root = self._weights_dir or self._made_dir
            if root is None:
                root = self._made_dir = Path(tempfile.mkdtemp(prefix="fleetroll-weights-"))
            path = root / f"step-{step}"
            accelerator.unwrap_model(trainer.model).save_pretrained(path, state_dict=state)
            self.rollouts.sync_weights(self.weight_sync, str(path))
            if self._last_weights is not None:  # the servers hold the new ones now
                shutil.rmtree(self._last_weights, ignore_errors=True)
            self._last_weights = path
        accelerator.wait_for_everyone()
        if not accelerator.is_main_process:
            self.rollouts.call(_next_version, self.rollouts)
        self._synced_step = step

    def _filled(self, row: Row, tokenizer: Any) -> Row:
        if row["prompt_ids"] and row["completion_ids"]:
            return row
        if tokenizer is None:
            raise ConfigError("the trainer has no processing_class to tokenize a failed row with")
        task = self.rollouts.core.tasks[row["task_key"]]
        rendered = tokenizer.apply_chat_template(
            prompt_messages(task, self.settings.policy.system_prompt),
            tokenize=False,
            add_generation_prompt=True,
        )
        ids = tokenizer.encode(rendered, add_special_tokens=False)
        return fill_empty_row(row, prompt_ids=ids, end_token_id=int(tokenizer.eos_token_id))

    def open(self) -> Self:
        """Open fleetroll now (else on the first call).

        Raises:
            As :class:`~fleetroll.integrations.core.Rollouts` on entering.
        """
        self.rollouts.open()
        return self

    def close(self) -> None:
        """Close fleetroll (every instance released) and remove the saved weights."""
        try:
            self.rollouts.close()
        finally:
            if self._made_dir is not None:
                shutil.rmtree(self._made_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


async def _version(rollouts: BlockingRollouts) -> int:
    return rollouts.core.policy_version


async def _next_version(rollouts: BlockingRollouts) -> None:
    """A process other than the main one: the main one pushed the weights."""
    pool = rollouts.core.pool
    await pool.set_policy_version(pool.policy_version + 1)


def _group_size(trainer: Any, count: int) -> int | None:
    """TRL's G for this call: ``num_generations`` (``num_generations_eval`` in
    evaluation); None when the batch is not a whole number of such groups."""
    model = getattr(trainer, "model", None)
    training = bool(getattr(model, "training", True))
    size = getattr(trainer, "num_generations" if training else "num_generations_eval", None)
    if size is None and not training:
        size = getattr(trainer, "num_generations", None)
    if isinstance(size, int) and size > 0 and count % size == 0:
        return size
    return None


def _requests(keys: Sequence[str], size: int | None) -> list[Request]:
    """One request per prompt, in order: each group of ``size`` prompts (or, when
    the batch is not made of such groups, each run of one task's prompts) is
    one task's next sample indices."""
    groups: list[list[str]] = []
    if size is not None and all(
        len(set(keys[i : i + size])) == 1 for i in range(0, len(keys), size)
    ):
        groups = [list(keys[i : i + size]) for i in range(0, len(keys), size)]
    else:
        for key in keys:
            if groups and groups[-1][0] == key:
                groups[-1].append(key)
            else:
                groups.append([key])
    taken: Counter[str] = Counter()
    requests: list[Request] = []
    for group in groups:
        key = group[0]
        requests += [Request(key, taken[key] + i) for i in range(len(group))]
        taken[key] += len(group)
    return requests


class RolloutWorker:
    """A rollout worker for TRL's asynchronous GRPO (``trl.experimental.async_grpo``):
    ``AsyncGRPOTrainer(rollout_worker=RolloutWorker(...))``, its ``RolloutWorkerProtocol``.

    Once started, a thread of its own runs fleetroll batches one after the
    other, ``tasks_per_batch`` tasks at a time (every task once per pass, in a
    seeded order) and ``num_generations`` samples each, and puts each scored
    rollout on :attr:`rollout_buffer` as TRL's ``RolloutSample``: ``input_ids``
    (prompt and completion), ``completion_mask`` (1 on the model's tokens
    only), ``old_log_probs`` (the server's, 0 elsewhere), the row's group-normalised
    ``advantage``, its ``group_id`` (an int per group) and ``model_version``
    (the oldest policy version among its tokens, which the trainer's staleness
    check reads). A failed rollout carries no signal (mask 0, advantage 0) and
    is not put on the buffer. :meth:`update_model_version` sets the pool's
    policy version: turns after it record it.

    ``AsyncGRPOTrainer`` itself needs CUDA (flash-attention tree packing, NCCL
    weight transfer): it was not run here; the worker is tested against its
    ``RolloutSample`` and protocol on the CPU.

    Args:
        tasks, settings, **options: as :class:`RolloutFunc`.
        num_generations: samples per task (the trainer's group size).
        tasks_per_batch: tasks per fleetroll batch.
        max_queued: samples the buffer holds; the worker waits while it is full.
        seed: the order tasks are drawn in.
    """

    def __init__(
        self,
        tasks: Tasks,
        settings: Settings | None = None,
        *,
        num_generations: int,
        tasks_per_batch: int = 1,
        max_queued: int = 256,
        seed: int = 0,
        **options: Any,
    ) -> None:
        if num_generations < 1 or tasks_per_batch < 1:
            raise ValueError("num_generations and tasks_per_batch must be at least 1")
        self.rollouts = BlockingRollouts(tasks, settings, **options)
        self.num_generations = num_generations
        self.tasks_per_batch = tasks_per_batch
        #: Scored samples (``RolloutSample``), the trainer drains it.
        self.rollout_buffer: queue.Queue[Any] = queue.Queue(maxsize=max_queued)
        #: Metrics the worker measured: one ``{name: value}`` per batch.
        self.metrics_queue: queue.Queue[dict[str, Any]] = queue.Queue()
        self._seed = seed
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._last_progress = time.monotonic()

    def start(self) -> None:
        """Open fleetroll and start producing (once).

        Raises:
            As :class:`~fleetroll.integrations.core.Rollouts` on entering.
        """
        if self._thread is not None:
            return
        self.rollouts.open()
        self._last_progress = time.monotonic()
        self._thread = threading.Thread(target=self._produce, name="fleetroll-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop producing, cancel what runs and close fleetroll (every instance released)."""
        self._stopping.set()
        try:
            self.rollouts.close()  # cancels the batch in flight
        finally:
            if self._thread is not None:
                self._thread.join(self.rollouts.close_timeout_s)

    def update_model_version(self, model_version: int) -> None:
        """The policy version now live: turns that start after this record it."""
        self.rollouts.call(self.rollouts.core.pool.set_policy_version, int(model_version))

    def check_health(self, stale_after_s: float) -> None:
        """Raise when the worker failed, or has put nothing for ``stale_after_s``.

        Raises:
            RuntimeError: what stopped it (chained), or how long it has been silent.
        """
        if self._failure is not None:
            raise RuntimeError(f"fleetroll's rollout worker failed: {self._failure}") from (
                self._failure
            )
        quiet = time.monotonic() - self._last_progress
        if self._thread is not None and not self._stopping.is_set() and quiet > stale_after_s:
            raise RuntimeError(f"fleetroll's rollout worker has produced nothing for {quiet:.0f} s")

    def _produce(self) -> None:
        keys = list(self.rollouts.core.tasks)
        order = random.Random(self._seed)
        group = 0
        try:
            while not self._stopping.is_set():
                order.shuffle(keys)
                for start in range(0, len(keys), self.tasks_per_batch):
                    chosen = keys[start : start + self.tasks_per_batch]
                    requests = [Request(k, i) for k in chosen for i in range(self.num_generations)]
                    rows = self.rollouts.run(requests)
                    ids: dict[str, int] = {}
                    for key in chosen:
                        ids[key], group = group, group + 1
                    scored = [r for r in rows if r["reward"] is not None]
                    for row in scored:
                        self._put(self._sample(row, ids[row["task_key"]]))
                    self.metrics_queue.put(
                        {"fleetroll/failed_rollouts": float(len(rows) - len(scored))}
                    )
                    self._last_progress = time.monotonic()
                    if self._stopping.is_set():
                        return
        except Exception as exc:  # the trainer hears it through check_health
            if not self._stopping.is_set():
                self._failure = exc

    def _put(self, sample: Any) -> None:
        while not self._stopping.is_set():
            try:
                self.rollout_buffer.put(sample, timeout=0.5)
            except queue.Full:
                continue
            self._last_progress = time.monotonic()
            return

    def _sample(self, row: Row, group_id: int) -> Any:
        import numpy as np
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        prompt, completion = row["prompt_ids"], row["completion_ids"]
        mask = row["completion_mask"]
        logprobs = [0.0 if lp is None else lp for lp in row["completion_logprobs"]]
        versions = [v for v in row["completion_policy_versions"] if v is not None]
        task = self.rollouts.core.tasks[row["task_key"]]
        return RolloutSample(
            prompt=prompt_messages(task, self.rollouts.core.settings.policy.system_prompt),
            completion=[],
            input_ids=np.asarray([*prompt, *completion], dtype=np.int64),
            completion_mask=np.asarray([0] * len(prompt) + list(mask), dtype=np.int64),
            old_log_probs=np.asarray([0.0] * len(prompt) + logprobs, dtype=np.float32),
            advantage=float(row["advantage"]),
            model_version=min(versions) if versions else 0,
            group_id=group_id,
            metrics={"reward": float(row["reward"])},
            enqueued_at=time.time(),
        )

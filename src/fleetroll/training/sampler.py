"""Task sampling: which tasks each training step runs, seeded, resumable.

::

    sampler = TaskSampler(tasks, SamplerConfig(batch_tasks=8, weights={"ledger": 3, "desktop": 1}))
    for _ in range(steps):
        draw = sampler.draw()  # draw.step, draw.epoch, draw.tasks (8 distinct tasks)
        batch = pool.run_batch(draw.tasks, policy, samples_per_task=4)
        async for group in batch.groups():
            sampler.observe(group)  # the difficulty filter learns from each group
        save(sampler.state())  # JSON; TaskSampler(tasks, config, state) goes on from here

Pure: no I/O, no clock, no global random state. Everything below is decided
by the tasks (keys and ``env_key``), the :class:`SamplerConfig` and the
groups observed, so a sampler rebuilt from its :meth:`TaskSampler.state`
draws exactly what the original would have drawn next.

**Streams and passes.** The tasks are split into streams: with no weights
and no minimums, one stream of every task; otherwise one stream per
environment (a task's ``env_key``). A stream is drawn in passes: each pass
is a shuffle of its tasks (seeded by ``seed``, the stream and the pass
number), drawn in order, each task once; the next pass starts when it is
used up. A pass that starts in the middle of a batch puts the tasks already
in that batch last, so a batch never holds a task twice and a pass still
holds every task once.

**Epochs.** With no weights and no minimums there is one stream, and an
epoch is its pass: it ends when every task was drawn once, and no task is
drawn twice within it. With weights the mix follows the weights, not the
task counts, so an environment with more weight than tasks goes through its
tasks faster than the others: each environment's passes are then its
epochs, and no task is drawn twice within its environment's pass.
:attr:`TaskSampler.epoch` is the passes completed by the slowest stream
drawn from: every task (of an environment drawn from) was drawn at least
``epoch`` times.

**Weights and minimums.** Each batch first gives every environment its
minimum, then fills the rest so that each environment's draws, counted from
the first step, stay within one task of its weight's share of all draws
(``M x weight / sum of the weights`` per step; largest accumulated shortfall
first, ties to the environment first by name). Exactly: while every
environment can take its share (enough tasks not resting, minimums no
larger than the shares), after every step ``|drawn - share| < 1`` for each
environment. An environment that cannot take its share in a step (too few
tasks out of rest, a minimum above its share) does not make the difference
up later beyond one task: the shortfall and the surplus are capped at one.
An environment with weight 0 is drawn only for its minimum. Minimums with
no weights weigh each environment by its number of tasks.

**The difficulty filter** (``rest_uniform``). A group (the samples of one
task in one step) that is ``uniform`` (every sample the same reward: all
solved or none, zero GRPO advantage) counts against its task;
``uniform_groups`` of them in a row rest the task for ``rest_steps`` steps,
from the next draw on (groups that failures left short count neither way; a
group that is not uniform clears the count). A resting task is passed over
when its turn in its pass comes (it misses that pass) and is drawn again in
a later pass once it is back. So that a batch is never short, when fewer
tasks are out of rest than a batch or an environment's minimum needs, the
ones due back first come back early.
"""

from __future__ import annotations

import hashlib
import heapq
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fleetroll.errors import ConfigError
from fleetroll.settings import SamplingSettings
from fleetroll.tasks import TaskSpec
from fleetroll.training.groups import Group

__all__ = ["Draw", "SamplerConfig", "SamplerState", "StreamState", "TaskSampler"]

#: The one stream of every task, when there are no weights and no minimums.
ALL = "*"
_FORMAT = 1


@dataclass(frozen=True, slots=True)
class SamplerConfig:
    """What a sampler draws: ``batch_tasks`` distinct tasks per step, mixed by environment.

    The fields of ``[sampling]`` (docs/configuration.md) and the batch size.
    """

    batch_tasks: int
    seed: int = 0
    weights: Mapping[str, float] = field(default_factory=dict)
    minimums: Mapping[str, int] = field(default_factory=dict)
    rest_uniform: bool = False
    uniform_groups: int = 2
    rest_steps: int = 8

    @classmethod
    def from_settings(cls, settings: SamplingSettings, batch_tasks: int) -> SamplerConfig:
        return cls(
            batch_tasks=batch_tasks,
            seed=settings.seed,
            weights=dict(settings.weights),
            minimums=dict(settings.minimums),
            rest_uniform=settings.rest_uniform,
            uniform_groups=settings.uniform_groups,
            rest_steps=settings.rest_steps,
        )

    def to_json(self) -> dict[str, Any]:
        """The config as JSON values, keys sorted (what a saved state is checked against)."""
        return {
            "batch_tasks": self.batch_tasks,
            "seed": self.seed,
            "weights": {k: float(v) for k, v in sorted(self.weights.items())},
            "minimums": {k: int(v) for k, v in sorted(self.minimums.items())},
            "rest_uniform": self.rest_uniform,
            "uniform_groups": self.uniform_groups,
            "rest_steps": self.rest_steps,
        }


class StreamState(BaseModel):
    """Where a stream is: its pass (from 0), the next place in it, the tasks put last."""

    model_config = ConfigDict(extra="forbid")

    passes: int = 0
    position: int = 0
    #: Tasks moved to the end of this pass (they were in the batch it started in).
    deferred: list[str] = Field(default_factory=list)


class SamplerState(BaseModel):
    """A sampler's whole state, as JSON: restore it with ``TaskSampler(tasks, config, state)``."""

    model_config = ConfigDict(extra="forbid")

    format: int = _FORMAT
    #: The config it was made with (:meth:`SamplerConfig.to_json`).
    config: dict[str, Any]
    #: A digest of the task keys and their environments.
    tasks: str
    #: The next step to draw (steps drawn so far).
    step: int = 0
    #: For people reading the file: :attr:`TaskSampler.epoch` when it was saved.
    epoch: int = 0
    streams: dict[str, StreamState] = Field(default_factory=dict)
    #: Per environment: its share of the draws so far minus its draws (within ±1).
    credits: dict[str, float] = Field(default_factory=dict)
    #: Resting tasks: key -> the step it is drawn again from.
    resting: dict[str, int] = Field(default_factory=dict)
    #: Uniform groups in a row, per task (those with none are left out).
    streaks: dict[str, int] = Field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Draw:
    """The tasks of one step, grouped by stream (by name), each stream's in draw order."""

    step: int
    #: :attr:`TaskSampler.epoch` when the step was drawn.
    epoch: int
    tasks: tuple[TaskSpec, ...]

    @property
    def keys(self) -> list[str]:
        return [t.key for t in self.tasks]


def tasks_digest(tasks: Iterable[TaskSpec]) -> str:
    """A digest of the task keys and their environments: what a sampler's draws depend on."""
    pairs = sorted(f"{t.key}\0{t.env_key}" for t in tasks)
    return hashlib.sha256("\n".join(pairs).encode()).hexdigest()[:16]


class TaskSampler:
    """Draws the tasks of each step; see the module's docstring for the exact rules.

    Raises:
        ConfigError: the config cannot be met by these tasks (a weight or
            minimum naming no environment of the tasks, an environment with
            no weight, minimums over the batch or over an environment's tasks,
            a batch larger than the tasks that can be drawn), or ``state`` is
            not this sampler's (other tasks, another config).
    """

    def __init__(
        self,
        tasks: Sequence[TaskSpec],
        config: SamplerConfig,
        state: SamplerState | None = None,
    ) -> None:
        self.config = config
        self._tasks = {t.key: t for t in tasks}
        self._digest = tasks_digest(tasks)
        per_stream = config.weights or config.minimums
        self._members: dict[str, list[str]] = {}
        for task in tasks:
            self._members.setdefault(task.env_key if per_stream else ALL, []).append(task.key)
        for keys in self._members.values():
            keys.sort()
        self._stream_of = {key: s for s, keys in self._members.items() for key in keys}
        self._check()
        self._weights = (
            {s: float(config.weights.get(s, 0.0)) for s in self._members}
            if config.weights
            else {s: float(len(keys)) for s, keys in self._members.items()}
        )
        self._minimums = {s: int(config.minimums.get(s, 0)) for s in self._members}
        #: The streams drawn from: a weight or a minimum.
        self._drawn = [s for s in sorted(self._members) if self._weights[s] or self._minimums[s]]
        self._orders: dict[tuple[str, int], list[str]] = {}
        if state is None:
            state = SamplerState(config=config.to_json(), tasks=self._digest)
        self._restore(state)

    def _check(self) -> None:
        c = self.config
        envs = sorted({t.env_key for t in self._tasks.values()})
        if c.batch_tasks < 1:
            raise ConfigError("the batch size (--batch-tasks) must be at least 1")
        for setting, names in (("weights", c.weights), ("minimums", c.minimums)):
            unknown = sorted(set(names) - set(envs))
            if unknown:
                raise ConfigError(
                    f"sampling.{setting} names environment {unknown[0]!r}, which no task has"
                    f" (environments: {', '.join(envs)})"
                )
        if c.weights:
            missing = sorted(set(envs) - set(c.weights))
            if missing:
                raise ConfigError(
                    f"sampling.weights has no weight for environment {missing[0]!r}:"
                    " give every environment of the tasks one (0 leaves it out)"
                )
        for env, n in sorted(c.minimums.items()):
            if n > len(self._members[env]):
                raise ConfigError(
                    f"sampling.minimums.{env} is {n}, but environment {env!r} has only"
                    f" {len(self._members[env])} tasks (a batch holds each task once)"
                )
        if sum(c.minimums.values()) > c.batch_tasks:
            raise ConfigError(
                f"sampling.minimums add up to {sum(c.minimums.values())}, more than a batch"
                f" of {c.batch_tasks} tasks (--batch-tasks)"
            )
        if c.weights and not any(c.weights.values()) and sum(c.minimums.values()) < c.batch_tasks:
            raise ConfigError("sampling.weights are all 0: nothing fills a batch past the minimums")
        drawable = sum(
            len(keys)
            for s, keys in self._members.items()
            if not c.weights or c.weights.get(s) or c.minimums.get(s)
        )
        if c.batch_tasks > drawable:
            raise ConfigError(
                f"--batch-tasks {c.batch_tasks} is more than the {drawable} tasks that can be"
                " drawn (a batch holds each task once)"
            )

    def _restore(self, state: SamplerState) -> None:
        if state.format != _FORMAT:
            raise ConfigError(f"a sampler state of format {state.format}, not {_FORMAT}")
        if state.tasks != self._digest:
            raise ConfigError("the sampler state was saved for other tasks")
        if state.config != self.config.to_json():
            changed = sorted(
                k
                for k in {*state.config, *self.config.to_json()}
                if state.config.get(k) != self.config.to_json().get(k)
            )
            raise ConfigError(
                "the sampler state was saved with other sampling settings"
                f" (changed: {', '.join(changed)})"
            )
        self._step = state.step
        self._streams = {s: StreamState() for s in self._members}
        for s, st in state.streams.items():
            if s not in self._streams:
                raise ConfigError(f"the sampler state has a stream {s!r} these tasks do not")
            self._streams[s] = st.model_copy(deep=True)
        self._credits = {s: float(state.credits.get(s, 0.0)) for s in self._members}
        self._resting = dict(state.resting)
        self._streaks = Counter(state.streaks)

    @property
    def step(self) -> int:
        """The next step to draw (the number of steps drawn so far)."""
        return self._step

    @property
    def epoch(self) -> int:
        """Passes completed by the slowest stream drawn from (see the module's docstring)."""
        return min(self._completed(s) for s in self._drawn)

    def _completed(self, s: str) -> int:
        st = self._streams[s]  # a pass used up is complete; the next starts at its first draw
        return st.passes + (st.position >= len(self._members[s]))

    @property
    def resting(self) -> dict[str, int]:
        """Resting tasks: key -> the step from which it is drawn again."""
        return dict(self._resting)

    def state(self) -> SamplerState:
        """Everything needed to go on from here (a copy)."""
        return SamplerState(
            config=self.config.to_json(),
            tasks=self._digest,
            step=self._step,
            epoch=self.epoch,
            streams={s: st.model_copy(deep=True) for s, st in sorted(self._streams.items())},
            credits=dict(sorted(self._credits.items())),
            resting=dict(sorted(self._resting.items())),
            streaks={k: n for k, n in sorted(self._streaks.items()) if n},
        )

    def draw(self) -> Draw:
        """The next step's ``batch_tasks`` distinct tasks; the step counts as drawn."""
        step, epoch = self._step, self.epoch
        self._resting = {k: back for k, back in self._resting.items() if back > step}
        self._wake_if_short()
        taken: dict[str, None] = {}  # in draw order
        for s, n in sorted(self._allocate().items()):
            for _ in range(n):
                taken[self._next(s, taken)] = None
        self._step += 1
        return Draw(step, epoch, tuple(self._tasks[k] for k in taken))

    def observe(self, group: Group) -> None:
        """Learn from one delivered group (the difficulty filter; nothing when it is off).

        A rest it starts begins at the next :meth:`draw`. Groups of unknown
        tasks, groups left short by failures and groups of a resting task
        are ignored; the order groups are observed in does not matter.
        """
        key = group.task_key
        if not self.config.rest_uniform or key not in self._tasks or key in self._resting:
            return
        if not group.complete:
            return
        if not group.uniform:
            self._streaks.pop(key, None)
            return
        self._streaks[key] += 1
        if self._streaks[key] >= self.config.uniform_groups:
            del self._streaks[key]
            self._resting[key] = self._step + self.config.rest_steps

    def _out_of_rest(self) -> dict[str, int]:
        """Per stream drawn from, its tasks not resting."""
        resting = Counter(self._stream_of[k] for k in self._resting)
        return {s: len(self._members[s]) - resting[s] for s in self._drawn}

    def _wake_if_short(self) -> None:
        """Bring back early the tasks due back first, when too few are out of rest."""

        def wake(streams: Iterable[str], count: int) -> None:
            if count <= 0:
                return
            among = set(streams)
            due = sorted((b, k) for k, b in self._resting.items() if self._stream_of[k] in among)
            for _, k in due[:count]:
                del self._resting[k]

        for s, out in self._out_of_rest().items():
            wake([s], self._minimums[s] - out)
        wake(self._drawn, self.config.batch_tasks - sum(self._out_of_rest().values()))

    def _allocate(self) -> dict[str, int]:
        """How many tasks each stream gives this step: minimums, then the largest credit."""
        m = self.config.batch_tasks
        available = self._out_of_rest()
        eligible = [s for s in self._drawn if available[s]]
        allocation = {s: min(self._minimums[s], available[s]) for s in eligible}
        total = sum(self._weights[s] for s in eligible)
        for s in eligible:
            self._credits[s] += (m * self._weights[s] / total if total else 0.0) - allocation[s]
        # One place at a time to the largest credit (streams with a weight first, then
        # the first by name): a heap of the streams with room left.
        heap = [
            (not self._weights[s], -self._credits[s], i, s)
            for i, s in enumerate(eligible)
            if allocation[s] < available[s]
        ]
        heapq.heapify(heap)
        for _ in range(m - sum(allocation.values())):
            unweighted, _, i, s = heapq.heappop(heap)
            allocation[s] += 1
            self._credits[s] -= 1.0
            if allocation[s] < available[s]:
                heapq.heappush(heap, (unweighted, -self._credits[s], i, s))
        for s in eligible:  # a share a stream could not take is not made up later
            self._credits[s] = min(1.0, max(-1.0, self._credits[s]))
        return allocation

    def _order(self, s: str) -> list[str]:
        st = self._streams[s]
        order = self._orders.get((s, st.passes))
        if order is None:
            keys = list(self._members[s])
            random.Random(f"{self.config.seed}/{s}/{st.passes}").shuffle(keys)
            last = set(st.deferred)
            order = [k for k in keys if k not in last] + [k for k in keys if k in last]
            self._orders = {(s2, p): o for (s2, p), o in self._orders.items() if s2 != s}
            self._orders[(s, st.passes)] = order
        return order

    def _next(self, s: str, taken: Mapping[str, None]) -> str:
        """The next task of stream ``s`` not resting; a new pass when this one is used up."""
        st = self._streams[s]
        while True:
            order = self._order(s)
            if st.position >= len(order):
                st.passes += 1
                st.position = 0
                st.deferred = sorted(k for k in taken if self._stream_of[k] == s)
                continue
            key = order[st.position]
            st.position += 1
            if key in self._resting:
                continue  # passed over: it misses this pass
            # The allocation never asks a stream for more than its tasks out of
            # rest, and this pass has the batch's tasks last: never reached.
            assert key not in taken, f"task {key!r} drawn twice in one batch"
            return key

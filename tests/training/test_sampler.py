"""The task sampler (fleetroll.training.sampler): weights, passes, minimums, resume, the filter.

Pure and seeded: every test is deterministic and runs in milliseconds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import pytest

from fleetroll.errors import ConfigError
from fleetroll.tasks import TaskSpec
from fleetroll.training.groups import Group
from fleetroll.training.sampler import SamplerConfig, SamplerState, TaskSampler


def make_tasks(**counts: int) -> list[TaskSpec]:
    return [
        TaskSpec(key=f"{env}-{i:03d}", prompt=f"task {i} of {env}", env_key=env)
        for env, n in counts.items()
        for i in range(n)
    ]


def group(key: str, rewards: Iterable[float], *, complete: bool = True) -> Group:
    rewards = list(rewards)
    return Group(
        group_id=f"g-{key}",
        batch_id="b",
        task_key=key,
        expected=len(rewards),
        rewards=rewards,
        uniform=len(set(rewards)) == 1,
        complete=complete,
    )


def env_of(key: str) -> str:
    return key.rsplit("-", 1)[0]


@pytest.mark.parametrize(
    ("counts", "weights", "minimums", "batch"),
    [
        ({"ledger": 25, "desktop": 9, "notes": 6}, {"ledger": 3, "desktop": 1, "notes": 1}, {}, 4),
        ({"ledger": 25, "desktop": 9, "notes": 6}, {"ledger": 1, "desktop": 1, "notes": 1}, {}, 7),
        ({"a": 40, "b": 40, "c": 3}, {"a": 0.55, "b": 0.35, "c": 0.1}, {"c": 1}, 10),
        ({"a": 13, "b": 7}, {"a": 2, "b": 5}, {"a": 1, "b": 1}, 5),
    ],
)
def test_draws_follow_the_weights_within_one_task_at_every_step_over_2000_steps(
    counts: dict[str, int], weights: dict[str, float], minimums: dict[str, int], batch: int
) -> None:
    sampler = TaskSampler(
        make_tasks(**counts),
        SamplerConfig(batch_tasks=batch, seed=7, weights=weights, minimums=minimums),
    )
    total = sum(weights.values())
    drawn: Counter[str] = Counter()
    worst = 0.0
    for step in range(1, 2001):
        drawn.update(env_of(k) for k in sampler.draw().keys)
        for env, w in weights.items():
            share = step * batch * w / total
            worst = max(worst, abs(drawn[env] - share))
    # The stated tolerance: every environment within one task of its share, at every step.
    assert worst < 1.0
    assert sum(drawn.values()) == 2000 * batch


def test_without_weights_each_epoch_draws_every_task_exactly_once() -> None:
    tasks = make_tasks(ledger=25, desktop=9)
    sampler = TaskSampler(tasks, SamplerConfig(batch_tasks=4, seed=3))
    sequence: list[str] = []
    epochs: list[int] = []
    for _ in range(200):  # 800 draws: 23 epochs of 34 tasks and a part
        draw = sampler.draw()
        assert len(set(draw.keys)) == 4  # a batch never holds a task twice
        sequence += draw.keys
        epochs.append(draw.epoch)
    keys = sorted(t.key for t in tasks)
    whole = len(sequence) // len(keys)
    for e in range(whole):
        assert sorted(sequence[e * 34 : (e + 1) * 34]) == keys
    # An epoch is a pass: the epoch a step reports is the passes completed when it starts.
    assert epochs == [4 * step // 34 for step in range(200)]
    assert sampler.epoch == 800 // 34
    # Epochs differ in order: each pass is its own shuffle.
    assert sequence[:34] != sequence[34:68]


def test_with_weights_no_task_is_drawn_twice_within_its_environment_s_pass() -> None:
    counts = {"ledger": 25, "desktop": 9, "notes": 6}
    sampler = TaskSampler(
        make_tasks(**counts),
        SamplerConfig(batch_tasks=5, seed=11, weights={"ledger": 1, "desktop": 2, "notes": 2}),
    )
    per_env: dict[str, list[str]] = {env: [] for env in counts}
    for _ in range(500):
        draw = sampler.draw()
        assert len(set(draw.keys)) == 5
        for key in draw.keys:
            per_env[env_of(key)].append(key)
    for env, n in counts.items():
        sequence = per_env[env]
        for start in range(0, len(sequence) - n + 1, n):
            assert len(set(sequence[start : start + n])) == n, env
    # notes (6 tasks, weight 2) goes through its tasks fastest; ledger is the slowest.
    assert sampler.epoch == len(per_env["ledger"]) // 25
    assert sampler.state().streams["notes"].passes > sampler.state().streams["ledger"].passes


def test_minimums_are_met_in_every_batch_even_above_the_weights() -> None:
    sampler = TaskSampler(
        make_tasks(ledger=25, desktop=9, notes=6),
        SamplerConfig(
            batch_tasks=6,
            seed=1,
            weights={"ledger": 10, "desktop": 1, "notes": 0},
            minimums={"desktop": 2, "notes": 1},
        ),
    )
    for _ in range(300):
        per_env = Counter(env_of(k) for k in sampler.draw().keys)
        assert per_env["desktop"] >= 2
        # Weight 0: drawn for its minimum only.
        assert per_env["notes"] == 1
        assert sum(per_env.values()) == 6


def test_a_sampler_restored_from_its_json_state_mid_epoch_draws_the_same_sequence() -> None:
    tasks = make_tasks(ledger=25, desktop=9, notes=6)
    config = SamplerConfig(
        batch_tasks=4,
        seed=5,
        weights={"ledger": 2, "desktop": 1, "notes": 1},
        minimums={"notes": 1},
        rest_uniform=True,
        uniform_groups=2,
        rest_steps=3,
    )

    def feed(sampler: TaskSampler, keys: list[str], step: int) -> None:
        # A deterministic mix of uniform and mixed groups, so that tasks rest.
        for i, key in enumerate(keys):
            sampler.observe(group(key, [1.0, 1.0] if (i + step) % 3 else [0.0, 1.0]))

    straight = TaskSampler(tasks, config)
    expected = []
    for step in range(60):
        keys = straight.draw().keys
        expected.append(keys)
        feed(straight, keys, step)

    first = TaskSampler(tasks, config)
    got = []
    for step in range(23):  # mid-epoch of every environment
        keys = first.draw().keys
        got.append(keys)
        feed(first, keys, step)
    saved = first.state().model_dump_json()
    assert first.resting  # the filter's rest table is part of what is saved
    resumed = TaskSampler(tasks, config, SamplerState.model_validate_json(saved))
    assert resumed.step == 23
    for step in range(23, 60):
        keys = resumed.draw().keys
        got.append(keys)
        feed(resumed, keys, step)
    assert got == expected
    assert resumed.state() == straight.state()


def test_the_same_seed_draws_the_same_sequence_and_another_seed_another() -> None:
    tasks = make_tasks(ledger=25, desktop=9)

    def sequence(seed: int) -> list[list[str]]:
        sampler = TaskSampler(tasks, SamplerConfig(batch_tasks=3, seed=seed))
        return [sampler.draw().keys for _ in range(20)]

    assert sequence(1) == sequence(1)
    assert sequence(1) != sequence(2)


def test_the_filter_rests_a_task_after_uniform_groups_and_brings_it_back() -> None:
    tasks = make_tasks(a=4)
    config = SamplerConfig(batch_tasks=2, seed=0, rest_uniform=True, uniform_groups=2, rest_steps=3)
    sampler = TaskSampler(tasks, config)
    target = "a-000"
    drawn_at: list[int] = []
    rested_at: int | None = None
    for _ in range(40):
        draw = sampler.draw()
        if target in draw.keys:
            drawn_at.append(draw.step)
        if rested_at is not None and draw.step < rested_at + 1 + 3:
            assert target not in draw.keys  # resting for 3 steps after its second uniform group
        for key in draw.keys:
            # The target is always solved (uniform); the others are mixed.
            sampler.observe(group(key, [1.0, 1.0, 1.0] if key == target else [0.0, 1.0, 1.0]))
        if target in sampler.resting and rested_at is None:
            rested_at = draw.step
            assert sampler.resting[target] == draw.step + 1 + 3
    assert rested_at is not None
    # It was drawn twice (two uniform groups) before it rested ...
    assert len([s for s in drawn_at if s <= rested_at]) == 2
    # ... and drawn again after its rest.
    assert any(s >= rested_at + 1 + 3 for s in drawn_at)
    assert all(not rested_at < s < rested_at + 1 + 3 for s in drawn_at)


def test_every_task_rests_its_full_rest_while_enough_others_are_out_of_rest() -> None:
    sampler = TaskSampler(
        make_tasks(a=7),
        SamplerConfig(batch_tasks=2, seed=4, rest_uniform=True, uniform_groups=1, rest_steps=2),
    )
    steps = []
    for _ in range(60):
        draw = sampler.draw()
        steps.append(set(draw.keys))
        for key in draw.keys:  # every group uniform: each task drawn rests 2 steps
            sampler.observe(group(key, [0.0, 0.0]))
    for s in range(2, 60):
        assert not steps[s] & (steps[s - 1] | steps[s - 2]), s
    # 7 tasks, 2 a step, each resting the 2 steps after its own: all of them come back.
    assert set().union(*steps[-10:]) == {f"a-{i:03d}" for i in range(7)}


def test_a_mixed_group_clears_the_count_and_short_groups_count_neither_way() -> None:
    sampler = TaskSampler(
        make_tasks(a=4),
        SamplerConfig(batch_tasks=2, rest_uniform=True, uniform_groups=2, rest_steps=5),
    )
    sampler.observe(group("a-001", [1.0, 1.0]))
    sampler.observe(group("a-001", [0.0, 1.0]))  # clears the count
    sampler.observe(group("a-001", [1.0, 1.0]))
    sampler.observe(group("a-001", [1.0], complete=False))  # short: not counted
    assert sampler.resting == {}
    sampler.observe(group("a-001", [0.0, 0.0]))  # none solved: uniform too
    assert sampler.resting == {"a-001": 5}


def test_the_filter_is_off_by_default() -> None:
    sampler = TaskSampler(make_tasks(a=4), SamplerConfig(batch_tasks=2))
    for _ in range(5):
        sampler.observe(group("a-001", [1.0, 1.0]))
    assert sampler.resting == {}


def test_a_batch_is_never_short_the_tasks_due_back_first_come_back_early() -> None:
    sampler = TaskSampler(
        make_tasks(a=3),
        SamplerConfig(batch_tasks=2, rest_uniform=True, uniform_groups=1, rest_steps=10),
    )
    sampler.observe(group("a-000", [1.0, 1.0]))
    sampler.observe(group("a-001", [1.0, 1.0]))  # same return step: the first key wakes
    assert sampler.resting == {"a-000": 10, "a-001": 10}
    draw = sampler.draw()
    assert sorted(draw.keys) == ["a-000", "a-002"]
    assert sampler.resting == {"a-001": 10}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            SamplerConfig(batch_tasks=3, weights={"ledger": 1}),
            "no weight for environment 'desktop'",
        ),
        (
            SamplerConfig(batch_tasks=3, weights={"ledger": 1, "desktop": 1, "ledgr": 1}),
            "names environment 'ledgr'",
        ),
        (SamplerConfig(batch_tasks=3, minimums={"desktop": 3}), "has only 2 tasks"),
        (
            SamplerConfig(batch_tasks=3, minimums={"desktop": 2, "ledger": 2}),
            "add up to 4, more than a batch of 3",
        ),
        (SamplerConfig(batch_tasks=6), "--batch-tasks 6 is more than the 5 tasks"),
        (
            SamplerConfig(batch_tasks=3, weights={"ledger": 0, "desktop": 1}),
            "--batch-tasks 3 is more than the 2 tasks",
        ),
        (SamplerConfig(batch_tasks=2, weights={"ledger": 0, "desktop": 0}), "all 0"),
    ],
)
def test_a_config_the_tasks_cannot_meet_is_refused_with_what_to_change(
    config: SamplerConfig, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        TaskSampler(make_tasks(ledger=3, desktop=2), config)


def test_a_state_saved_for_other_tasks_or_settings_is_refused() -> None:
    tasks = make_tasks(a=4)
    state = TaskSampler(tasks, SamplerConfig(batch_tasks=2, seed=1)).state()
    with pytest.raises(ConfigError, match="other tasks"):
        TaskSampler(make_tasks(a=5), SamplerConfig(batch_tasks=2, seed=1), state)
    with pytest.raises(ConfigError, match=r"other sampling settings \(changed: seed\)"):
        TaskSampler(tasks, SamplerConfig(batch_tasks=2, seed=2), state)

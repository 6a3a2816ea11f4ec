"""The ideal makespan: the closed form where it holds, the limits where they bind."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from fleetroll.bench.ideal import IdealModel, ideal_makespan
from fleetroll.bench.scenarios import bench_tasks
from fleetroll.settings.fault_profiles import FaultProfile, Latency

BASE = IdealModel(
    rollouts=10,
    concurrency=4,
    max_creates=4,
    creates_per_second=1e9,
    create_s=1.0,
    queue_interval_s=0.0,
    warmup_s=0.0,
    acting_s=2.0,
)


def model(**changes: Any) -> IdealModel:
    return replace(BASE, **changes)


def test_the_ideal_is_the_closed_form_when_provisioning_keeps_up() -> None:
    m = model()
    assert m.closed_form_s == 1.0 + 3 * 2.0
    assert ideal_makespan(m) == pytest.approx(m.closed_form_s)


def test_one_create_at_a_time_makes_provisioning_the_bottleneck() -> None:
    m = model(concurrency=10, max_creates=1, acting_s=0.5)
    assert ideal_makespan(m) == pytest.approx(10 * 1.0 + 0.5)


def test_the_create_rate_binds_after_the_burst() -> None:
    m = model(concurrency=10, max_creates=1, creates_per_second=2.0, create_s=0.0, acting_s=1.0)
    assert ideal_makespan(m) == pytest.approx(9 * 0.5 + 1.0)


def test_the_emulators_create_queue_spaces_creates() -> None:
    m = model(concurrency=10, max_creates=10, queue_interval_s=1.0, create_s=0.0, acting_s=1.0)
    assert ideal_makespan(m) == pytest.approx(9 * 1.0 + 1.0)


def test_the_scripted_policy_thinks_once_more_than_it_has_steps() -> None:
    profile = FaultProfile(create_latency=Latency(min_s=4.0, max_s=6.0), mcp_warmup_s=1.0)
    profile = profile.model_copy(update={"tool_latency": Latency(min_s=0.2)})
    m = IdealModel.of(
        profile,
        rollouts=1000,
        concurrency=1000,
        max_creates=1000,
        creates_per_second=1e9,
        steps=5,
        think_s=4.0,
    )
    assert m.path_s == pytest.approx(5.0 + 1.0 + 6 * 4.0 + 5 * 0.2)
    assert ideal_makespan(m) == pytest.approx(m.path_s)


def test_bench_tasks_form_groups_when_the_sample_count_divides() -> None:
    tasks, samples = bench_tasks(24, 5)
    assert (len(tasks), samples) == (3, 8)
    assert all(len(t.solution or ()) == 5 for t in tasks)
    tasks, samples = bench_tasks(7, 2)
    assert (len(tasks), samples) == (7, 1)

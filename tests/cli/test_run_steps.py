"""`fleetroll run --steps N --batch-tasks K` as a user runs it: the task sampler's steps,
interrupted and resumed, on the embedded emulator in a real process."""

from __future__ import annotations

import signal
import sys
from collections import defaultdict
from pathlib import Path

import anyio
import pytest
from test_cli import clean_env, fleetroll, ledger_part, started

from fleetroll.pool.journal import read_journal, sampler_path
from fleetroll.results import FailureReason
from fleetroll.settings import load_settings
from fleetroll.tasks import load_tasks
from fleetroll.training.groups import Group
from fleetroll.training.sampler import SamplerConfig, TaskSampler

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

STEPS, BATCH, SAMPLES, TASKS = 3, 2, 2, 5
#: Slow enough that a step is still running when the signal comes; the filter on, so that
#: what a step drew depends on the groups of the steps before it (the scripted policy
#: solves every task: every group is uniform, and rests its task for one step).
CONFIG = """\
[policy]
think_time_s = 0.3
[pool]
concurrency = 4
[sampling]
seed = 0
rest_uniform = true
uniform_groups = 1
rest_steps = 1
"""


def args(tasks: Path, out: Path, config: Path, *more: str) -> list[str]:
    return [
        sys.executable, "-m", "fleetroll", "run", str(tasks), "--out", str(out),
        "--samples", str(SAMPLES), "--steps", str(STEPS), "--batch-tasks", str(BATCH),
        "--config", str(config), *more,
    ]  # fmt: skip


def sequence(out: Path) -> list[list[str]]:
    """The tasks of each step, as the journal has them; every result of a step once."""
    by_step: dict[int, set[str]] = defaultdict(set)
    results = read_journal(out)
    for r in results:
        assert r.step is not None and r.batch_id.endswith(f"-step{r.step}")
        assert r.failure_reason is not FailureReason.CANCELLED
        by_step[r.step].add(r.task_key)
    assert len(results) == STEPS * BATCH * SAMPLES
    return [sorted(by_step[s]) for s in range(STEPS)]


def expected(tasks: Path) -> list[list[str]]:
    """What the sampler draws when every group is uniform (every sample solved)."""
    settings = load_settings()
    config = SamplerConfig(
        batch_tasks=BATCH, seed=0, rest_uniform=True, uniform_groups=1, rest_steps=1
    )
    sampler = TaskSampler(load_tasks(tasks, modalities=settings.modalities), config)
    steps = []
    for _ in range(STEPS):
        keys = sampler.draw().keys
        steps.append(sorted(keys))
        for key in keys:
            sampler.observe(
                Group(
                    group_id=key,
                    batch_id="b",
                    task_key=key,
                    expected=SAMPLES,
                    rewards=[1.0] * SAMPLES,
                    uniform=True,
                )
            )
    return steps


@pytest.mark.timeout(300)
async def test_steps_interrupted_and_resumed_draw_the_same_tasks_as_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    tasks = ledger_part(tmp_path, TASKS)
    config = tmp_path / "steps.toml"
    config.write_text(CONFIG)

    whole = tmp_path / "whole.jsonl"
    done = fleetroll(*args(tasks, whole, config)[3:], tmp_path=tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr
    assert f"({STEPS} steps done)" in done.stderr

    out = tmp_path / "interrupted.jsonl"
    async with started(tmp_path, args(tasks, out, config), clean_env()) as (child, log):
        with anyio.fail_after(120):  # the last step has started: the first two are journaled
            await log.wait_for(lambda: f"step {STEPS}/{STEPS}" in log.read_text())
        child.send_signal(signal.SIGINT)
        with anyio.fail_after(60):
            await child.wait()
    assert child.returncode == 130, log.read_text()
    assert "(2 steps done)" in log.read_text()
    cut = read_journal(out)
    assert any(r.failure_reason is FailureReason.CANCELLED for r in cut)
    assert sampler_path(out).is_file()

    resumed = fleetroll(*args(tasks, out, config, "--resume")[3:], tmp_path=tmp_path, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    assert f"({STEPS} steps done)" in resumed.stderr

    assert sequence(out) == sequence(whole) == expected(tasks)
    # The filter made a difference: without it the sampler draws another sequence.
    plain = TaskSampler(
        load_tasks(tasks, modalities=load_settings().modalities),
        SamplerConfig(batch_tasks=BATCH, seed=0),
    )
    assert [sorted(plain.draw().keys) for _ in range(STEPS)] != sequence(out)

"""The live line of `fleetroll run`: what it keeps on a narrow terminal, and its ETA."""

from __future__ import annotations

import os
import random
import statistics
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from fleetroll.cli.run import _describe
from fleetroll.emulator import Emulator
from fleetroll.jobs.progress import Progress, Watch, eta_s
from fleetroll.policies import AssistantTurn, ScriptedPolicy, ToolSpec
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import TaskSpec, load_tasks

BUSY = Progress(
    total=1000,
    done=123,
    failed=7,
    in_flight=170,
    queued=700,
    provisioning=40,
    waiting=20,
    acting=100,
    finishing=10,
    concurrency=100,
    mean_s=20.0,
    age_s=9.0,
    first_done_s=12.0,
)


@pytest.mark.parametrize("width", [80, 60])
def test_a_narrow_terminal_keeps_the_failed_count_the_rate_and_the_eta(width: int) -> None:
    line = _describe(BUSY, 130.0, width)
    assert len(line) <= width, line
    for part in ("130/1000 done", "7 failed", "/s", "ETA "):
        assert part in line, line
    # The wide line has it all; the narrow one left out the details, not the end.
    assert "finishing" in _describe(BUSY, 130.0) and "finishing" not in line


def test_at_60_columns_the_details_go_before_the_acting_count() -> None:
    assert "100 acting (max 100)" in _describe(BUSY, 130.0, 80)
    assert "queued" not in _describe(BUSY, 130.0, 60)


def _simulate(
    n: int, slots: int, seed: int
) -> tuple[list[tuple[float, float]], float]:  # (start, end) of each rollout, makespan
    rng = random.Random(seed)
    free = [0.0] * slots
    spans = []
    for _ in range(n):
        free.sort()
        start = free[0]
        end = start + rng.uniform(5.0, 15.0)  # provisioning, acting and verifying
        free[0] = end
        spans.append((start, end))
    return spans, max(end for _, end in spans)


def _look(spans: list[tuple[float, float]], slots: int, t: float) -> Progress:
    """What the watch sees at time ``t``: a deterministic clock, no real batch."""
    done = [end - start for start, end in spans if end <= t]
    ages = [t - start for start, end in spans if start <= t < end]
    first = min(end for _, end in spans)
    return Progress(
        total=len(spans),
        done=len(done),
        failed=0,
        in_flight=len(ages),
        queued=sum(1 for start, _ in spans if start > t),
        acting=len(ages),
        concurrency=slots,
        mean_s=statistics.fmean(done) if done else None,
        age_s=statistics.fmean(ages) if ages else None,
        first_done_s=first if done else None,
    )


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_early_eta_of_a_full_batch_is_within_2x_of_the_time_it_really_takes(
    seed: int,
) -> None:
    spans, makespan = _simulate(1000, 100, seed)
    first = min(end for _, end in spans)
    for t in [first + 0.5, first + 1, 7.0, 10.0, 15.0, 30.0, 60.0, makespan * 0.8]:
        eta = eta_s(_look(spans, 100, t), t)
        truth = makespan - t
        assert eta is not None and truth / 2 <= eta <= truth * 2, (t, eta, truth)


def test_the_eta_is_unknown_until_a_rollout_finishes_and_zero_when_all_have() -> None:
    spans, makespan = _simulate(50, 10, 7)
    assert eta_s(_look(spans, 10, 1.0), 1.0) is None
    assert eta_s(_look(spans, 10, makespan), makespan) == 0.0


class _HeldPolicy(ScriptedPolicy):
    """Plays solutions, but the task ``held`` waits for ever (until cancelled)."""

    def __init__(self, held: str) -> None:
        super().__init__()
        self.held = held

    async def act(
        self, task: TaskSpec, messages: Sequence[Any], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        if task.key == self.held:
            await anyio.sleep_forever()
        return await super().act(task, messages, tools)


@pytest.mark.slow
async def test_after_a_cancel_the_live_line_counts_the_cancelled_apart_from_the_failed() -> None:
    settings = load_settings(telemetry={"db_path": os.devnull, "send_to_logfire": False})
    ledger = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=settings.modalities)
    # One completes, one fails (no solution to play: policy_error), one is cancelled.
    tasks = [ledger[0], ledger[1].model_copy(update={"solution": None}), ledger[2]]
    async with (
        Emulator() as emu,
        RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url) as pool,
    ):
        batch = pool.run_batch(tasks, _HeldPolicy(tasks[2].key))
        ended = 0
        with anyio.fail_after(60):
            async for _ in batch:
                ended += 1
                if ended == 2:
                    batch.cancel()
        progress = Watch(batch, 4).look(0.0)
    assert (progress.done, progress.failed, progress.cancelled) == (1, 1, 1)
    line = _describe(progress, 10.0)
    assert "3/3 done" in line and "1 failed" in line and "1 cancelled" in line, line

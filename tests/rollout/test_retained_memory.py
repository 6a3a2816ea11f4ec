"""What a finished rollout keeps, and what the collector walks per rollout.

A batch holds its rollouts until the pool forgets it (10,000 at once for a
large batch), so a finished rollout must keep its result and read model only,
not the machinery that produced them: the provider's instance object, the
live transcript, the MCP session. Bounds, not timings: retained bytes are
measured with tracemalloc (Python's own allocations) and objects with the
collector's own list, between a first and a second batch of the same size, so
one-time caches do not count.
"""

from __future__ import annotations

import gc
import tracemalloc

import anyio
import pytest

from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import Batch, RolloutPool
from fleetroll.rollout.machine import Rollout
from fleetroll.settings import load_settings
from fleetroll.tasks import SolutionStep, TaskSpec
from fleetroll.telemetry.events import Events
from fleetroll.testing.fake_provider import FakeProvider

pytestmark = pytest.mark.anyio

TASKS = [
    TaskSpec(
        key=f"t{i}",
        prompt="Write done.",
        env_key="fake",
        modality="tool_use",
        verifier_func="def verify(env):\n    return 1.0\n",
        solution=(SolutionStep(name="note", arguments={"word": "done"}),),
    )
    for i in range(5)
]
SAMPLES = 8
N = len(TASKS) * SAMPLES

#: What one finished rollout of TASKS may keep: its result (~6 KB here), its
#: live event log (~3 KB), the rollout and its counters: 15.8 KB measured.
#: It kept 22.4 KB before it let its instance's object, live transcript,
#: finished task (held by its stop scope) and the limits' closures go.
MAX_BYTES_PER_ROLLOUT = 18_000
#: Objects the collector tracks per finished rollout: 52 measured (75 before).
MAX_OBJECTS_PER_ROLLOUT = 60


async def run(pool: RolloutPool) -> Batch:
    batch = pool.run_batch(TASKS, ScriptedPolicy(), samples_per_task=SAMPLES)
    with anyio.fail_after(60):
        results = await batch.results()
    assert [r.reward for r in results] == [1.0] * N
    return batch


def measure() -> tuple[int, int]:
    gc.collect()
    return tracemalloc.get_traced_memory()[0], len(gc.get_objects())


async def test_a_finished_rollout_keeps_its_result_and_read_model_not_its_machinery() -> None:
    s = load_settings(pool={"concurrency": 8}, provisioning={"max_concurrent_creates": 8})
    kept: list[Batch] = []
    tracemalloc.start(1)
    try:
        async with RolloutPool(
            s, provider=FakeProvider(s.modalities, timeouts=s.timeouts), events=Events()
        ) as pool:
            kept.append(await run(pool))  # warm-up: imports, caches, connections
            bytes_before, objects_before = measure()
            kept.append(await run(pool))
            bytes_after, objects_after = measure()
    finally:
        tracemalloc.stop()
    rollout = kept[-1].rollouts[0]
    assert isinstance(rollout, Rollout) and rollout.result is not None
    assert rollout.instance is not None and rollout.instance.handle is None
    assert rollout.session is None and rollout.route is None and rollout.tools == []
    assert len(rollout.progress.transcript) == 0 and rollout.stop_scope is None
    assert rollout.messages == list(rollout.result.transcript)  # the result's, redacted
    per_rollout = (bytes_after - bytes_before) / N
    objects = (objects_after - objects_before) / N
    assert per_rollout < MAX_BYTES_PER_ROLLOUT, f"{per_rollout:.0f} bytes kept per rollout"
    assert objects < MAX_OBJECTS_PER_ROLLOUT, f"{objects:.0f} tracked objects per rollout"


async def test_rollouts_of_one_environment_share_their_tool_specs() -> None:
    # One copy of each listed schema for every rollout, not one per rollout.
    s = load_settings()
    async with RolloutPool(
        s, provider=FakeProvider(s.modalities, timeouts=s.timeouts), events=Events()
    ) as pool:
        with anyio.fail_after(10):
            async with pool.session(TASKS[0], sample_index=0) as first:
                tools = first.tools
            async with pool.session(TASKS[1], sample_index=1) as second:
                again = second.tools
    assert tools and [t.name for t in tools] == [t.name for t in again]
    assert all(a is b for a, b in zip(tools, again, strict=True))

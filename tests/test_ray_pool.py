"""RayRolloutPool on a local Ray instance: the pool's guarantees across processes."""

from __future__ import annotations

import os
from collections import Counter

import anyio
import pytest

ray = pytest.importorskip("ray")

from fleetroll.emulator import FaultProfile, Latency  # noqa: E402
from fleetroll.emulator.process import EmulatorProcess  # noqa: E402
from fleetroll.policies import ScriptedPolicy  # noqa: E402
from fleetroll.ray_pool import RayRolloutPool  # noqa: E402
from fleetroll.settings import config_dir, load_settings  # noqa: E402
from fleetroll.tasks import load_tasks  # noqa: E402
from fleetroll.telemetry import Events, MemorySink  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SETTINGS = load_settings()
LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)
CREATE_LIMIT = 4


@pytest.fixture(scope="module")
def local_ray():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def settings():
    return load_settings(
        pool={"concurrency": 32},
        provisioning={
            "max_concurrent_creates": CREATE_LIMIT,
            "creates_per_second": 500,
            "backoff_initial_s": 0.05,
            "backoff_max_s": 0.5,
        },
    )


def assert_pairs(sink: MemorySink) -> None:
    started = Counter(e.attributes["rollout_id"] for e in sink.named("fleet_rollout_started"))
    completed = Counter(e.attributes["rollout_id"] for e in sink.named("fleet_rollout_completed"))
    assert started == completed and set(completed.values()) <= {1}


async def test_three_actors_run_300_rollouts_with_one_result_each_and_no_leak(local_ray):
    sink = MemorySink()
    profile = FaultProfile(create_latency=Latency(min_s=0.01, max_s=0.05))
    async with EmulatorProcess(profile) as emu:
        async with RayRolloutPool(
            settings(),
            api_key=emu.api_key,
            base_url=emu.base_url,
            num_actors=3,
            events=Events([sink]),
        ) as pool:
            with anyio.fail_after(300):
                results = await pool.run_batch(
                    LEDGER[:25], ScriptedPolicy(), samples_per_task=12
                ).results()
            limiter = await pool.limiter.stats.remote()
        ledger = await emu.ledger()
    ids = Counter(r.rollout_id for r in results)
    assert len(ids) == 300 and set(ids.values()) == {1}
    assert all(r.reward == 1.0 for r in results)
    assert ledger["running"] == 0 and ledger["created"] == 300
    # The create limit held cluster-wide, in the limiter and in Fleet's own view.
    assert limiter["peak"] <= CREATE_LIMIT
    assert ledger["peak_concurrent_creates"] <= CREATE_LIMIT
    assert_pairs(sink)


async def test_killing_an_actor_mid_batch_still_yields_300_results(local_ray):
    sink = MemorySink()
    profile = FaultProfile(create_latency=Latency(min_s=0.01, max_s=0.05))
    async with EmulatorProcess(profile) as emu:
        async with RayRolloutPool(
            settings(),
            api_key=emu.api_key,
            base_url=emu.base_url,
            num_actors=3,
            events=Events([sink]),
        ) as pool:
            batch = pool.run_batch(
                LEDGER[:25], ScriptedPolicy(think_time_s=0.05), samples_per_task=12
            )
            results = []
            with anyio.fail_after(300):
                async for result in batch:
                    results.append(result)
                    if len(results) == 40:
                        ray.kill(pool.workers[1])
        ledger = await emu.ledger()
    ids = Counter(r.rollout_id for r in results)
    assert len(ids) == 300 and set(ids.values()) == {1}
    assert pool.alive == [True, False, True]
    assert sum(r.reward == 1.0 for r in results) == 300  # the lost ones were re-run
    assert ledger["running"] == 0
    assert sink.named("fleet_worker_lost")
    assert_pairs(sink)

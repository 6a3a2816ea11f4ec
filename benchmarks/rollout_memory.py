"""What a rollout costs in memory and in objects the collector walks, by its state.

    python benchmarks/rollout_memory.py finished [N]    # kept per finished rollout
    python benchmarks/rollout_memory.py waiting [N]     # per rollout waiting for room
    python benchmarks/rollout_memory.py in-flight [K]   # tracked per rollout in a policy call

``finished``: N ledger rollouts of 2 steps at C=50 on the emulator (its own
process), the batch kept as a pool keeps it: Python's allocations (tracemalloc)
and tracked objects (``gc.get_objects``) it added, per rollout, after a warm-up
batch. ``waiting``: a batch of N on the fake provider at C=4, measured right
after ``run_batch``. ``in-flight``: K rollouts on the emulator, each held in its
first policy call (its MCP session open): tracked objects per rollout, by type.
Nothing asserts (tests/rollout/test_retained_memory.py has the bounds).
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
from collections import Counter

import anyio
import anyio.lowlevel

from fleetroll.bench.scenarios import bench_tasks
from fleetroll.emulator.process import EmulatorProcess
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.rollout.phases import Phase
from fleetroll.settings import load_settings
from fleetroll.telemetry.events import Events
from fleetroll.testing.fake_provider import FakeProvider
from fleetroll.testing.planned_policy import PlannedPolicy


def _census() -> Counter[str]:
    gc.collect()
    return Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())


async def finished(n: int) -> None:
    settings = load_settings(
        provisioning={"creates_per_second": 100_000, "max_concurrent_creates": 50},
        pool={"concurrency": 50},
    )
    tasks, _ = bench_tasks(n, steps=2)
    async with (
        EmulatorProcess() as emu,
        RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url, events=Events()) as pool,
    ):
        await pool.run_batch(tasks[:1], ScriptedPolicy(), samples_per_task=8).results()
        gc.collect()
        tracemalloc.start()
        before, objects = tracemalloc.get_traced_memory()[0], len(gc.get_objects())
        batch = pool.run_batch(tasks, ScriptedPolicy(), samples_per_task=8)
        results = await batch.results()
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
        added = len(gc.get_objects()) - objects
        tracemalloc.stop()
        assert all(r.reward == 1.0 for r in results)
        print(
            f"finished: {kept / len(results) / 1024:.1f} KiB kept and {added / len(results):.0f}"
            f" tracked objects per rollout ({len(results)} rollouts, the batch held)"
        )


async def waiting(n: int) -> None:
    settings = load_settings(pool={"concurrency": 4}, provisioning={"max_concurrent_creates": 4})
    tasks, _ = bench_tasks(n, steps=1)
    async with RolloutPool(settings, provider=FakeProvider(settings), events=Events()) as pool:
        gc.collect()
        tracemalloc.start()
        before, objects = tracemalloc.get_traced_memory()[0], len(gc.get_objects())
        batch = pool.run_batch(tasks, ScriptedPolicy(), samples_per_task=8)
        for _ in range(3):
            await anyio.lowlevel.checkpoint()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
        added = len(gc.get_objects()) - objects
        tracemalloc.stop()
        print(
            f"waiting: {held / n:.0f} bytes and {added / n:.0f} tracked objects per rollout"
            f" ({n} rollouts, 8 may run at once)"
        )
        batch.cancel()
        await batch.results()


async def in_flight(k: int) -> None:
    settings = load_settings(
        pool={"concurrency": k},
        provisioning={"max_concurrent_creates": k, "creates_per_second": 10_000},
    )
    tasks, _ = bench_tasks(k, steps=1)
    async with (
        EmulatorProcess() as emu,
        RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url, events=Events()) as pool,
    ):
        await pool.run_batch(tasks[:1], PlannedPolicy(), samples_per_task=8).results()
        policy = PlannedPolicy({t.key: ["hold"] * 8 for t in tasks})
        before = _census()
        batch = pool.run_batch(tasks, policy, samples_per_task=8)
        with anyio.fail_after(120):
            for rollout in batch.rollouts:
                await rollout.wait_until(lambda r: r.phase is Phase.ACTING)
        during = _census()
        during.subtract(before)
        n = len(batch.rollouts)
        print(f"in flight: {sum(during.values()) / n:.0f} tracked objects per rollout ({n})")
        for name, count in during.most_common(20):
            print(f"  {count / n:6.1f} {name}")
        policy.release.set()
        await batch.results()


def main() -> None:
    what = sys.argv[1]
    size = int(sys.argv[2]) if len(sys.argv) > 2 else {"in-flight": 64}.get(what, 200)
    run = {"finished": finished, "waiting": waiting, "in-flight": in_flight}[what]
    anyio.run(run, size)


if __name__ == "__main__":
    main()

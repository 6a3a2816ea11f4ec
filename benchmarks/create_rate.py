"""The learnt create rate against the fixed one, on a throttling and on an idle emulator.

    python benchmarks/create_rate.py [--rollouts 96] [--limit 4]

Runs ``--rollouts`` ledger rollouts (concurrency 32) three times per Fleet:
with ``provisioning.adaptive_creates`` on (the default ceiling, 32 creates a
second), and off at 32 and at 8 creates a second (the fixed rate of old). The rate-limited
Fleet allows ``--limit`` creates a second (the emulator's
``create_rate_limit``: past it, 429 with the ``Retry-After`` of its next
token); the idle one answers every create in 10-30 ms. Prints, for each run,
the makespan, the rollouts that failed, the creates answered 429, and the
learnt rate's lowest and last values. Nothing here asserts: it measures
(tests/environments/test_create_rate_emulator.py has the tests that do).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import anyio

from fleetroll.emulator import Emulator
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.settings import config_dir, load_settings
from fleetroll.settings.fault_profiles import FaultProfile, Latency
from fleetroll.tasks import load_tasks
from fleetroll.telemetry import Events, MemorySink


async def one(profile: FaultProfile, rollouts: int, *, adaptive: bool, rate: float) -> str:
    settings = load_settings(
        pool={"concurrency": 32},
        provisioning={"adaptive_creates": adaptive, "creates_per_second": rate},
    )
    tasks = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=settings.modalities)
    samples = max(1, rollouts // 16)
    sink = MemorySink()
    async with Emulator(profile) as emu:
        async with RolloutPool(
            settings, api_key=emu.api_key, base_url=emu.base_url, events=Events([sink])
        ) as pool:
            started = time.monotonic()
            results = await pool.run_batch(
                tasks[:16], ScriptedPolicy(), samples_per_task=samples
            ).results()
            elapsed = time.monotonic() - started
            state = pool.admission.state()
        throttled = emu.ledger.creates_by_outcome["429"]
    failed = Counter(r.failure_reason.value for r in results if r.failure_reason)
    rates = [e.attributes["creates_per_second"] for e in sink.named("fleet_create_rate")]
    low = f"{min(rates):.2f}" if rates else "-"
    return (
        f"{'learnt' if adaptive else 'fixed '} {rate:4g}/s: {len(results)} rollouts in"
        f" {elapsed:5.1f} s,"
        f" failed {dict(failed) or 0}, 429s {throttled},"
        f" rate lowest {low}/s, last {state.creates_per_second:.2f}/s"
        f" ({state.creates_in_flight_limit} in flight)"
    )


async def main(rollouts: int, limit: float) -> None:
    latency = Latency(min_s=0.01, max_s=0.03)
    limited = FaultProfile(create_rate_limit=limit, create_latency=latency)
    idle = FaultProfile(create_latency=latency)
    for name, profile in ((f"limit {limit:g}/s", limited), ("idle", idle)):
        # Learnt under the default ceiling; fixed at it, and at the fixed rate of old.
        for adaptive, rate in ((True, 32.0), (False, 32.0), (False, 8.0)):
            said = await one(profile, rollouts, adaptive=adaptive, rate=rate)
            print(f"{name:11} {said}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=96)
    parser.add_argument("--limit", type=float, default=4.0)
    args = parser.parse_args()
    anyio.run(main, args.rollouts, args.limit)

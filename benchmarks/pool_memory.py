"""Memory of one long-lived RolloutPool over many small batches.

    python benchmarks/pool_memory.py [--batches 300] [--samples 8] [--warm-up 30]

Runs ``--batches`` batches of one ledger task x ``--samples`` on one pool
(the emulator in its own process, so only the pool's memory is measured),
reading every result, as a training controller does step after step. Prints
the process's resident size after the warm-up and at the end, the growth per
batch, and how many batches the pool still holds. Nothing here asserts: it
measures (tests/pool/test_pool.py has the bounded soak test that does).
"""

from __future__ import annotations

import argparse
import gc
import time

import anyio

from fleetroll.emulator.process import EmulatorProcess
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import load_tasks


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


async def measure(batches: int, samples: int, warm_up: int) -> None:
    settings = load_settings(
        provisioning={"creates_per_second": 1000, "max_concurrent_creates": 64}
    )
    tasks = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=settings.modalities)
    async with (
        EmulatorProcess() as emu,
        RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url) as pool,
    ):
        warm, began = rss_mib(), time.perf_counter()
        for n in range(batches):
            results = await pool.run_batch(
                tasks[:1], ScriptedPolicy(), samples_per_task=samples
            ).results()
            assert all(r.reward == 1.0 for r in results), results
            if n + 1 == warm_up:
                gc.collect()
                warm, began = rss_mib(), time.perf_counter()
        gc.collect()
        end = rss_mib()
        measured = batches - warm_up
        print(
            f"{batches} batches x {samples}: RSS {warm:.1f} MiB after {warm_up},"
            f" {end:.1f} MiB after {batches}: {(end - warm) * 1024 / measured:+.1f} KiB"
            f" per batch; {(time.perf_counter() - began) / measured:.3f} s per batch;"
            f" the pool holds {len(pool.batches)} batches"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--warm-up", type=int, default=30)
    args = parser.parse_args()
    anyio.run(measure, args.batches, args.samples, args.warm_up)


if __name__ == "__main__":
    main()

"""Instance reuse under Fleet's create queue: the same batch with reuse off, then on.

    python benchmarks/reuse_makespan.py [--tasks 8] [--samples 12] [--concurrency 16]

The emulator (in its own process) serves creates as Fleet's queue did under
load: one at a time, one every ``--queue-s`` seconds (the ``create-queue``
profile's 2 s). The batch is the first ``--tasks`` ledger tasks of
``config/tasks/ledger.jsonl``, ``--samples`` each, played by the scripted
policy (every rollout does its task's solution: writes to the ledger). Their
verifiers check the whole state exactly (every balance, and exactly the task's
own new transactions), so a rollout whose verifier saw another rollout's
changes would score 0.0 where a fresh instance scores 1.0.

It runs the batch with ``provisioning.reuse`` off, then on (same batch id, so
the same rollout ids), each on a fresh emulator, and reports per run: the
makespan (``run_batch`` to the last result), the time until the pool had
closed (idle instances released), instances created, instances still running
once the pool closed (from the emulator's ledger), the rewards; then whether
every rollout's reward is the same in both runs.

Nothing here asserts: it measures (``--json`` writes the numbers).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import anyio

from fleetroll.emulator import FaultProfile
from fleetroll.emulator.process import EmulatorProcess
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import TaskSpec, load_tasks


@dataclass
class Run:
    reuse: bool
    rollouts: int
    makespan_s: float
    closed_s: float
    created: int
    left_running: int
    statuses: dict[str, int]
    uses: dict[int, int]
    rewards: dict[str, float | None] = field(repr=False)


async def one_run(
    tasks: list[TaskSpec], samples: int, concurrency: int, queue_s: float, *, reuse: bool
) -> Run:
    settings = load_settings(pool={"concurrency": concurrency}, provisioning={"reuse": reuse})
    async with EmulatorProcess(FaultProfile(create_queue_interval_s=queue_s)) as emu:
        began = time.monotonic()
        async with RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url) as pool:
            results = await pool.run_batch(
                tasks, ScriptedPolicy(), samples_per_task=samples, batch_id="reuse-bench"
            ).results()
            makespan = time.monotonic() - began
        closed = time.monotonic() - began
        ledger = await emu.ledger()
    return Run(
        reuse=reuse,
        rollouts=len(results),
        makespan_s=round(makespan, 2),
        closed_s=round(closed, 2),
        created=ledger["created"],
        left_running=ledger["running"],
        statuses=dict(Counter(r.failure_reason or "completed" for r in results)),
        uses=dict(sorted(Counter(r.instance_uses or 0 for r in results).items())),
        rewards={r.rollout_id: r.reward for r in results},
    )


async def main(args: argparse.Namespace) -> dict[str, object]:
    settings = load_settings()
    ledger = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=settings.modalities)
    tasks = ledger[: args.tasks]
    runs = [
        await one_run(tasks, args.samples, args.concurrency, args.queue_s, reuse=reuse)
        for reuse in (False, True)
    ]
    fresh, reused = runs
    same = fresh.rewards == reused.rewards
    print(
        f"{len(tasks)} tasks x {args.samples} samples, --concurrency {args.concurrency},"
        f" one create per {args.queue_s:g} s"
    )
    print("| reuse | makespan | pool closed | created | left running | statuses | uses |")
    print("|---|---|---|---|---|---|---|")
    for run in runs:
        print(
            f"| {'on' if run.reuse else 'off'} | {run.makespan_s} s | {run.closed_s} s"
            f" | {run.created} | {run.left_running} | {run.statuses} | {run.uses} |"
        )
    print(f"speed-up: {fresh.makespan_s / reused.makespan_s:.1f}x; every reward the same: {same}")
    print(
        f"rewards: {dict(Counter(fresh.rewards.values()))} (off), "
        f"{dict(Counter(reused.rewards.values()))} (on)"
    )
    return {
        "command": " ".join(sys.argv),
        "runs": [asdict(run) for run in runs],
        "same_rewards": same,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--queue-s", type=float, default=2.0)
    parser.add_argument("--json", default=None, help="write the numbers here")
    parsed = parser.parse_args()
    numbers = anyio.run(main, parsed)
    if parsed.json:
        with open(parsed.json, "w", encoding="utf-8") as out:
            json.dump(numbers, out, indent=2)

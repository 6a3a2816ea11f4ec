"""Single process against Ray: the same batch through RolloutPool, here and on Ray actors.

    python benchmarks/ray_vs_single.py [--rollouts 1000] [--concurrency 250] [--actors 1 2]

One batch of the benchmark's ledger tasks (``fleetroll.bench.scenarios.bench_tasks``:
``--steps`` read-only tool calls each, scripted) runs once on a
:class:`~fleetroll.pool.rollout_pool.RolloutPool` in this process, then once on a
:func:`~fleetroll.pool.ray.executor.ray_pool` for each ``--actors`` count, on a
local Ray with one CPU per core. Every run gets a fresh emulator in its own
process with fixed latencies (``--create-s``, ``--tool-s``) and no faults.

The runs have the same total concurrency: ``--concurrency`` active rollouts
and as many concurrent creates, split evenly over the actors on Ray (the
create limit is cluster-wide there anyway). Makespan is from ``run_batch``
to the last result; starting the pool (Ray's actors) is not in it, and is
printed below the table. Leaked: instances still running in the emulator's
ledger once the pool has closed. A run stopped at ``--wall-limit`` is
cancelled, and says so.

Nothing here asserts: it measures. On this 2-core machine two actors gave
1.17x (CPU-bound) and 1.24x (realistic latencies) the single process's
throughput, four no more (benchmarks/RESULTS.md): hence ``--ray``'s default
of one actor per CPU, and this script's default of 1 and that many.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version

import anyio

from fleetroll.bench.scenarios import bench_tasks
from fleetroll.emulator import FaultProfile, Latency
from fleetroll.emulator.process import EmulatorProcess
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.ray.actors import default_num_actors
from fleetroll.pool.ray.executor import ray_pool
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.settings import Settings, load_settings
from fleetroll.tasks import TaskSpec

#: After a run hits --wall-limit: how long its cancelled rollouts may take to report.
_DRAIN_S = 60.0


@dataclass
class Run:
    system: str
    actors: int
    rollouts: int
    start_s: float
    makespan_s: float
    results: int
    failed: int
    leaked: int
    timed_out: bool

    @property
    def rate(self) -> float:
        return self.results / self.makespan_s if self.makespan_s > 0 else 0.0


def settings_for(args: argparse.Namespace, actors: int) -> Settings:
    """Per-pool limits that add up to the same totals for every run."""
    return load_settings(
        pool={"concurrency": math.ceil(args.concurrency / actors), "max_steps": args.steps + 5},
        provisioning={
            "max_concurrent_creates": args.concurrency,
            "creates_per_second": 100_000.0,
        },
    )


async def one_run(
    args: argparse.Namespace, tasks: list[TaskSpec], samples: int, actors: int
) -> Run:
    """The batch on a fresh emulator; ``actors`` 0 means RolloutPool in this process."""
    profile = FaultProfile(
        create_latency=Latency(min_s=args.create_s), tool_latency=Latency(min_s=args.tool_s)
    )
    settings = settings_for(args, max(actors, 1))
    policy = ScriptedPolicy(think_time_s=args.think_s)
    async with EmulatorProcess(profile) as emu:
        began = time.monotonic()
        opened: AbstractAsyncContextManager[RolloutPool]
        if actors == 0:
            opened = RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url)
        else:
            opened = ray_pool(
                settings, api_key=emu.api_key, base_url=emu.base_url, num_actors=actors
            )
        async with opened as pool:
            started = time.monotonic()
            batch = pool.run_batch(tasks, policy, samples_per_task=samples)
            results = []
            with anyio.move_on_after(args.wall_limit) as limit:
                async for result in batch:
                    results.append(result)
            if limit.cancelled_caught:
                await batch.aclose()
                with anyio.move_on_after(_DRAIN_S):
                    async for result in batch:
                        results.append(result)
            makespan = time.monotonic() - started
        ledger = await emu.ledger()
    return Run(
        system="single process" if actors == 0 else "Ray",
        actors=actors,
        rollouts=len(tasks) * samples,
        start_s=started - began,
        makespan_s=makespan,
        results=len(results),
        failed=sum(1 for r in results if r.status == "failed"),
        leaked=int(ledger["running"]),
        timed_out=limit.cancelled_caught,
    )


async def bench(args: argparse.Namespace) -> list[Run]:
    tasks, samples = bench_tasks(args.rollouts, args.steps)
    runs = [await one_run(args, tasks, samples, 0)]
    if args.actors:
        import ray

        # A local Ray on this machine only (tests and benchmarks run it without auth).
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
        try:
            for actors in args.actors:
                runs.append(await one_run(args, tasks, samples, actors))
        finally:
            ray.shutdown()
    return runs


def table(runs: list[Run]) -> str:
    lines = [
        "| system | rollouts | actors | makespan s | rollouts/s | results returned | failed "
        "| leaked |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        lines.append(
            f"| {run.system} | {run.rollouts} | {run.actors or '—'} | {run.makespan_s:.2f}"
            f"{' (stopped)' if run.timed_out else ''} | {run.rate:.1f} | {run.results} "
            f"| {run.failed} | {run.leaked} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=1000, help="rollouts in the batch")
    parser.add_argument("--steps", type=int, default=5, help="tool calls per rollout")
    parser.add_argument(
        "--concurrency", type=int, default=250, help="active rollouts, all actors together"
    )
    parser.add_argument(
        "--actors",
        type=int,
        nargs="*",
        default=None,
        help="Ray actor counts to run [default: 1 and one per CPU, --ray's default]",
    )
    parser.add_argument("--create-s", type=float, default=0.5, help="emulator create latency")
    parser.add_argument("--tool-s", type=float, default=0.05, help="emulator tool-call latency")
    parser.add_argument("--think-s", type=float, default=0.0, help="policy time per turn")
    parser.add_argument(
        "--wall-limit", type=float, default=600.0, help="each run is stopped after this (s)"
    )
    parser.add_argument("--json", action="store_true", help="print the runs as JSON")
    args = parser.parse_args()
    if args.actors is None:
        args.actors = sorted({1, default_num_actors()})
    if args.rollouts < 1 or args.concurrency < 1 or any(n < 1 for n in args.actors):
        parser.error("--rollouts, --concurrency and --actors must be at least 1")

    runs = anyio.run(bench, args)
    try:
        ray_version = version("ray")
    except PackageNotFoundError:
        ray_version = "not installed"
    machine = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "ray": ray_version,
    }
    if args.json:
        print(
            json.dumps(
                {
                    "machine": machine,
                    "args": vars(args),
                    "runs": [{**asdict(run), "rollouts_per_s": run.rate} for run in runs],
                },
                indent=2,
            )
        )
        return
    print(
        f"machine: {machine['cpus']} CPUs, {machine['platform']}, "
        f"Python {machine['python']}, Ray {machine['ray']}"
    )
    print(
        f"batch: {args.rollouts} rollouts × {args.steps} steps, concurrency {args.concurrency} "
        f"in all, create {args.create_s} s, tool call {args.tool_s} s, think {args.think_s} s"
    )
    print()
    print(table(runs))
    print()
    print(
        "pool start (not in the makespan): "
        + ", ".join(
            f"{r.system}{f' ×{r.actors}' if r.actors else ''} {r.start_s:.1f} s" for r in runs
        )
    )


if __name__ == "__main__":
    main()

"""CPU in the garbage collector, process CPU and peak RSS of one scale-like batch, per GC setting.

    python benchmarks/gc_policy.py N C python
    python benchmarks/gc_policy.py N C T0,T1,T2 [freeze] [tele]

Runs N rollouts of the ``scale`` scenario (2 steps, think 0.5 s, create 0.5 s)
at concurrency C through ``run_fleetroll`` (what ``fleetroll bench`` runs), the
emulator in its own process, under Python's collector (``python``) or the
thresholds given (``freeze``: ``gc.freeze()`` first; ``tele``: with the
telemetry ``fleetroll run`` sets up). The collector's CPU is summed from
``gc.callbacks`` (process time), full collections counted. Nothing asserts.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from dataclasses import replace
from typing import Any

import anyio

from fleetroll.bench.measure import LoopLag, peak_rss_mb, reset_peak_rss
from fleetroll.bench.scenarios import SCENARIOS, bench_tasks, fleetroll_settings
from fleetroll.bench.systems import RunContext, run_fleetroll
from fleetroll.emulator.process import EmulatorProcess

_gc_cpu = [0.0, 0.0]  # seconds in the collector, start of the current collection
_full = [0]


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _gc_cpu[1] = time.process_time()
        return
    _gc_cpu[0] += time.process_time() - _gc_cpu[1]
    if info["generation"] == 2:
        _full[0] += 1


async def measure(n: int, c: int, mode: str, freeze: bool, tele: bool) -> None:
    scenario = replace(SCENARIOS["scale"], rollouts=n, concurrency=(c,), telemetry=tele)
    settings = fleetroll_settings(scenario, c, None)
    tasks, samples = bench_tasks(n, scenario.steps, scenario.samples_per_task)
    async with EmulatorProcess(scenario.profile) as emu:
        ctx = RunContext(scenario, c, tasks, samples, settings, emu.base_url, emu.api_key)
        gc.collect()
        if mode != "python":
            if freeze:
                gc.freeze()
            t0, t1, t2 = (int(t) for t in mode.split(","))
            gc.set_threshold(t0, t1, t2)
        reset_peak_rss()
        gc.callbacks.append(_on_gc)
        lag = LoopLag()
        cpu, began = time.process_time(), time.perf_counter()
        async with anyio.create_task_group() as tg:
            await tg.start(lag.run)
            outcome = await run_fleetroll(ctx)
            tg.cancel_scope.cancel()
        cpu = time.process_time() - cpu
        gc.callbacks.remove(_on_gc)
    scored = sum(1 for s in outcome.samples if s.reward is not None)
    print(
        f"{mode:12} freeze={freeze} telemetry={tele} N={n} C={c}: CPU {1000 * cpu / n:.1f} ms"
        f" per rollout, in the collector {1000 * _gc_cpu[0] / n:.2f} ms ({_full[0]} full),"
        f" peak RSS {peak_rss_mb():.1f} MiB, loop lag p99 {lag.p99_ms() or 0:.0f} ms,"
        f" {time.perf_counter() - began:.0f} s, load {os.getloadavg()[0]:.1f}, {scored} scored"
    )


def main() -> None:
    n, c, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    anyio.run(measure, n, c, mode, "freeze" in sys.argv[4:], "tele" in sys.argv[4:])


if __name__ == "__main__":
    main()

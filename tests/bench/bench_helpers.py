"""What the bench's report tests share: a run record made by hand."""

from __future__ import annotations

from typing import Any

from fleetroll.bench.records import PHASES, Percentiles, RunRecord


def run(system: str, round_: int, cpu_ms: float, **fields: Any) -> RunRecord:
    values: dict[str, Any] = {
        "scenario": "realistic",
        "system": system,
        "concurrency": 1000,
        "requested": 1000,
        "returned": 1000,
        "scored": 1000,
        "failures": {"none": 1000},
        "finished_on_its_own": True,
        "makespan_s": 33.0,
        "ideal_s": 30.0,
        "overhead": 1.1,
        "rollouts_per_s": 30.0,
        "phases": {phase: Percentiles(p50=1.0, p95=2.0, p99=3.0) for phase in PHASES},
        "loop_lag_p99_ms": 20.0,
        "loop_lag_max_ms": 100.0,
        "peak_rss_mb": 160.0,
        "peak_rss_of_run": True,
        "cpu_s": cpu_ms,
        "cpu_ms_per_rollout": cpu_ms,
        "cpu_utilisation": 0.2,
        "emulator_cpu_s": None,
        "emulator_cpu_utilisation": None,
        "leaked": 0,
        "past_deadline": 0,
        "deadline_budget_s": 100.0,
        "load_average_before": None,
        "other_cpu_utilisation": 0.0,
        "provisional": False,
        "ledger": {},
        "round": round_,
    }
    values.update(fields)
    return RunRecord(**values)

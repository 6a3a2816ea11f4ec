"""What telemetry costs: store throughput, cost per event, overhead per rollout.

    python benchmarks/telemetry_cost.py [--records 50000] [--events 20000] [--samples 4]

1. **Store throughput**: finished Logfire log records handed straight to the
   store's processor (``on_end``) as fast as one thread can, timed until the
   final ``force_flush`` returns: rows converted, inserted and committed per
   second by the writer thread (default batching: 512 records or 0.2 s).
2. **Cost per event**, on the emitting thread (the event loop, in a run):
   ``Events.emit`` of a ``fleet_rollout_completed``-sized event through
   redaction, ``logfire.log`` and the store's queue, the console sink filtering
   it out at the default level. Also: redaction alone, and Logfire with the
   store turned off.
3. **Per rollout**: a real batch on the in-process emulator (clean profile,
   the ledger tasks × ``--samples``): events per rollout, counted; overhead
   per rollout = events per rollout × cost per event. The same batch is also
   run with telemetry off (no sink), and the process's CPU time per rollout
   compared (the store's writer thread and final flush included).

Times are medians of ``--repeat`` runs. Nothing here asserts: it measures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import logfire
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from fleetroll.emulator import Emulator
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.settings import Settings, config_dir, load_settings
from fleetroll.tasks import load_tasks
from fleetroll.telemetry import Events, MemorySink, Redactor, Telemetry
from fleetroll.telemetry.store import SQLiteSpanProcessor

COMPLETED: dict[str, Any] = {
    "batch_id": "a1b2c3d4e5f6",
    "rollout_id": "0f" * 16,
    "task_key": "ledger-transfer-007",
    "sample_index": 3,
    "env_key": "ledger",
    "env_version": "v1",
    "modality": "tool_use",
    "instance_id": "inst-" + "9" * 16,
    "status": "completed",
    "failure_reason": None,
    "reward": 1.0,
    "step_count": 4,
    "duration_s": 2.3817,
    "tool_errors": 0,
    "error_message": None,
}


class _Collect(SpanProcessor):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)


def settings_for(db: Path | str) -> Settings:
    return load_settings(telemetry={"db_path": str(db), "send_to_logfire": False})


def store_throughput(tmp: Path, records: int) -> float:
    """Records per second the store's writer converts and commits."""
    # Real Logfire log records, made once, replayed into a fresh store.
    collect = _Collect()
    lf = logfire.configure(
        local=True,
        send_to_logfire=False,
        console=False,
        service_name="fleetroll",
        service_version="bench",
        additional_span_processors=[collect],
        metrics=False,
        scrubbing=False,
    )
    for i in range(min(records, 5000)):
        lf.log("info", "fleet_rollout_completed", attributes={**COMPLETED, "sample_index": i})
    lf.shutdown()
    spans = (collect.spans * (records // len(collect.spans) + 1))[:records]
    store = SQLiteSpanProcessor(tmp / "throughput.db", max_queued=records + 10)
    began = time.perf_counter()
    for span in spans:
        store.on_end(span)
    assert store.force_flush(600_000)
    elapsed = time.perf_counter() - began
    store.shutdown()
    assert store.written == records and store.dropped == 0, (store.written, store.dropped)
    return records / elapsed


def per_call_us(func: Any, n: int) -> float:
    for _ in range(min(500, n)):
        func()
    began = time.perf_counter()
    for _ in range(n):
        func()
    return (time.perf_counter() - began) / n * 1e6


def event_costs(tmp: Path, events: int) -> dict[str, float]:
    redactor = Redactor(["fleet-key-0123456789", "lf-token-0123456789", "sk-oai-0123456789"])
    bare = Events([], redactor)
    out = {
        "redaction only (Events, no sink)": per_call_us(
            lambda: bare.emit("fleet_rollout_completed", **COMPLETED), events
        )
    }
    with Telemetry(settings_for(os.devnull)) as telemetry:
        emit = telemetry.events.emit
        out["logfire, no store"] = per_call_us(
            lambda: emit("fleet_rollout_completed", **COMPLETED), events
        )
    db = tmp / "events.db"
    with Telemetry(settings_for(db)) as telemetry:
        emit = telemetry.events.emit
        out["logfire + store (a run's default)"] = per_call_us(
            lambda: emit("fleet_rollout_completed", **COMPLETED), events
        )
        assert telemetry.flush(600)
    return out


async def batch_cost(
    tmp: Path, samples: int, telemetry_on: bool
) -> tuple[float, Counter[str], float]:
    """Events per rollout, and the process's CPU ms per rollout, for one batch."""
    settings = load_settings(
        telemetry={"db_path": str(tmp / "batch.db"), "send_to_logfire": False},
        provisioning={"creates_per_second": 1000},
    )
    tasks = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=settings.modalities)
    memory = MemorySink()
    with contextlib.ExitStack() as stack:
        if telemetry_on:
            telemetry = stack.enter_context(Telemetry(settings, extra_sinks=[memory]))
            events = telemetry.events
        else:
            events = Events([memory])
        async with (
            Emulator() as emu,
            RolloutPool(
                settings, api_key=emu.api_key, base_url=emu.base_url, events=events
            ) as pool,
        ):
            began = time.process_time()
            results = await pool.run_batch(
                tasks, ScriptedPolicy(), samples_per_task=samples
            ).results()
        if telemetry_on:
            assert telemetry.flush(600)  # the store's share of the work counts too
        cpu = time.process_time() - began
    names = Counter(e.name for e in memory.events)
    return len(memory.events) / len(results), names, cpu / len(results) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=50_000, help="store throughput records")
    parser.add_argument("--events", type=int, default=20_000, help="events per cost measurement")
    parser.add_argument("--samples", type=int, default=4, help="samples per task in the batch")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        rates: list[float] = []
        runs: list[dict[str, float]] = []
        for i in range(args.repeat):
            run_dir = tmp / str(i)
            run_dir.mkdir()
            rates.append(store_throughput(run_dir, args.records))
            runs.append(event_costs(run_dir, args.events))
        throughput = statistics.median(rates)
        costs = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        on: list[tuple[float, Counter[str], float]] = []
        off: list[tuple[float, Counter[str], float]] = []
        for i in range(args.repeat):
            for flag, runs_of in ((True, on), (False, off)):
                batch_dir = tmp / f"batch-{i}-{flag}"
                batch_dir.mkdir()
                runs_of.append(anyio.run(batch_cost, batch_dir, args.samples, flag))
        per_rollout, names = on[0][0], on[0][1]
        cpu_on = statistics.median(r[2] for r in on)
        cpu_off = statistics.median(r[2] for r in off)

    per_event = costs["logfire + store (a run's default)"]
    report: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "sqlite": sqlite3.sqlite_version,
        },
        "store_records_per_s": round(throughput),
        "event_cost_us": {k: round(v, 1) for k, v in costs.items()},
        "events_per_rollout": round(per_rollout, 2),
        "events_by_name": dict(names.most_common()),
        "overhead_per_rollout_ms": round(per_rollout * per_event / 1000, 3),
        "batch_cpu_ms_per_rollout": {
            "telemetry on": round(cpu_on, 2),
            "telemetry off": round(cpu_off, 2),
        },
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    m = report["machine"]
    print(f"machine: {m['cpus']} CPUs, {m['platform']}, Python {m['python']}, SQLite {m['sqlite']}")
    print(f"store: {report['store_records_per_s']:,} records/s (one writer, batches of 512)")
    for name, value in report["event_cost_us"].items():
        print(f"emit, {name}: {value} µs/event")
    print(
        f"events per rollout: {report['events_per_rollout']} "
        f"({', '.join(f'{k} {v}' for k, v in names.most_common())})"
    )
    print(
        f"overhead per rollout: {report['overhead_per_rollout_ms']} ms "
        "(events per rollout × cost per event)"
    )
    print(
        f"batch CPU per rollout (process, in-process emulator included): "
        f"{cpu_on:.2f} ms with telemetry, {cpu_off:.2f} ms without "
        f"(difference {cpu_on - cpu_off:+.2f} ms)"
    )


if __name__ == "__main__":
    main()

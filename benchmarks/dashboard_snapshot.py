"""How long one dashboard snapshot takes on a big telemetry store.

    python benchmarks/dashboard_snapshot.py [--records 500000] [--repeat 5] [--db PATH]

Fills a store (unless ``--db`` names one that exists) with the records a
long training run leaves: batches of rollouts, each rollout's
``fleet_rollout_started``, ``fleet_provisioning_completed``,
``fleet_env_created``, ``fleet_instance_released`` and
``fleet_rollout_completed`` (a fifth of them with tool errors or retries,
a tenth failed), the batches' start and end, until ``--records`` rows. The
rows are inserted directly (the store's own schema and JSON attributes), as
the store's writer would have left them, so a 500k-record store takes
seconds to make, not a run of hours.

Then it times :func:`fleetroll.telemetry.dashboard.snapshot` as the
dashboard route calls it: the whole store (no ``since``, no batch: the
page's default), then the newest batch, then the last 15 minutes, each
``--repeat`` times (median and max, in seconds). With ``--plan`` it prints
SQLite's query plan of each query a snapshot runs, to see which scan the
table. Nothing here asserts: it measures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fleetroll.telemetry import queries
from fleetroll.telemetry.dashboard import parse_since, snapshot
from fleetroll.telemetry.store import COLUMNS, connect

_ENVS = ("ledger", "browser", "sheets", "mail")


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _rows(records: int, *, end: float, pid: int) -> Iterator[tuple[Any, ...]]:
    """Rows of finished batches of 500 rollouts, the newest ending at ``end``."""
    rng = random.Random(27)
    per_batch = 500
    per_rollout = 5.3  # the events below, on average
    batches = max(1, round(records / (per_batch * per_rollout + 2)))
    t = end - batches * 600.0
    written = 0
    instance = str(uuid.UUID(int=rng.getrandbits(128)))
    resource = json.dumps({"service.name": "fleetroll", "process.pid": pid, "host.name": "bench"})
    for b in range(batches):
        batch_id = f"{b:012x}"
        batch_at = t

        def row(message: str, at: float, level: str = "info", **attributes: Any) -> tuple[Any, ...]:
            nonlocal written
            written += 1
            stamp = _iso(at)
            values = dict.fromkeys(COLUMNS)
            values.update(
                start_timestamp=stamp,
                end_timestamp=stamp,
                trace_id=f"{written:032x}",
                span_id=f"{written:016x}",
                kind="log",
                level=level,
                span_name=message,
                message=message,
                attributes=json.dumps(attributes, separators=(",", ":")),
                tags="[]",
                otel_status_code="UNSET",
                is_exception=0,
                service_name="fleetroll",
                service_instance_id=instance,
                process_pid=pid,
                otel_resource_attributes=resource,
                created_at=stamp,
            )
            return tuple(values.values())

        yield row(
            "fleet_batch_started",
            batch_at,
            batch_id=batch_id,
            rollouts=per_batch,
            total=per_batch,
            concurrency=100,
        )
        last = batch_at
        for i in range(per_batch):
            env = _ENVS[i % len(_ENVS)]
            base = {
                "batch_id": batch_id,
                "rollout_id": f"{b:06x}{i:026x}",
                "task_key": f"{env}-task-{i // 8:03d}",
                "sample_index": i % 8,
                "env_key": env,
                "env_version": "v1",
                "modality": "tool_use",
            }
            start = batch_at + (i // 100) * 100.0 + rng.random()
            ready = start + rng.uniform(2, 20)
            done = ready + rng.uniform(10, 60)
            iid = f"inst-{b:06x}{i:010x}"
            yield row("fleet_rollout_started", start, **base)
            yield row(
                "fleet_provisioning_completed",
                ready,
                **base,
                instance_id=iid,
                provisioning_time_s=ready - start,
                attempts=1,
            )
            yield row(
                "fleet_env_created",
                ready,
                **base,
                instance_id=iid,
                provisioning_time_s=ready - start,
            )
            if rng.random() < 0.3:
                yield row(
                    "fleet_mcp_tool_error",
                    ready + 1,
                    "warn",
                    **base,
                    instance_id=iid,
                    tool="query",
                    error_message="no such row",
                )
            failed = rng.random() < 0.1
            yield row(
                "fleet_instance_released", done, **base, instance_id=iid, lifetime_s=done - ready
            )
            yield row(
                "fleet_rollout_completed",
                done,
                "warn" if failed else "info",
                **base,
                instance_id=iid,
                status="failed" if failed else "completed",
                failure_reason="tool_failure" if failed else None,
                reward=None if failed else float(rng.random() < 0.6),
                step_count=rng.randint(1, 12),
                duration_s=done - start,
                tool_errors=0,
                tool_failures=int(failed),
                error_message="the tool failed" if failed else None,
                instance_s=done - ready,
                prompt_tokens=rng.randint(500, 5000),
                completion_tokens=rng.randint(50, 800),
                policy_calls=rng.randint(1, 12),
                tool_calls=rng.randint(1, 12),
            )
            last = max(last, done)
        yield row("fleet_batch_completed", last + 1, batch_id=batch_id, results=per_batch)
        t = last + 5
        if written >= records:
            return


def fill(db: Path, records: int) -> int:
    """A store at ``db`` with about ``records`` rows; their count."""
    conn = connect(db)
    insert = f"INSERT INTO records ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
    rows = _rows(records, end=time.time() - 60, pid=2**22 - 3)  # a pid no process has
    while True:
        chunk = [r for _, r in zip(range(20_000), rows, strict=False)]
        if not chunk:
            break
        conn.execute("BEGIN")
        conn.executemany(insert, chunk)
        conn.execute("COMMIT")
    (count,) = conn.execute("SELECT COUNT(*) FROM records").fetchone()
    conn.close()
    return int(count)


def time_snapshot(db: Path, repeat: int, **where: Any) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        snapshot(db, **where)
        times.append(time.perf_counter() - began)
    return statistics.median(times), max(times)


class _Plans:
    """Runs each query a snapshot makes once more under EXPLAIN QUERY PLAN."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.seen: list[tuple[str, list[str]]] = []
        self._query = queries.query

    def __call__(self, db: Any, sql: str, params: Any = (), **kwargs: Any) -> Any:
        conn = sqlite3.connect(self.db)
        plan = [r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + sql, params)]
        conn.close()
        self.seen.append((" ".join(sql.split())[:110], plan))
        return self._query(db, sql, params, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=500_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--db", type=Path, default=None, help="reuse (or create) this store")
    parser.add_argument("--plan", action="store_true", help="print each query's plan")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = args.db or Path(tmp) / "telemetry.db"
        if not db.exists():
            began = time.perf_counter()
            count = fill(db, args.records)
            print(f"filled {db}: {count} records in {time.perf_counter() - began:.1f} s")
        else:
            began = time.perf_counter()
            conn = connect(db)  # also brings an older store's schema up to date
            opened = time.perf_counter() - began
            (count,) = conn.execute("SELECT COUNT(*) FROM records").fetchone()
            conn.close()
            print(f"store {db}: {count} records (opened for writing in {opened:.1f} s)")
        print(
            f"machine: {platform.machine()}, {os.cpu_count()} CPUs, python "
            f"{platform.python_version()}, sqlite {sqlite3.sqlite_version}, "
            f"load average {os.getloadavg()[0]:.1f}"
        )
        if args.plan:
            from fleetroll.telemetry import dashboard, dashboard_panels

            plans = _Plans(db)
            dashboard.query = plans  # type: ignore[assignment]
            snapshot(db)
            dashboard.query = plans._query  # type: ignore[assignment]
            for sql, plan in plans.seen:
                print(f"\n{sql}\n  " + "\n  ".join(plan))
            del dashboard_panels
        newest = snapshot(db)["batches"][0]["batch_id"]
        for label, where in (
            ("whole store", {}),
            ("newest batch", {"batch": newest}),
            ("last 15 minutes", {"since": parse_since("15m")}),
        ):
            median, worst = time_snapshot(db, args.repeat, **where)
            print(
                f"snapshot, {label}: median {median:.3f} s, max {worst:.3f} s ({args.repeat} runs)"
            )


if __name__ == "__main__":
    main()

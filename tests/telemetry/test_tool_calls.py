"""Every tool call measured: a deliberately slow tool is the first one the
slowest-tools query, the dashboard and ``/metrics``' histogram show.

The emulator over loopback makes ``list_invoices`` slow (``slow_tools``); the
scripted policy plays the ledger tasks' solutions; telemetry goes to a real
store, and the service's :class:`~fleetroll.service.metrics.Metrics` is a sink
of the same events, as ``fleetroll serve`` wires it.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from telemetry_helpers import local_settings

from fleetroll.emulator import Emulator
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import RolloutResult
from fleetroll.service.metrics import Metrics
from fleetroll.settings import config_dir
from fleetroll.settings.fault_profiles import FaultProfile
from fleetroll.tasks import load_tasks
from fleetroll.telemetry import open_telemetry, queries
from fleetroll.telemetry.dashboard import read_snapshot
from fleetroll.telemetry.events import Events, MemorySink

pytestmark = pytest.mark.slow

SLOW = "list_invoices"


async def run_ledger(db: Path, metrics: Metrics, *, tool_calls: bool) -> list[RolloutResult]:
    settings = local_settings(db, telemetry={"tool_calls": tool_calls})
    ledger = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=settings.modalities)
    # Tasks whose solutions call the slow tool and fast ones.
    tasks = [t for t in ledger if t.key in {"ledger-004", "ledger-006", "ledger-010"}]
    profile = FaultProfile(slow_tools={SLOW: 0.4})
    async with (
        open_telemetry(settings.telemetry, extra_sinks=[metrics]) as events,
        Emulator(profile) as emu,
        RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url, events=events) as pool,
    ):
        with anyio.fail_after(120):
            return await pool.run_batch(tasks, ScriptedPolicy(), batch_id="slow").results()


def histogram(text: str, tool: str) -> tuple[float, int]:
    """``fleetroll_tool_call_seconds``' sum and count for ``tool`` (every environment)."""
    total, count = 0.0, 0
    for line in text.splitlines():
        if f'tool="{tool}"' not in line:
            continue
        name, value = line.rsplit(" ", 1)
        if name.startswith("fleetroll_tool_call_seconds_sum"):
            total += float(value)
        elif name.startswith("fleetroll_tool_call_seconds_count"):
            count += int(value)
    return total, count


async def test_a_slow_tool_comes_first_in_the_slowest_tools_and_in_the_metrics(
    tmp_path: Path,
) -> None:
    db = tmp_path / "telemetry.db"
    metrics = Metrics()
    results = await run_ledger(db, metrics, tool_calls=True)
    assert all(r.status == "completed" for r in results), [r.error for r in results]
    calls = sum(r.cost.tool_calls for r in results)

    rows = queries.slowest_tools(db)
    assert rows[0]["tool"] == SLOW and rows[0]["env_key"] == "ledger"
    assert rows[0]["mean_s"] >= 0.4 > rows[1]["mean_s"]
    assert sum(row["calls"] for row in rows) == calls  # one record per call
    assert all(row["not_ok"] == 0 for row in rows)
    assert queries.slowest_tools(db, "slow") == rows

    panel = read_snapshot(db).slowest_tools
    assert [(t.tool, t.calls) for t in panel] == [(r["tool"], r["calls"]) for r in rows]

    for r in results:
        metrics.observe(r)
    text = metrics.render(in_flight=0, sessions_open=0, batches={})
    means = {}
    for row in rows:
        seconds, n = histogram(text, row["tool"])
        assert n == row["calls"]
        means[row["tool"]] = seconds / n
    assert max(means, key=lambda tool: means[tool]) == SLOW
    # The slow tool's calls all fall past the 0.25 s bucket.
    slow_fast_bucket = next(
        line
        for line in text.splitlines()
        if line.startswith("fleetroll_tool_call_seconds_bucket")
        and f'tool="{SLOW}"' in line
        and 'le="0.25"' in line
    )
    assert slow_fast_bucket.endswith(" 0")
    # Per environment: rollouts, create latency and instance-seconds.
    n = len(results)
    assert f'fleetroll_rollouts_total{{status="completed",reason="",environment="ledger"}} {n}' in (
        text
    )
    assert f'fleetroll_create_seconds_count{{environment="ledger"}} {n}' in text
    held = sum(r.cost.instance_s for r in results)
    line = next(x for x in text.splitlines() if x.startswith("fleetroll_instance_seconds_total"))
    assert float(line.rsplit(" ", 1)[1]) == pytest.approx(held, abs=1e-3)


async def test_tool_call_records_can_be_turned_off(tmp_path: Path) -> None:
    db = tmp_path / "telemetry.db"
    metrics = Metrics()
    results = await run_ledger(db, metrics, tool_calls=False)
    assert all(r.status == "completed" for r in results)
    assert queries.slowest_tools(db) == []
    assert "fleetroll_tool_call_seconds_count" not in metrics.render(
        in_flight=0, sessions_open=0, batches={}
    )


def test_metrics_labels_are_bounded_first_come_then_other() -> None:
    metrics = Metrics(label_values=2)
    sink = MemorySink()
    events = Events([sink, metrics])
    for env in ("a", "b", "c", "d"):
        with Events.bind(env_key=env):
            events.emit("fleet_tool_call", tool_name="t", duration_s=0.01, outcome="ok")
    text = metrics.render(in_flight=0, sessions_open=0, batches={})
    counts = [x for x in text.splitlines() if x.startswith("fleetroll_tool_call_seconds_count")]
    assert counts == [
        'fleetroll_tool_call_seconds_count{environment="a",tool="t"} 1',
        'fleetroll_tool_call_seconds_count{environment="b",tool="t"} 1',
        'fleetroll_tool_call_seconds_count{environment="other",tool="t"} 2',
    ]
    assert len(sink.named("fleet_tool_call")) == 4

"""Every tool call measured: a deliberately slow tool is the first one the
slowest-tools query, the dashboard and ``/metrics``' histogram show.

The emulator over loopback makes ``list_invoices`` slow (``slow_tools``); the
scripted policy plays the ledger tasks' solutions (or the example agent
command does, its tool calls through the rollout's MCP relay); telemetry goes
to a real store, and the service's :class:`~fleetroll.service.metrics.Metrics`
is a sink of the same events, as ``fleetroll serve`` wires it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import pytest
from telemetry_helpers import local_settings

from fleetroll.emulator import Emulator
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.assembly import chat_policy_config
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import RolloutResult
from fleetroll.rollout.agent_command import CommandAgent
from fleetroll.service.metrics import Metrics
from fleetroll.settings.fault_profiles import FaultProfile
from fleetroll.telemetry import open_telemetry, queries
from fleetroll.telemetry.dashboard import read_snapshot
from fleetroll.telemetry.events import Events, MemorySink
from fleetroll.testing.fake_openai import FakeChatServer, VllmShape
from training_helpers import AGENT, solving
from training_helpers import TASKS as SHIPPED

pytestmark = pytest.mark.slow

SLOW = "list_invoices"
# Tasks whose solutions call the slow tool and fast ones.
TASKS = [SHIPPED[key] for key in ("ledger-004", "ledger-006", "ledger-010")]
PROFILE = FaultProfile(slow_tools={SLOW: 0.4})


async def run_ledger(db: Path, metrics: Metrics, *, tool_calls: bool) -> list[RolloutResult]:
    settings = local_settings(db, telemetry={"tool_calls": tool_calls})
    async with (
        open_telemetry(settings.telemetry, extra_sinks=[metrics]) as events,
        Emulator(PROFILE) as emu,
        RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url, events=events) as pool,
    ):
        with anyio.fail_after(120):
            return await pool.run_batch(TASKS, ScriptedPolicy(), batch_id="slow").results()


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


async def test_an_agent_command_s_tool_calls_through_the_relay_are_each_one_record(
    tmp_path: Path,
) -> None:
    db = tmp_path / "telemetry.db"
    async with FakeChatServer(solving(TASKS), vllm=VllmShape()) as server:
        policy = {"kind": "openai", "base_url": server.base_url, "model": "served"}
        settings = local_settings(db, policy=policy, pool={"concurrency": 3})
        argv = [sys.executable, str(AGENT)]
        async with (
            open_telemetry(settings.telemetry) as events,
            Emulator(PROFILE) as emu,
            RolloutPool(
                settings, api_key=emu.api_key, base_url=emu.base_url, events=events
            ) as pool,
            CommandAgent.from_config(argv, chat_policy_config(settings)) as agent,
        ):
            with anyio.fail_after(180):
                results = await pool.run_batch(TASKS, agent, batch_id="agent").results()
    assert sorted((r.task_key, r.status, r.reward) for r in results) == sorted(
        (t.key, "completed", 1.0) for t in TASKS
    ), [r.error for r in results]

    # One record per tool call the agent made, each with the rollout's attributes,
    # its duration and its outcome.
    records = queries.query(
        db,
        "SELECT attributes->>'rollout_id' AS rollout_id, attributes->>'tool_name' AS tool,"
        " attributes->>'env_key' AS env_key, attributes->>'modality' AS modality,"
        " attributes->>'duration_s' AS duration_s, attributes->>'outcome' AS outcome"
        " FROM records WHERE message = 'fleet_tool_call'",
    ).dicts()
    for r in results:
        mine = [x for x in records if x["rollout_id"] == r.rollout_id]
        solution = next(t.solution for t in TASKS if t.key == r.task_key)
        assert sorted(x["tool"] for x in mine) == sorted(s.name for s in solution or ())
        assert len(mine) == r.cost.tool_calls
    assert {(x["env_key"], x["modality"], x["outcome"]) for x in records} == {
        ("ledger", "tool_use", "ok")
    }
    assert all(x["duration_s"] > 0 for x in records)
    assert min(x["duration_s"] for x in records if x["tool"] == SLOW) >= 0.4

    rows = queries.slowest_tools(db, "agent")
    assert rows[0]["tool"] == SLOW and rows[0]["mean_s"] >= 0.4 > rows[1]["mean_s"]
    assert sum(row["calls"] for row in rows) == len(records)
    assert all(row["not_ok"] == 0 for row in rows)


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

"""What `fleetroll run` tells after a kill -9 or a Ctrl-C: real processes, a real store."""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import pytest
from test_cli import SOME, clean_env, ledger_part, run_args, slow_config, started

from fleetroll.pool.journal import read_journal
from fleetroll.results import FailureReason
from fleetroll.telemetry import queries
from fleetroll.telemetry.dashboard import snapshot

pytestmark = pytest.mark.slow


async def test_after_a_kill_9_and_a_resume_the_dashboard_counts_agree_with_stats_check(
    tmp_path: Path,
) -> None:
    out, db, samples = tmp_path / "results.jsonl", tmp_path / "telemetry.db", 4
    tasks = ledger_part(tmp_path, SOME)
    env = clean_env() | {"FLEETROLL_TELEMETRY__DB_PATH": str(db)}
    args = run_args(tasks, out, "--config", str(slow_config(tmp_path)), samples=samples)
    async with started(tmp_path, args, env) as (child, log):
        with anyio.fail_after(120):
            await log.wait_for(lambda: log.journaled >= 5)
        child.kill()
        with anyio.fail_after(30):
            await child.wait()
    killed = queries.check(db)
    assert killed.lost, "no rollout was in flight at the kill"

    with anyio.fail_after(300):
        done = await anyio.run_process(
            run_args(tasks, out, "--resume", samples=samples), cwd=tmp_path, env=env, check=False
        )
    assert done.returncode == 0, done.stderr.decode()

    check = queries.check(db)
    view = snapshot(db)
    assert check.ok and check.rerun >= len(killed.lost) - len(check.lost), check.describe()
    # The rollouts the kill left running were re-run to completion: neither in flight
    # nor lost. Lost stay only those whose result reached the journal and not the store.
    totals, unfinished = view["totals"], view["unfinished"]
    assert (totals["in_flight"], totals["lost"], totals["rerun"]) == (
        0,
        len(check.lost),
        check.rerun,
    )
    assert sorted(r["rollout_id"] for r in unfinished["rows"]) == [r for r, _ in check.lost]
    assert {r["state"] for r in unfinished["rows"]} <= {"lost"}
    assert view["timeline"]["buckets"][-1]["in_flight"] == 0
    progress = view["progress"]
    assert progress["state"] == "finished"
    assert progress["total"] == samples * SOME == check.rollouts
    assert progress["remaining"] == 0 and progress["lost"] == len(check.lost)


async def test_a_ctrl_c_is_reported_as_a_cancellation_not_as_every_rollout_failing(
    tmp_path: Path,
) -> None:
    out = tmp_path / "results.jsonl"
    slow = tmp_path / "slow.toml"
    # Rollouts slow enough that none has finished when the signal comes.
    slow.write_text("[policy]\nthink_time_s = 5\n[pool]\nconcurrency = 4\n")
    args = run_args(ledger_part(tmp_path, SOME), out, "--config", str(slow), samples=2)
    async with started(tmp_path, args) as (child, log):
        with anyio.fail_after(120):
            await log.wait_for(lambda: " rollouts (" in log.read_text())
        child.send_signal(signal.SIGINT)
        with anyio.fail_after(60):
            await child.wait()
    stderr = log.read_text()
    assert child.returncode == 130, stderr
    results = read_journal(out)
    assert results and all(r.failure_reason is FailureReason.CANCELLED for r in results)
    assert "every rollout failed" not in stderr
    assert f"{len(results)} cancelled" in stderr and "--resume runs them" in stderr

"""`fleetroll run` cancelled by Ctrl-C while its creates are in flight: the creates
end, and what they made is released before the process exits (a real process,
on an in-process emulator that, as Fleet, goes on with a create whose client left)."""

from __future__ import annotations

import signal
import sqlite3
from pathlib import Path

import anyio
import pytest
from test_cli import clean_env, ledger_part, run_args, started

from fleetroll.emulator import Emulator
from fleetroll.pool.journal import read_journal
from fleetroll.results import FailureReason
from fleetroll.settings.fault_profiles import FaultProfile, Latency
from ledger_watch import Changes, creates_sent

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

TASKS, SAMPLES = 4, 2
ROLLOUTS = TASKS * SAMPLES
#: Long enough that the Ctrl-C lands while every create is at work.
SLOW_CREATES = FaultProfile(
    create_latency=Latency(min_s=3.0, max_s=4.0), creates_outlive_clients=True
)
CONFIG = f"""\
[pool]
concurrency = {ROLLOUTS}
[provisioning]
adaptive_creates = false
max_concurrent_creates = {ROLLOUTS}
"""


def abandoned(db: Path) -> list[tuple[str | None, str | None, str | None]]:
    """``fleet_create_abandoned`` events in the store: (instance_id, outcome, batch_id)."""
    with sqlite3.connect(db) as conn:
        return conn.execute(
            "SELECT attributes ->> 'instance_id', attributes ->> 'outcome', "
            "attributes ->> 'batch_id' FROM records WHERE span_name = 'fleet_create_abandoned'"
        ).fetchall()


async def test_a_ctrl_c_mid_provisioning_leaves_no_instance_running(tmp_path: Path) -> None:
    out, db, config = tmp_path / "results.jsonl", tmp_path / "telemetry.db", tmp_path / "c.toml"
    config.write_text(CONFIG)
    args = run_args(ledger_part(tmp_path, TASKS), out, "--config", str(config), samples=SAMPLES)
    async with Emulator(SLOW_CREATES) as emu:
        changes = Changes(emu.ledger)
        env = clean_env() | {
            "FLEET_BASE_URL": emu.base_url,
            "FLEET_API_KEY": emu.api_key,
            "FLEETROLL_TELEMETRY__DB_PATH": str(db),
        }
        async with started(tmp_path, args, env) as (child, log):

            async def all_sent() -> bool:
                return creates_sent(emu.ledger) == ROLLOUTS

            with anyio.fail_after(120):
                await changes.until(all_sent)
            child.send_signal(signal.SIGINT)

            async def released() -> bool:
                ledger = emu.ledger.snapshot()
                return ledger["creates_in_flight"] == 0 and ledger["running"] == 0

            with anyio.move_on_after(10):  # from the Ctrl-C
                await changes.until(released)
            ledger = emu.ledger.snapshot()
            with anyio.fail_after(60):
                await child.wait()
    stderr = log.read_text()
    assert child.returncode == 130, stderr
    assert (ledger["creates_in_flight"], ledger["running"]) == (0, 0), ledger
    # Every create went on at Fleet and made its instance; each was released.
    assert ledger["created"] == ledger["deleted"] == ROLLOUTS, ledger
    results = read_journal(out)
    assert [r.failure_reason for r in results] == [FailureReason.CANCELLED] * ROLLOUTS
    # The last progress line counts them as cancelled: none failed.
    last = [line for line in stderr.splitlines() if f"/{ROLLOUTS} done" in line][-1]
    assert f"{ROLLOUTS}/{ROLLOUTS} done" in last and "0 failed" in last, last
    assert f"{ROLLOUTS} cancelled" in last, last
    events = abandoned(db)
    assert {outcome for _, outcome, _ in events} == {"released"}
    assert len({instance for instance, _, _ in events}) == ROLLOUTS
    assert {batch for _, _, batch in events} == {results[0].batch_id}

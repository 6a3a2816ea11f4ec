"""``fleetroll serve --state-dir DIR``: everything serve writes goes under DIR.

Real processes: the service with its embedded emulator, started with
``--state-dir`` on a folder that does not exist yet (and with the settings'
own ``telemetry.db_path`` and ``service.state_dir`` pointing elsewhere, which
the flag overrides); a batch through ``FleetrollClient``; then ``fleetroll
stats`` and ``fleetroll query`` read the store it left there.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import anyio
import pytest
from service_helpers import TOKEN, free_port, serve_env, serving

from fleetroll.client import FleetrollClient
from fleetroll.pool.journal import read_journal
from fleetroll.service.models import PolicyConfig
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import load_tasks

pytestmark = pytest.mark.slow

LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=load_settings().modalities)
TASKS = LEDGER[:3]
BATCH = "in-state-dir"
POLICY = PolicyConfig(kind="scripted")


async def fleetroll(tmp_path: Path, *args: str) -> str:
    """A ``fleetroll`` command's stdout (it must succeed)."""
    command = [sys.executable, "-m", "fleetroll", *args]
    with anyio.fail_after(60):
        done = await anyio.run_process(
            command, cwd=tmp_path, env=serve_env(tmp_path / "state"), check=False
        )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


async def test_serve_keeps_its_store_and_journals_in_the_state_dir_where_stats_reads_them(
    tmp_path: Path,
) -> None:
    root = tmp_path / "made" / "by-serve"
    db = root / "telemetry.db"
    port = free_port()
    async with (
        FleetrollClient(f"http://127.0.0.1:{port}", token=TOKEN) as client,
        serving(tmp_path, port, "--state-dir", str(root)) as (process, said),
    ):
        with anyio.fail_after(120):
            results = [r async for r in client.run_batch(TASKS, POLICY, batch_id=BATCH)]
        process.send_signal(signal.SIGTERM)  # its store flushes as it stops
        with anyio.fail_after(60):
            assert await process.wait() == 0
    assert sorted(r.status for r in results) == ["completed"] * len(TASKS)
    assert f"  telemetry store: {db}" in said, said
    assert any(f"batches kept in {root / 'service'}" in line for line in said), said

    # Everything under the state dir; nothing where the settings pointed, nor in .fleetroll/.
    assert db.is_file()
    journal = root / "service" / "batches" / f"{BATCH}.jsonl"
    assert {r.rollout_id for r in read_journal(journal)} == {r.rollout_id for r in results}
    assert not (tmp_path / "state").exists() and not (tmp_path / ".fleetroll").exists()

    rows = json.loads(await fleetroll(tmp_path, "stats", "--db", str(db), "--json"))
    assert [(row["env_key"], row["completed"]) for row in rows] == [("ledger", len(TASKS))]
    sql = (
        "SELECT attributes->>'rollout_id' AS rollout_id FROM records"
        " WHERE message = 'fleet_rollout_completed'"
    )
    found = json.loads(await fleetroll(tmp_path, "query", sql, "--db", str(db), "--json"))
    assert {row["rollout_id"] for row in found} == {r.rollout_id for r in results}


@pytest.mark.parametrize("kind", ["a file", "under a file"])
async def test_a_state_dir_serve_cannot_write_in_is_one_line_and_exit_code_2(
    tmp_path: Path, kind: str
) -> None:
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    root = taken if kind == "a file" else taken / "state"
    command = [sys.executable, "-m", "fleetroll", "serve", "--port", "0", "--state-dir", str(root)]
    with anyio.fail_after(60):
        done = await anyio.run_process(
            command, cwd=tmp_path, env=serve_env(tmp_path / "state"), check=False
        )
    said = done.stderr.decode()
    assert done.returncode == 2, said
    assert said.strip().splitlines() == [
        f"Error: --state-dir {root}: not a folder serve can write in"
        f" ({'File exists' if kind == 'a file' else 'Not a directory'})"
    ]
    assert not (tmp_path / "state").exists()

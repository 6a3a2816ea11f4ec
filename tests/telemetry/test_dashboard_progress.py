"""A batch's progress counts against the whole batch, across a shard and its resumed rest."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from telemetry_helpers import local_settings

from fleetroll.emulator import Emulator
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.batch import rollout_id
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import load_tasks
from fleetroll.telemetry import Telemetry
from fleetroll.telemetry.dashboard import snapshot
from fleetroll.telemetry.queries import query

TASKS = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=load_settings().modalities)[
    :2
]


@pytest.mark.slow
async def test_a_resumed_batch_s_progress_counts_against_its_whole_total(tmp_path: Path) -> None:
    db = tmp_path / "telemetry.db"
    settings = local_settings(db)
    first = {rollout_id("resumed", TASKS[0].key, i) for i in range(2)}
    with Telemetry(
        settings.telemetry, secrets=settings.secrets(), logfire_token=settings.logfire_token
    ) as telemetry:
        async with (
            Emulator() as emu,
            RolloutPool(
                settings, api_key=emu.api_key, base_url=emu.base_url, events=telemetry.events
            ) as pool,
        ):
            with anyio.fail_after(60):
                # A run that got through the first task's two samples, then its resume.
                for kwargs in ({"only": first}, {"skip": first}):
                    batch = pool.run_batch(
                        TASKS, ScriptedPolicy(), samples_per_task=2, batch_id="resumed", **kwargs
                    )
                    assert len(await batch.results()) == 2
    starts = query(
        db,
        "SELECT attributes->>'rollouts', attributes->>'total' FROM records"
        " WHERE message = 'fleet_batch_started' ORDER BY start_timestamp",
    ).rows
    assert starts == [(2, 4), (2, 4)]
    progress = snapshot(db)["progress"]
    assert (progress["batch_id"], progress["done"], progress["total"]) == ("resumed", 4, 4)
    assert progress["state"] == "finished" and progress["remaining"] == 0

"""The trainers' core on Ray actors (``ray_address``), as ``fleetroll run --ray``:
the same rows, and a weight sync's version on the actors' turns."""

from __future__ import annotations

import json
import os
from typing import Any

import anyio
import pytest

from fleetroll.emulator import Emulator
from fleetroll.integrations.core import Rollouts
from fleetroll.settings import config_dir, load_settings
from fleetroll.testing.fake_openai import FakeChatServer, VllmShape, completion

TASKS = config_dir() / "tasks" / "ledger.jsonl"
RECORDS = [json.loads(line) for line in TASKS.read_text(encoding="utf-8").splitlines() if line]

#: Integration tests (Ray, the emulator over loopback): outside `-m "not slow"`.
pytestmark = pytest.mark.slow


class Pushed:
    """A weight sync whose servers (a scripted chat server) have no weights to load."""

    def __init__(self) -> None:
        self.versions: list[int] = []

    async def push(self, source: Any, *, version: int) -> None:
        self.versions.append(version)


async def test_rows_come_from_ray_actors_and_carry_the_synced_version(
    local_ray: None, emulator: Emulator
) -> None:
    a, b = RECORDS[0]["key"], RECORDS[1]["key"]
    sync = Pushed()
    async with FakeChatServer(lambda body: completion("done"), vllm=VllmShape()) as server:
        settings = load_settings(
            policy={"kind": "openai", "base_url": server.base_url, "max_tokens": 8},
            telemetry={"db_path": os.devnull},
            fleet_base_url=emulator.base_url,
            fleet_api_key=emulator.api_key,
        )
        async with Rollouts(RECORDS[:2], settings, ray_address="local", ray_actors=1) as rollouts:
            with anyio.fail_after(120):
                before = await rollouts.run([(a, 0), (a, 1), (b, 0)])
                version = await rollouts.sync_weights(sync, "/weights")
                after = await rollouts.run([(b, 0), (a, 0)])

    assert [(r["task_key"], r["sample_index"]) for r in before] == [(a, 0), (a, 1), (b, 0)]
    assert [(r["task_key"], r["sample_index"]) for r in after] == [(b, 0), (a, 0)]
    assert version == 1 and sync.versions == [1]
    for rows, expected in ((before, 0), (after, 1)):
        for row in rows:
            assert row["status"] == "scored" and 1 in row["completion_mask"]
            versions = {
                v
                for v, m in zip(
                    row["completion_policy_versions"], row["completion_mask"], strict=True
                )
                if m
            }
            assert versions == {expected}
    assert emulator.ledger.running == 0

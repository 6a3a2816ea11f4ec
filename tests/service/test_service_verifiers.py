"""Over HTTP: batches that reuse a task key are scored by their own verifiers."""

from __future__ import annotations

import json

import anyio
import pytest
from service_helpers import LEDGER, Running, task_record

from fleetroll.emulator import Emulator

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow


async def test_http_batches_reusing_a_task_key_are_each_scored_by_their_own_verifier(
    served: Running, emulator: Emulator
) -> None:
    rewards = []
    async with served.http() as http:
        for score in (0.25, 1.0, 0.25):
            code = f"def verify(env, final_answer=None):\n    return {score}\n"
            body = {"tasks": [{**task_record(LEDGER[0]), "verifier_func": code}]}
            with anyio.fail_after(60):
                created = await http.post("/v1/batches", json=body)
                assert created.status_code == 201, created.text
                batch_id = created.json()["batch_id"]
                response = await http.get(f"/v1/batches/{batch_id}/results")
            lines = [json.loads(line) for line in response.text.splitlines()]
            rewards += [line["result"]["reward"] for line in lines if line["type"] == "result"]
    assert rewards == [0.25, 1.0, 0.25]
    assert emulator.ledger.running == 0

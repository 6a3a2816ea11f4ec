"""An evaluation over HTTP: a batch with its share and tag, then GET /v1/batches/{id}/eval."""

from __future__ import annotations

import anyio
import pytest
from service_helpers import LEDGER, Running, task_record

from fleetroll.client import FleetrollClient
from fleetroll.emulator import Emulator
from fleetroll.evaluation import evaluate
from fleetroll.service import app as service_app
from fleetroll.testing.planned_policy import PlannedPolicy

pytestmark = pytest.mark.slow

TASKS = LEDGER[:4]
SOLVED = {TASKS[0].key, TASKS[3].key}


def plan(monkeypatch: pytest.MonkeyPatch, policy: PlannedPolicy) -> None:
    """Every batch of the service plays ``policy``."""
    monkeypatch.setattr(service_app, "build_policy", lambda config, settings: policy)


async def test_run_eval_over_http_reports_exactly_the_tasks_the_policy_solves(
    served: Running, emulator: Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    k = 3
    plans = {t.key: ["solve" if t.key in SOLVED else "zero"] * k for t in TASKS}
    plan(monkeypatch, PlannedPolicy(plans))
    async with FleetrollClient(served.url) as client:
        with anyio.fail_after(120):
            report = await client.run_eval(
                TASKS, k=k, max_concurrency=2, policy_version=11, batch_id="eval-http"
            )

    assert {key for key, t in report.tasks.items() if t.successes} == SOLVED
    assert all(t.scored == k and t.unscored == 0 for t in report.tasks.values())
    assert report.overall.pass_at == (0.5,) * k and report.policy_version == 11
    assert len(report.results) == k * len(TASKS)
    assert {r.policy_version for r in report.results} == {11}
    # The service's figures are the ones computed here from the same results.
    here = evaluate(report.results, k=k, policy_version=11)
    assert (report.tasks, report.overall) == (here.tasks, here.overall)
    assert emulator.ledger.running == 0


async def test_the_eval_of_a_running_batch_is_a_409_and_bad_parameters_a_422(
    served: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = PlannedPolicy({TASKS[0].key: ["hold"]})
    plan(monkeypatch, policy)
    async with served.http() as http:
        created = await http.post(
            "/v1/batches",
            json={"tasks": [task_record(TASKS[0])], "batch_id": "eval-held", "policy_version": 1},
        )
        assert created.status_code == 201, created.text
        running = await http.get("/v1/batches/eval-held/eval")
        assert running.status_code == 409 and "still running" in running.json()["detail"]
        for query in ({"k": "0"}, {"k": "two"}, {"k": "2"}, {"success_threshold": "nan"}):
            bad = await http.get("/v1/batches/eval-held/eval", params=query)
            assert bad.status_code == 422, query
        assert (await http.get("/v1/batches/no-such-batch/eval")).status_code == 404
        # The same id with another tag is another request.
        other = await http.post(
            "/v1/batches",
            json={"tasks": [task_record(TASKS[0])], "batch_id": "eval-held", "policy_version": 2},
        )
        assert other.status_code == 409

        policy.release.set()
        with anyio.fail_after(60):
            async with http.stream("GET", "/v1/batches/eval-held/results") as stream:
                async for _ in stream.aiter_lines():
                    pass
        done = await http.get("/v1/batches/eval-held/eval", params={"success_threshold": 0.5})
    assert done.status_code == 200, done.text
    record = done.json()
    assert record["k"] == 1 and record["policy_version"] == 1
    assert record["success_threshold"] == 0.5
    assert record["tasks"][TASKS[0].key]["pass@1"] == 1.0

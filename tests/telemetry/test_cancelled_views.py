"""A cancelled rollout is cancelled, not failed, in the telemetry's views: the
dashboard (headline, errors panel, failures by environment, the batch's
progress) and `fleetroll stats`. One real batch, cancelled part-way on the
in-process emulator: one rollout completes, one fails, one is cancelled."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner
from telemetry_helpers import local_settings
from test_dashboard import browse

from fleetroll._internal.serving import serve_asgi
from fleetroll.cli.main import main
from fleetroll.emulator import Emulator
from fleetroll.policies import AssistantTurn, ScriptedPolicy, ToolSpec
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import TaskSpec, load_tasks
from fleetroll.telemetry import Telemetry
from fleetroll.telemetry.dashboard import dashboard_app, snapshot
from fleetroll.telemetry.queries import stats

#: Integration tests (the emulator over loopback): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=load_settings().modalities)
#: One to complete, one the scripted policy cannot play (no solution: policy_error),
#: one held until the batch is cancelled.
TASKS = [LEDGER[0], LEDGER[1].model_copy(update={"solution": None}), LEDGER[2]]
BATCH = "cut"


class HeldPolicy(ScriptedPolicy):
    """Plays solutions, but the task ``held`` waits for ever (until cancelled)."""

    def __init__(self, held: str) -> None:
        super().__init__()
        self.held = held

    async def act(
        self, task: TaskSpec, messages: Sequence[Any], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        if task.key == self.held:
            await anyio.sleep_forever()
        return await super().act(task, messages, tools)


@dataclass(frozen=True)
class Cancelled:
    db: Path
    results: list[RolloutResult]


async def run_and_cancel(db: Path) -> list[RolloutResult]:
    settings = local_settings(db)
    with Telemetry(
        settings.telemetry, secrets=settings.secrets(), logfire_token=settings.logfire_token
    ) as telemetry:
        async with (
            Emulator() as emu,
            RolloutPool(
                settings, api_key=emu.api_key, base_url=emu.base_url, events=telemetry.events
            ) as pool,
        ):
            batch = pool.run_batch(TASKS, HeldPolicy(TASKS[2].key), batch_id=BATCH)
            results = []
            with anyio.fail_after(60):
                async for result in batch:
                    results.append(result)
                    if len(results) == 2:  # the free ones; the held one waits
                        batch.cancel()
    return results


@pytest.fixture(scope="module")
def cancelled(tmp_path_factory: pytest.TempPathFactory) -> Cancelled:
    """The store of the batch cancelled part-way, shared by this module's tests (they read)."""
    db = tmp_path_factory.mktemp("cancelled") / "telemetry.db"
    results = anyio.run(run_and_cancel, db)
    reasons = sorted(str(r.failure_reason) for r in results)
    assert reasons == ["None", "cancelled", "policy_error"], reasons
    return Cancelled(db, results)


def test_the_dashboard_counts_the_cancelled_apart_and_leaves_them_out_of_the_failure_rate(
    cancelled: Cancelled,
) -> None:
    data = snapshot(cancelled.db)
    totals = data["totals"]
    assert (totals["completed"], totals["failed"], totals["cancelled"]) == (3, 1, 1)
    assert totals["failed_pct"] == pytest.approx(50.0)  # 1 of the 2 that ran to their end
    [env] = data["failures"]["envs"]
    assert (env["failed"], env["cancelled"], env["reasons"]) == (1, 1, {"policy_error": 1})
    assert data["failures"]["reasons"] == ["policy_error"]
    # The latest errors are the failures: the cancelled rollout did not fail.
    assert [e["failure_reason"] for e in data["errors"]] == ["policy_error"]
    progress = data["progress"]
    assert progress["batch_id"] == BATCH and progress["state"] == "finished"
    assert (progress["done"], progress["failed"], progress["cancelled"]) == (3, 1, 1)


async def test_the_dashboard_page_shows_the_cancelled_beside_the_failed_in_a_browser(
    cancelled: Cancelled, chromium: str, tmp_path: Path
) -> None:
    async with serve_asgi(dashboard_app(cancelled.db)) as url:
        html = await browse(chromium, f"{url}/dashboard", tmp_path / "profile", "--dump-dom")
    assert "live · updated" in html

    def shown(element: str) -> str:
        found = re.search(f'id="{element}"[^>]*>([^<]*)<', html)
        assert found is not None, f"{element} is not on the page"
        return found.group(1)

    assert shown("stat-failed") == "50.0%" and shown("stat-cancelled") == "1"
    assert shown("stat-failed-sub") == "1 of 2 that ran to their end"
    assert shown("progress-failed") == "1" and shown("progress-cancelled") == "1"
    errors = html.split('id="errors-rows"')[1].split("</tbody>")[0]
    assert "policy_error" in errors and "cancelled" not in errors


def test_stats_shows_the_cancelled_in_a_column_of_their_own(cancelled: Cancelled) -> None:
    [row] = stats(cancelled.db, BATCH)
    assert (row["completed"], row["failed"], row["cancelled"]) == (1, 1, 1)
    result = CliRunner().invoke(
        main, ["stats", "--db", str(cancelled.db), "--batch", BATCH], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    header = next(line for line in lines if "completed" in line)
    cells = next(line for line in lines if "ledger" in line)
    by_column = dict(
        zip(
            [c.strip() for c in header.split("┃")[1:-1]],
            [c.strip() for c in cells.split("│")[1:-1]],
            strict=True,
        )
    )
    assert by_column["completed"] == "1"
    assert by_column["failed"] == "1" and by_column["failed %"] == "50"
    assert by_column["cancelled"] == "1" and by_column["policy_error"] == "1"


def test_stats_check_passes_on_the_cancelled_batch(cancelled: Cancelled) -> None:
    result = CliRunner().invoke(
        main, ["stats", "--db", str(cancelled.db), "--check"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    assert FailureReason.CANCELLED.value not in result.output
    assert result.output.startswith("ok: 3 rollouts")

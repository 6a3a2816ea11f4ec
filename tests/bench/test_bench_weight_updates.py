"""The weight-update scenario, small: each mode runs the batch with periodic
updates and reports its numbers (structure and invariants only, never timings)."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from fleetroll.bench.report import markdown
from fleetroll.bench.runner import run_scenario
from fleetroll.bench.scenarios import SCENARIOS

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
async def test_the_weight_update_scenario_reports_every_mode_side_by_side() -> None:
    scenario = replace(
        SCENARIOS["weight-updates"],
        rollouts=2,
        concurrency=(2,),
        samples_per_task=2,
        update_every_s=0.5,
        max_tokens=8,
        wall_limit_s=120.0,
    )
    report = await run_scenario(scenario, baselines=(), echo=lambda _: None)
    record = report.weight_updates
    assert record is not None
    assert [row.mode for row in record.rows] == ["pause", "abort", "in_flight"]
    for row in record.rows:
        assert row.rollouts == 2 and row.stale == 0
        assert row.generated_tokens > 0 and row.tokens_per_s > 0
        assert 0.0 <= row.idle_share <= 1.0
    by_mode = {row.mode: row for row in record.rows}
    assert by_mode["pause"].aborted == 0 and by_mode["in_flight"].aborted == 0
    table = markdown(report)
    assert "| policy.weight_update |" in table and "| in_flight |" in table

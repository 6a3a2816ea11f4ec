"""Composite rewards end to end: the emulator's real verifier, a fake judge over
loopback and a check, summed by weight; then ``rescore`` gives the same rewards.
And an ``mcp`` task scored by checks alone, without a verifier."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from fleetroll.emulator import Emulator
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.assembly import fleet_provider, judge_config, mcp_provider, rollout_config
from fleetroll.results import RolloutResult
from fleetroll.rollout.engine import RolloutEngine
from fleetroll.rollout.machine import RolloutIds
from fleetroll.scoring import Judge, Scorer
from fleetroll.scoring.checks import render
from fleetroll.scoring.rescore import rescore_all
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import parse_task
from fleetroll.telemetry import Events, MemorySink
from fleetroll.telemetry.events import Redactor
from fleetroll.testing.fake_judge import FakeJudge, toy_score

pytestmark = pytest.mark.slow

RUBRIC = "Did the agent record the rent correctly and say so?"
REWARDS = [
    {"name": "solved", "kind": "verifier", "weight": 0.6},
    {"name": "quality", "kind": "judge", "rubric": RUBRIC, "weight": 0.3},
    {"name": "closes", "kind": "regex", "pattern": "^done$", "on": "last_message", "weight": 0.1},
]


def ledger_task(key: str, *, solved: bool) -> dict[str, Any]:
    """ledger-001 of the shipped tasks with ``rewards``, played through or not at all."""
    lines = (config_dir() / "tasks" / "ledger.jsonl").read_text().splitlines()
    record = next(r for r in map(json.loads, lines) if r["key"] == "ledger-001")
    return {
        **record,
        "key": key,
        "rewards": REWARDS,
        "solution": record["solution"] if solved else [],
    }


async def test_composite_rewards_on_the_emulator_equal_the_weighted_sum_and_rescore_agrees(
    emulator: Emulator,
) -> None:
    tasks = [
        parse_task(ledger_task(key, solved=solved), source="t", modalities=("tool_use",))
        for key, solved in (("solved", True), ("unsolved", False))
    ]
    async with FakeJudge() as judge:
        settings = load_settings(judge={"base_url": judge.base_url})
        events = Events([MemorySink()])
        provider = fleet_provider(
            settings, events, api_key=emulator.api_key, base_url=emulator.base_url
        )
        results: list[RolloutResult] = []
        async with RolloutEngine.open(rollout_config(settings), events, provider) as eng:
            with anyio.fail_after(120):
                for n, task in enumerate(tasks):
                    ids = RolloutIds("b", f"r{n}")
                    results.append(await eng.rollout(task, ids).run(ScriptedPolicy()))
        async with Judge(judge_config(settings)) as fresh:
            again = await rescore_all(
                results,
                {t.key: t for t in tasks},
                Scorer(fresh),
                redact=Redactor(settings.secrets()),
                concurrency=2,
            )

    solved, unsolved = results
    for result, verifier in ((solved, 1.0), (unsolved, 0.0)):
        quality = toy_score(RUBRIC, render(result.transcript))
        assert result.status == "completed", result.error
        assert result.rewards == {"solved": verifier, "quality": quality, "closes": 1.0}
        assert result.reward == pytest.approx(0.6 * verifier + 0.3 * quality + 0.1)
        assert result.verifier is not None and result.verifier.success
        assert result.cost.judge_calls == 1
    assert [r.rewards for r in again] == [r.rewards for r in results]
    assert [r.reward for r in again] == [r.reward for r in results]
    assert judge.calls == 4


async def test_an_mcp_task_scored_by_checks_alone_runs_no_verifier(tmp_path: Path) -> None:
    line = (config_dir() / "tasks" / "mcp" / "notes.jsonl").read_text().splitlines()[0]
    record = {k: v for k, v in json.loads(line).items() if k != "verifier"}
    record["rewards"] = [
        {"name": "wrote", "kind": "contains", "text": "write_file", "on": "transcript"},
        {"name": "short", "kind": "max_turns", "max": 1},
    ]
    task = parse_task(record, source="t", modalities=("tool_use",))
    settings = load_settings(mcp={"workdir_root": str(tmp_path)})
    events = Events([MemorySink()])
    async with RolloutEngine.open(
        rollout_config(settings), events, mcp_provider(settings, events)
    ) as eng:
        with anyio.fail_after(60):
            result = await eng.rollout(task, RolloutIds("b", "r")).run(ScriptedPolicy())

    assert (result.status, result.reward, result.verifier) == ("completed", 2.0, None)
    assert result.rewards == {"wrote": 1.0, "short": 1.0}

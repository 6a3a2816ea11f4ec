"""Cost totals: `fleetroll stats`, `/v1/stats` and the closing table sum the results' `cost`.

Two batches over real HTTP (the emulator, the vLLM-shaped fake chat server) write
their telemetry to a store; every total read back equals the sum over the results.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner
from rich.console import Console
from telemetry_helpers import local_settings

from fleetroll.cli.main import main
from fleetroll.cli.run import cost_table
from fleetroll.emulator import Emulator
from fleetroll.policies import OpenAIChatPolicy
from fleetroll.pool.assembly import chat_policy_config
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import RolloutResult
from fleetroll.service.query import run_stats
from fleetroll.settings import config_dir
from fleetroll.tasks import TaskSpec, load_tasks
from fleetroll.telemetry import open_telemetry, queries
from fleetroll.testing.fake_openai import FakeChatServer, Reply, VllmShape, completion, tool_call

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

FIELDS = queries.COST_FIELDS


def solving(tasks: Iterable[TaskSpec]) -> Any:
    """A chat script that plays each task's solution (found by its prompt), then says done."""
    by_prompt = {t.prompt: [(s.name, dict(s.arguments)) for s in t.solution or ()] for t in tasks}

    def script(body: dict[str, Any]) -> Reply:
        messages = body["messages"]
        prompt = next(m["content"] for m in messages if m["role"] == "user")
        turn = sum(1 for m in messages if m["role"] == "assistant")
        steps = by_prompt[prompt]
        if turn >= len(steps):
            return completion("done")
        name, arguments = steps[turn]
        return completion(tool_calls=[tool_call(name, arguments, id=f"call_{turn}")])

    return script


def sums(results: Sequence[RolloutResult]) -> dict[str, Any]:
    return {name: sum(getattr(r.cost, name) for r in results) for name in FIELDS}


def totals(row: dict[str, Any]) -> dict[str, Any]:
    return {name: row[name] for name in FIELDS}


def same(actual: dict[str, dict[str, Any]], expected: dict[str, dict[str, Any]]) -> bool:
    """Equal per key; instance seconds within the events' rounding (4 decimals each)."""
    return actual.keys() == expected.keys() and all(
        totals(actual[k]) == pytest.approx(expected[k], abs=1e-3) for k in expected
    )


async def run_two_batches(db: Path) -> list[RolloutResult]:
    files = sorted((config_dir() / "tasks").glob("*.jsonl"))
    settings = local_settings(db)
    every = [t for f in files for t in load_tasks(f, modalities=settings.modalities)]
    ledger = next(t for t in every if t.env_key == "ledger" and len(t.solution or ()) >= 2)
    desktop = next(t for t in every if t.modality == "computer_use" and t.solution)
    results: list[RolloutResult] = []
    async with FakeChatServer(solving([ledger, desktop]), vllm=VllmShape()) as server:
        settings = local_settings(db, policy={"kind": "openai", "base_url": server.base_url})
        async with (
            open_telemetry(
                settings.telemetry, secrets=settings.secrets(), logfire_token=settings.logfire_token
            ) as events,
            Emulator() as emu,
            RolloutPool(
                settings, api_key=emu.api_key, base_url=emu.base_url, events=events
            ) as pool,
            OpenAIChatPolicy.from_config(chat_policy_config(settings)) as policy,
        ):
            with anyio.fail_after(120):
                for batch_id, tasks in (("b1", [ledger, desktop]), ("b2", [ledger])):
                    batch = pool.run_batch(tasks, policy, samples_per_task=2, batch_id=batch_id)
                    results += [r async for r in batch]
        replies = list(server.replies)
    assert sum(r.cost.prompt_tokens for r in results) == sum(
        reply["usage"]["prompt_tokens"] for reply in replies
    )
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[RolloutResult]]:
    """One store with two finished batches, shared by this module's tests (they only read it)."""
    db = tmp_path_factory.mktemp("cost") / "telemetry.db"
    return db, anyio.run(run_two_batches, db)


def test_stats_sums_the_results_cost_per_environment_and_per_batch(
    runs: tuple[Path, list[RolloutResult]],
) -> None:
    db, results = runs
    assert all(r.status == "completed" for r in results)
    assert all(r.cost.prompt_tokens > 0 and r.cost.tool_calls > 0 for r in results)
    by_env: dict[str, list[RolloutResult]] = defaultdict(list)
    by_batch: dict[str, list[RolloutResult]] = defaultdict(list)
    for r in results:
        by_env[r.env_key].append(r)
        by_batch[r.batch_id].append(r)

    rows = queries.stats(db)
    assert same({row["env_key"]: row for row in rows}, {e: sums(rs) for e, rs in by_env.items()})
    b1 = [r for r in results if r.batch_id == "b1"]
    assert same(
        {row["env_key"]: row for row in queries.stats(db, "b1")},
        {env: sums([r for r in b1 if r.env_key == env]) for env in {r.env_key for r in b1}},
    )
    batches = queries.batch_costs(db)
    assert [b["batch_id"] for b in batches] == ["b2", "b1"]  # newest first
    assert same({b["batch_id"]: b for b in batches}, {b: sums(rs) for b, rs in by_batch.items()})
    assert {b["batch_id"]: b["completed"] for b in batches} == {"b1": 4, "b2": 2}


def test_v1_stats_answers_the_same_totals_per_environment_and_batch(
    runs: tuple[Path, list[RolloutResult]],
) -> None:
    db, results = runs
    b1 = [r for r in results if r.batch_id == "b1"]
    answer = run_stats(db, "b1").model_dump()
    assert same({b["batch_id"]: b for b in answer["batches"]}, {"b1": sums(b1)})
    assert sum(env["prompt_tokens"] for env in answer["envs"]) == sums(b1)["prompt_tokens"]
    everything = run_stats(db, None).model_dump()
    assert {b["batch_id"] for b in everything["batches"]} == {"b1", "b2"}


def test_fleetroll_stats_prints_the_cost_tables_and_json_carries_the_sums(
    runs: tuple[Path, list[RolloutResult]],
) -> None:
    db, results = runs
    cli = CliRunner()
    shown = cli.invoke(main, ["stats", "--db", str(db)], catch_exceptions=False)
    assert shown.exit_code == 0, shown.stderr
    assert "cost by environment" in shown.stdout and "cost by batch" in shown.stdout
    total_prompt = sums(results)["prompt_tokens"]
    assert f"{total_prompt:,}" in shown.stdout or str(total_prompt) in shown.stdout
    as_json = cli.invoke(main, ["stats", "--db", str(db), "--json"], catch_exceptions=False)
    rows = json.loads(as_json.stdout)
    assert sum(row["completion_tokens"] for row in rows) == sums(results)["completion_tokens"]


def test_the_closing_cost_table_sums_per_environment_with_a_total_row(
    runs: tuple[Path, list[RolloutResult]],
) -> None:
    _, results = runs
    b1 = [r for r in results if r.batch_id == "b1"]
    console = Console(width=80, record=True)  # what `fleetroll run` prints into a pipe
    console.print(cost_table(b1))
    rows = {}
    for line in console.export_text().splitlines():
        cells = [c.strip() for c in line.split("│") if c.strip()]
        if len(cells) == 6:
            rows[cells[0]] = cells[1:]

    def expected(rs: Sequence[RolloutResult]) -> list[str]:
        s = sums(rs)
        return [f"{s['instance_s']:.1f}", *(str(s[name]) for name in FIELDS[1:])]

    envs = {r.env_key for r in b1}
    assert len(envs) == 2
    assert rows == {
        **{f"{env}:v1": expected([r for r in b1 if r.env_key == env]) for env in envs},
        "total": expected(b1),
    }

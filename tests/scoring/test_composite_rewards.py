"""Composite rewards in rollouts and ``fleetroll rescore``, on the provider double and
a fake judge over loopback HTTP."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner

from fleetroll.cli.main import main
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.assembly import judge_config, rollout_config
from fleetroll.pool.journal import read_journal, write_results
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.rollout.engine import RolloutEngine
from fleetroll.rollout.machine import RolloutIds
from fleetroll.scoring import Judge, Scorer
from fleetroll.scoring.checks import render
from fleetroll.scoring.rescore import rescore_all
from fleetroll.settings import Settings, load_settings
from fleetroll.tasks import TaskSpec, parse_task
from fleetroll.telemetry.events import Events, MemorySink, Redactor
from fleetroll.testing.fake_judge import FakeJudge, toy_score
from fleetroll.testing.fake_provider import FakeProvider

RUBRIC = "Does the agent write the word?"
REWARDS = [
    {"name": "solved", "kind": "verifier", "weight": 0.5},
    {"name": "clear", "kind": "judge", "rubric": RUBRIC, "weight": 0.3},
    {"name": "says-done", "kind": "contains", "text": "done", "on": "last_message", "weight": 0.2},
]


def record(key: str = "t-1", rewards: Any = REWARDS, **fields: Any) -> dict[str, Any]:
    """A task as its file gives it."""
    given = {
        "key": key,
        "prompt": f"Write done ({key}).",
        "env_key": "fake",
        "verifier_func": "def verify(env):\n    return 1.0\n",
        "solution": [{"name": "note", "arguments": {"word": "done"}}],
        "rewards": rewards,
        **fields,
    }
    return {k: v for k, v in given.items() if v is not None}


def task(key: str = "t-1", rewards: Any = REWARDS, **fields: Any) -> TaskSpec:
    return parse_task(record(key, rewards, **fields), source="t.jsonl", modalities=("tool_use",))


def judge_settings(base_url: str, **judge: Any) -> Settings:
    return load_settings(
        judge={"base_url": base_url, "timeout_s": 5.0, **judge},
        retries={"judge_backoff_initial_s": 0.0, "judge_backoff_max_s": 0.0},
    )


@asynccontextmanager
async def engine(
    settings: Settings, sink: MemorySink | None = None, **provider: Any
) -> AsyncIterator[RolloutEngine]:
    fake = FakeProvider(settings.modalities, timeouts=settings.timeouts, **provider)
    async with RolloutEngine.open(
        rollout_config(settings), Events([sink or MemorySink()]), fake
    ) as eng:
        yield eng


async def run(eng: RolloutEngine, tasks: Sequence[TaskSpec]) -> list[RolloutResult]:
    results: list[RolloutResult] = []
    with anyio.fail_after(20):
        for n, t in enumerate(tasks):
            ids = RolloutIds("b", f"r{n}", group_id="g")
            results.append(await eng.rollout(t, ids).run(ScriptedPolicy()))
    return results


def expected(clear: float) -> float:
    """The reward of a solved task of REWARDS whose judge said ``clear``."""
    return 0.5 * 1.0 + 0.3 * clear + 0.2 * 1.0


async def test_a_rollout_s_reward_is_the_weighted_sum_of_its_components() -> None:
    async with FakeJudge() as judge, engine(judge_settings(judge.base_url)) as eng:
        (result,) = await run(eng, [task()])

    clear = toy_score(RUBRIC, render(result.transcript))
    assert (result.status, result.failure_reason) == ("completed", None)
    assert result.rewards == {"solved": 1.0, "clear": clear, "says-done": 1.0}
    assert result.reward == pytest.approx(expected(clear))
    assert (result.cost.judge_calls, judge.calls) == (1, 1)
    assert result.cost.judge_completion_tokens == 12 and result.cost.judge_prompt_tokens > 0
    assert result.verifier is not None and result.verifier.success


async def test_a_task_without_rewards_is_scored_by_its_verifier_as_before() -> None:
    async with FakeJudge() as judge, engine(judge_settings(judge.base_url)) as eng:
        (result,) = await run(eng, [task(rewards=None)])

    assert (result.status, result.reward, result.rewards) == ("completed", 1.0, None)
    assert result.cost.judge_calls == 0 and judge.calls == 0


async def test_a_judge_outage_gives_a_null_reward_and_a_reason_never_a_zero() -> None:
    sink = MemorySink()
    async with FakeJudge(mode="fail") as judge, engine(judge_settings(judge.base_url), sink) as eng:
        (result,) = await run(eng, [task()])

    assert (result.status, result.failure_reason, result.reward) == (
        "failed",
        FailureReason.REWARD_ERROR,
        None,
    )
    assert result.rewards == {"solved": 1.0, "clear": None, "says-done": 1.0}
    assert result.error is not None
    assert result.error.startswith("reward component 'clear' (judge) could not be computed: ")
    assert "HTTP 503" in result.error
    (failed,) = sink.named("fleet_verifier_failed")
    assert "'clear'" in str(failed.attributes["error_message"])
    (completed,) = sink.named("fleet_rollout_completed")
    assert completed.attributes["failure_reason"] == "reward_error"
    assert completed.attributes["reward"] is None


async def test_a_rollout_that_ran_out_of_steps_keeps_its_reason_when_its_judge_is_down() -> None:
    steps = [{"name": "note", "arguments": {"word": w}} for w in ("a", "done")]
    long = task(max_steps=1, solution=steps)
    async with FakeJudge(mode="fail") as judge, engine(judge_settings(judge.base_url)) as eng:
        (result,) = await run(eng, [long])

    assert (result.failure_reason, result.reward) == (FailureReason.MAX_STEPS, None)
    assert result.error is not None and "; not scored: reward component 'clear'" in result.error


async def test_a_judge_that_hangs_ends_at_its_deadline_with_no_reward() -> None:
    async with FakeJudge(mode="hang") as judge:
        settings = judge_settings(judge.base_url, timeout_s=0.3)
        async with engine(settings) as eng:
            (result,) = await run(eng, [task()])

    assert result.failure_reason is FailureReason.REWARD_ERROR and result.reward is None
    assert "within judge.timeout_s (0.3 s" in (result.error or "")


async def test_rewards_without_a_verifier_component_never_run_the_verifier() -> None:
    checks = [{"name": "says-done", "kind": "contains", "text": "done", "on": "last_message"}]
    async with FakeJudge() as judge, engine(judge_settings(judge.base_url), verify_error="x") as e:
        (result,) = await run(e, [task(rewards=checks, verifier_func=None)])

    assert (result.status, result.reward, result.rewards) == ("completed", 1.0, {"says-done": 1.0})
    assert result.verifier is None


async def test_the_judge_key_never_reaches_results_or_events(
    caplog: pytest.LogCaptureFixture,
) -> None:
    key = "jk-q0w7f3a9c0d9"
    caplog.set_level(logging.DEBUG)
    sink = MemorySink()
    async with FakeJudge(mode="unauthorized") as judge:
        settings = judge_settings(judge.base_url).model_copy(
            update={"judge_api_key": load_settings(judge_api_key=key).judge_api_key}
        )
        async with engine(settings, sink) as eng:
            (result,) = await run(eng, [task()])

    assert judge.server.headers[0]["authorization"] == f"Bearer {key}"
    assert result.failure_reason is FailureReason.REWARD_ERROR and "HTTP 401" in (
        result.error or ""
    )
    assert key not in result.model_dump_json()
    assert all(key not in json.dumps(e.attributes, default=str) for e in sink.events)
    assert key not in caplog.text


# -- rescore ----------------------------------------------------------------------

RECORDS = [record("t-1"), record("t-2"), record("t-3", rewards=None)]
TASKS = [task(r["key"], r.get("rewards")) for r in RECORDS]


async def rescored(
    results: list[RolloutResult], settings: Settings, tasks: Sequence[TaskSpec] = TASKS
) -> list[RolloutResult]:
    async with Judge(judge_config(settings)) as judge:
        with anyio.fail_after(20):
            return await rescore_all(
                results,
                {t.key: t for t in tasks},
                Scorer(judge),
                redact=Redactor(settings.secrets()),
                concurrency=4,
            )


async def test_rescore_with_the_same_settings_reproduces_the_rewards_exactly() -> None:
    async with FakeJudge() as judge:
        settings = judge_settings(judge.base_url)
        async with engine(settings) as eng:
            results = await run(eng, TASKS)
        again = await rescored(results, settings)

    assert [r.rewards for r in again] == [r.rewards for r in results]
    assert [r.reward for r in again] == [r.reward for r in results]
    assert [r.model_dump(exclude={"cost"}) for r in again] == [
        r.model_dump(exclude={"cost"}) for r in results
    ]
    assert results[2].rewards is None and again[2] is results[2]  # no rewards: untouched


async def test_rescore_with_another_judge_changes_only_the_judge_components() -> None:
    async with FakeJudge() as judge, engine(judge_settings(judge.base_url)) as eng:
        results = await run(eng, TASKS[:2])
    async with FakeJudge(score=lambda rubric, text: 0.25) as other:
        again = await rescored(results, judge_settings(other.base_url, model="stricter"))

    for before, after in zip(results, again, strict=True):
        assert before.rewards is not None and after.rewards is not None
        assert after.rewards == {**before.rewards, "clear": 0.25}
        assert after.reward == pytest.approx(0.5 + 0.3 * 0.25 + 0.2)
        assert after.cost.judge_calls == 1
    assert {body["model"] for body in other.server.requests} == {"stricter"}


async def test_rescore_scores_results_whose_judge_was_down_once_it_is_back() -> None:
    async with FakeJudge(mode="fail") as judge:
        async with engine(judge_settings(judge.base_url)) as eng:
            (failed,) = await run(eng, [task()])
        judge.mode = "score"
        (fixed,) = await rescored([failed], judge_settings(judge.base_url))

    assert failed.failure_reason is FailureReason.REWARD_ERROR
    assert (fixed.status, fixed.failure_reason, fixed.error) == ("completed", None, None)
    clear = toy_score(RUBRIC, render(failed.transcript))
    assert fixed.reward == pytest.approx(expected(clear))


async def test_rescore_reads_a_stored_verifier_value_as_the_rollout_read_it() -> None:
    async with FakeJudge() as judge:
        settings = judge_settings(judge.base_url)
        async with engine(settings) as eng:
            (scored,) = await run(eng, [task()])
        assert scored.rewards is not None
        corrupted = scored.model_copy(update={"rewards": {**scored.rewards, "solved": math.nan}})
        (again,) = await rescored([corrupted], settings)

    assert again.reward is None and again.failure_reason is FailureReason.REWARD_ERROR
    assert again.rewards is not None and again.rewards["solved"] is None
    assert "'solved' (verifier) could not be computed" in (again.error or "")


@pytest.mark.slow  # a second Python process
async def test_rescore_of_a_rollout_that_ran_out_of_steps_keeps_its_reason_and_error() -> None:
    steps = [{"name": "note", "arguments": {"word": w}} for w in ("a", "done")]
    long = task(max_steps=1, solution=steps)
    async with FakeJudge(mode="fail") as judge:
        async with engine(judge_settings(judge.base_url)) as eng:
            (failed,) = await run(eng, [long])
        judge.mode = "score"
        (fixed,) = await rescored([failed], judge_settings(judge.base_url), [long])

    assert failed.error is not None and fixed.error is not None
    own = failed.error.split("; not scored: ")[0]
    assert (fixed.failure_reason, fixed.error) == (FailureReason.MAX_STEPS, own)
    assert fixed.rewards is not None and fixed.rewards["clear"] is not None
    assert fixed.reward is not None and fixed.status == "failed"


@pytest.mark.slow  # a second Python process
async def test_the_rescore_command_writes_a_new_file_and_leaves_the_old_one(
    tmp_path: Path,
) -> None:
    tasks_file = tmp_path / "tasks.jsonl"
    tasks_file.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    async with FakeJudge() as judge:
        async with engine(judge_settings(judge.base_url)) as eng:
            results = await run(eng, TASKS)
        old = tmp_path / "results.jsonl"
        write_results(old, results)
        before = old.read_bytes()
        new = tmp_path / "new.jsonl"
        env = {**os.environ, "FLEETROLL_JUDGE__BASE_URL": judge.base_url}
        with anyio.fail_after(60):
            done = await anyio.run_process(
                [sys.executable, "-m", "fleetroll", "rescore", str(old), "--tasks",
                 str(tasks_file), "--out", str(new)],
                env=env,
                check=False,
            )  # fmt: skip

    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().startswith("rescored 2 of 3 results (0 rewards changed")
    assert old.read_bytes() == before
    assert [r.reward for r in read_journal(new)] == [r.reward for r in results]
    assert judge.calls == 4  # two in the rollouts, two in the new process (its own cache)


def rescore_command(
    tmp_path: Path, task_record: dict[str, Any], results: Sequence[RolloutResult] = (), **out: Path
) -> list[str]:
    """``fleetroll rescore`` of ``results`` with one task: its exit code 2 and its lines."""
    results_file = tmp_path / "results.jsonl"
    write_results(results_file, results)
    tasks_file = tmp_path / "tasks.jsonl"
    tasks_file.write_text(json.dumps(task_record) + "\n")
    target = out.get("out", tmp_path / "new.jsonl")
    done = CliRunner().invoke(
        main, ["rescore", str(results_file), "--tasks", str(tasks_file), "--out", str(target)]
    )
    assert done.exit_code == 2
    return done.output.strip().splitlines()


def test_rescore_refuses_to_write_over_its_input_in_one_line(tmp_path: Path) -> None:
    results = tmp_path / "results.jsonl"

    lines = rescore_command(tmp_path, RECORDS[2], out=results)

    assert lines == [f"Error: --out {results} is RESULTS itself: rescore never changes its input"]


def test_rescore_names_a_result_whose_task_is_missing(tmp_path: Path) -> None:
    stray = RolloutResult(
        rollout_id="r9", batch_id="b", task_key="gone", env_key="fake", modality="tool_use",
        status="completed", reward=1.0,
    )  # fmt: skip

    (line,) = rescore_command(tmp_path, RECORDS[2], [stray])

    assert line.endswith("the task 'gone' of rollout r9 is in none of the --tasks given")


def test_rescore_needs_a_judge_for_judge_components(tmp_path: Path) -> None:
    (line,) = rescore_command(tmp_path, RECORDS[0])

    assert "has a judge reward component but judge.base_url is not set" in line


def test_run_refuses_a_judged_task_without_a_judge_in_one_line(tmp_path: Path) -> None:
    tasks_file = tmp_path / "tasks.jsonl"
    tasks_file.write_text(json.dumps(RECORDS[0]) + "\n")

    done = CliRunner().invoke(main, ["run", str(tasks_file)])

    assert done.exit_code == 2
    assert done.output.strip().splitlines() == [
        "Error: task 't-1' has a judge reward component but judge.base_url is not set"
        " (see docs/configuration.md, [judge])"
    ]

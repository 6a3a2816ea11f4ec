"""The result journal: whole lines only, nothing acknowledged lost."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from fleetroll.journal import Journal, read_journal
from fleetroll.results import RolloutResult


def result(n: int) -> RolloutResult:
    return RolloutResult(
        rollout_id=f"r{n}",
        batch_id="b",
        task_key="t",
        env_key="ledger",
        modality="tool_use",
        status="completed",
        reward=1.0,
    )


async def test_appended_results_are_all_on_disk_when_the_journal_closes(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "results.jsonl"
    async with anyio.create_task_group() as tg, Journal(path, tg) as journal:
        for n in range(1000):
            journal.append(result(n))
    assert [r.rollout_id for r in read_journal(path)] == [f"r{n}" for n in range(1000)]


async def test_results_appended_during_cancellation_still_reach_the_disk(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg, Journal(path, tg) as journal:
            scope.cancel()
            for n in range(5):
                journal.append(result(n))
            await anyio.sleep(3600)
    assert len(read_journal(path)) == 5


async def test_a_torn_last_line_is_ignored_then_truncated_before_appending(tmp_path) -> None:
    path = tmp_path / "results.jsonl"
    whole = result(1).model_dump_json() + "\n"
    path.write_text(whole + result(2).model_dump_json()[:40])  # a kill -9 mid-write
    assert [r.rollout_id for r in read_journal(path)] == ["r1"]
    async with anyio.create_task_group() as tg, Journal(path, tg) as journal:
        journal.append(result(3))
    assert [r.rollout_id for r in read_journal(path)] == ["r1", "r3"]
    assert path.read_text().count("\n") == 2


def test_a_complete_line_that_is_not_a_result_is_an_error_naming_the_line(tmp_path) -> None:
    path = tmp_path / "results.jsonl"
    path.write_text(result(1).model_dump_json() + "\n" + '{"rollout_id": 3}\n')
    with pytest.raises(ValueError, match=r"results\.jsonl:2: not a rollout result"):
        read_journal(path)


def test_a_missing_journal_reads_as_empty(tmp_path: Path) -> None:
    assert read_journal(tmp_path / "nothing.jsonl") == []

"""The result journal: whole lines only, nothing acknowledged lost."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

import fleetroll.pool.journal as journal_module
from fleetroll.errors import ConfigError, JournalError
from fleetroll.pool.journal import (
    BatchIdentity,
    Journal,
    check_journal,
    claim_journal,
    meta_path,
    read_journal,
    read_sampler_state,
    sampler_path,
    step_batch_id,
    write_sampler_state,
)
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.tasks import TaskSpec
from fleetroll.training.sampler import SamplerConfig, TaskSampler


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


async def test_a_listener_hears_of_each_result_only_once_it_is_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    heard: list[str] = []

    def on_written(results: Sequence[RolloutResult]) -> None:
        on_disk = {r.rollout_id for r in read_journal(path)}
        assert {r.rollout_id for r in results} <= on_disk
        heard.extend(r.rollout_id for r in results)

    async with (
        anyio.create_task_group() as tg,
        Journal(path, tg, on_written=on_written) as journal,
    ):
        for n in range(300):
            journal.append(result(n))
            if n % 7 == 0:
                await anyio.sleep(0)  # let some writes happen between appends
    assert heard == [f"r{n}" for n in range(300)]


async def test_a_torn_last_line_is_ignored_then_truncated_before_appending(tmp_path) -> None:
    path = tmp_path / "results.jsonl"
    whole = result(1).model_dump_json() + "\n"
    path.write_text(whole + result(2).model_dump_json()[:40])  # a kill -9 mid-write
    assert [r.rollout_id for r in read_journal(path)] == ["r1"]
    async with anyio.create_task_group() as tg, Journal(path, tg) as journal:
        journal.append(result(3))
    assert [r.rollout_id for r in read_journal(path)] == ["r1", "r3"]
    assert path.read_text().count("\n") == 2


def test_a_corrupt_line_is_skipped_with_a_warning_naming_the_file_and_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "results.jsonl"
    path.write_text(
        result(1).model_dump_json()
        + "\n"
        + '{"rollout_id": 3}\n'
        + result(2).model_dump_json()
        + "\n"
    )
    with caplog.at_level(logging.WARNING, logger="fleetroll.pool.journal"):
        assert [r.rollout_id for r in read_journal(path)] == ["r1", "r2"]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert f"{path}:2: not a rollout result, skipped" in warning


def test_a_missing_journal_reads_as_empty(tmp_path: Path) -> None:
    assert read_journal(tmp_path / "nothing.jsonl") == []


# -- one result per rollout, the lock, the batch's identity (B1) ------------------


def cancelled(n: int) -> RolloutResult:
    return result(n).model_copy(
        update={"status": "failed", "failure_reason": FailureReason.CANCELLED, "reward": None}
    )


def task(key: str, verifier: str = "def verify(env):\n    return 1.0\n") -> TaskSpec:
    return TaskSpec(key=key, prompt="p", env_key="ledger", verifier_func=verifier)


TASKS = [task("t"), task("u")]


def write_lines(path: Path, *results: RolloutResult) -> None:
    path.write_text("".join(r.model_dump_json() + "\n" for r in results))


def test_the_reader_keeps_the_last_result_of_each_rollout(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    write_lines(path, cancelled(1), result(2), result(1))
    assert [(r.rollout_id, r.status) for r in read_journal(path)] == [
        ("r2", "completed"),
        ("r1", "completed"),
    ]
    assert len(read_journal(path, latest=False)) == 3


def test_a_resume_keeps_every_rollout_but_those_whose_last_result_is_cancelled(
    tmp_path: Path,
) -> None:
    path = tmp_path / "results.jsonl"
    first = claim_journal(path, BatchIdentity.of("b", TASKS, 2), resume=False)
    first.close()
    write_lines(path, result(1), cancelled(2), cancelled(3), result(3))
    claim = claim_journal(path, BatchIdentity.of("other", TASKS, 2), resume=True)
    try:
        assert claim.batch_id == "b"  # the journaled batch, not a new one
        assert sorted(r.rollout_id for r in claim.done) == ["r1", "r3"]
    finally:
        claim.close()


def test_a_resume_runs_again_a_rollout_whose_line_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    claim_journal(path, BatchIdentity.of("b", TASKS, 2), resume=False).close()
    torn = result(2).model_dump_json()[:50]  # a completed result, cut by a disk's fault
    path.write_text(result(1).model_dump_json() + "\n" + torn + "\n")
    claim = claim_journal(path, BatchIdentity.of("b", TASKS, 2), resume=True)
    claim.close()
    assert [r.rollout_id for r in claim.done] == ["r1"]  # r2 is not done: it runs again


def test_a_resume_of_a_run_killed_before_its_first_result_keeps_its_batch_id(
    tmp_path: Path,
) -> None:
    # The batch id is its instances' run id: the resume releases what the killed run left.
    path = tmp_path / "results.jsonl"
    claim_journal(path, BatchIdentity.of("b", TASKS, 2), resume=False).close()
    claim = claim_journal(path, BatchIdentity.of("other", TASKS, 2), resume=True)
    claim.close()
    assert claim.batch_id == "b" and claim.done == []
    # Another batch in the same (empty) journal starts afresh, as before.
    again = claim_journal(path, BatchIdentity.of("new", TASKS, 3), resume=True)
    again.close()
    assert again.batch_id == "new"


def test_a_journal_in_use_by_another_run_is_refused_until_it_is_released(
    tmp_path: Path,
) -> None:
    path = tmp_path / "results.jsonl"
    held = claim_journal(path, BatchIdentity.of("b", TASKS, 1), resume=False)
    with pytest.raises(ConfigError, match="in use by another fleetroll run"):
        claim_journal(path, BatchIdentity.of("b2", TASKS, 1), resume=True)
    held.close()
    claim_journal(path, BatchIdentity.of("b2", TASKS, 1), resume=True).close()


@pytest.mark.parametrize(
    ("tasks", "samples", "message"),
    [
        (TASKS, 3, "started with --samples 2, this run asks for 3"),
        ([task("t", "def verify(env):\n    return 0.25\n"), task("u")], 2, "'t' has changed"),
        ([task("t")], 2, "'u' is not among this run's tasks"),
        ([*TASKS, task("v")], 2, "'v' was not in the batch"),
    ],
)
def test_a_resume_of_another_batch_is_refused_saying_what_differs(
    tmp_path: Path, tasks: list[TaskSpec], samples: int, message: str
) -> None:
    path = tmp_path / "results.jsonl"
    claim_journal(path, BatchIdentity.of("b", TASKS, 2), resume=False).close()
    write_lines(path, result(1))
    with pytest.raises(ConfigError, match=re.escape(message)):
        claim_journal(path, BatchIdentity.of("b", tasks, samples), resume=True)


def test_a_journal_with_results_is_not_reused_without_resume(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    claim_journal(path, BatchIdentity.of("b", TASKS, 1), resume=False).close()
    write_lines(path, result(1))
    with pytest.raises(ConfigError, match="already exists: pass --resume"):
        claim_journal(path, BatchIdentity.of("b2", TASKS, 1), resume=False)


def test_a_journal_from_before_identities_resumes_and_gets_one(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    write_lines(path, result(1).model_copy(update={"task_key": "t"}))
    claim = claim_journal(path, BatchIdentity.of("new", TASKS, 1), resume=True)
    claim.close()
    assert claim.batch_id == "b"
    assert BatchIdentity.from_json(meta_path(path).read_bytes()).batch_id == "b"


def test_the_early_check_refuses_what_the_claim_would_and_leaves_nothing_behind(
    tmp_path: Path,
) -> None:
    fresh = tmp_path / "new" / "results.jsonl"
    check_journal(fresh, BatchIdentity.of("b", TASKS, 1), resume=False)
    assert not fresh.parent.exists()  # a journal to be: the claim creates it

    old = tmp_path / "old.jsonl"  # a journal from before identities: the claim writes one
    write_lines(old, result(1).model_copy(update={"task_key": "t"}))
    check_journal(old, BatchIdentity.of("new", TASKS, 1), resume=True)
    assert not meta_path(old).exists()
    with pytest.raises(ConfigError, match="already exists: pass --resume"):
        check_journal(old, BatchIdentity.of("new", TASKS, 1), resume=False)
    beyond = tmp_path / "beyond.jsonl"
    write_lines(beyond, result(2).model_copy(update={"task_key": "t", "sample_index": 3}))
    with pytest.raises(ConfigError, match="this run asks for --samples 1"):
        check_journal(beyond, BatchIdentity.of("new", TASKS, 1), resume=True)

    held = claim_journal(old, BatchIdentity.of("new", TASKS, 4), resume=True)
    with pytest.raises(ConfigError, match="in use by another fleetroll run"):
        check_journal(old, BatchIdentity.of("new", TASKS, 4), resume=True)
    held.close()
    for path in (Path("/dev/zero"), tmp_path):
        with pytest.raises(ConfigError, match="not a regular file"):
            check_journal(path, BatchIdentity.of("b", TASKS, 1), resume=True)


def test_a_fifo_or_a_device_is_refused_as_a_journal_without_reading_it(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        with pytest.raises(ConfigError, match="not a regular file"):
            claim_journal(path, BatchIdentity.of("b", TASKS, 1), resume=True)
        with pytest.raises(ValueError, match="not a regular file"):
            read_journal(path)


def test_a_resume_with_another_oversample_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    claim_journal(path, BatchIdentity.of("b", TASKS, 2, oversample=1), resume=False).close()
    write_lines(path, result(1))
    why = "started with pool.oversample = 1, this run asks for 0"
    with pytest.raises(ConfigError, match=re.escape(why)):
        claim_journal(path, BatchIdentity.of("b", TASKS, 2), resume=True)
    claim_journal(path, BatchIdentity.of("b", TASKS, 2, oversample=1), resume=True).close()


def test_a_journal_from_before_oversample_was_recorded_resumes_with_any(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    claim_journal(path, BatchIdentity.of("b", TASKS, 2), resume=False).close()
    write_lines(path, result(1))
    old = json.loads(meta_path(path).read_bytes())
    del old["oversample"]
    meta_path(path).write_text(json.dumps(old))

    claim = claim_journal(path, BatchIdentity.of("b", TASKS, 2, oversample=3), resume=True)
    claim.close()
    assert claim.batch_id == "b"


# -- a run of steps (--steps, --batch-tasks): one journal, a batch per step ---------


def step_result(n: int, batch_id: str) -> RolloutResult:
    return result(n).model_copy(update={"batch_id": batch_id, "task_key": "t"})


def test_a_run_of_steps_resumes_with_the_batches_of_its_steps(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    steps = BatchIdentity.of("run", TASKS, 2, batch_tasks=1)
    claim_journal(path, steps, resume=False).close()
    assert BatchIdentity.from_json(meta_path(path).read_bytes()) == steps
    write_lines(path, step_result(1, step_batch_id("run", 0)), step_result(2, "run-step1"))
    claim = claim_journal(path, BatchIdentity.of("new", TASKS, 2, batch_tasks=1), resume=True)
    try:
        assert claim.batch_id == "run" and len(claim.done) == 2
    finally:
        claim.close()


@pytest.mark.parametrize(
    ("started", "asked", "message"),
    [
        (1, 2, "started with --batch-tasks 1, this run asks for 2"),
        (None, 1, "started as one batch, without --steps"),
        (1, None, "started with --steps, this run asks for one batch"),
    ],
)
def test_a_run_of_steps_and_one_batch_do_not_resume_each_other(
    tmp_path: Path, started: int | None, asked: int | None, message: str
) -> None:
    path = tmp_path / "results.jsonl"
    claim_journal(
        path, BatchIdentity.of("run", TASKS, 2, batch_tasks=started), resume=False
    ).close()
    write_lines(path, step_result(1, "run-step0" if started else "run"))
    with pytest.raises(ConfigError, match=re.escape(message)):
        claim_journal(path, BatchIdentity.of("run", TASKS, 2, batch_tasks=asked), resume=True)


def test_a_run_of_steps_refuses_a_journal_holding_another_batch(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    claim_journal(path, BatchIdentity.of("run", TASKS, 2, batch_tasks=1), resume=False).close()
    write_lines(path, step_result(1, "run-step0"), step_result(2, "other"))
    with pytest.raises(ConfigError, match="holds batch other, not a step of the run run"):
        claim_journal(path, BatchIdentity.of("run", TASKS, 2, batch_tasks=1), resume=True)


def test_the_sampler_state_is_kept_beside_the_journal_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    assert read_sampler_state(path) is None
    sampler = TaskSampler(TASKS, SamplerConfig(batch_tasks=1, seed=4))
    sampler.draw()
    write_sampler_state(path, sampler.state())
    assert sampler_path(path).name == "results.jsonl.sampler.json"
    assert read_sampler_state(path) == sampler.state()
    sampler_path(path).write_text("{}")
    with pytest.raises(ConfigError, match="not a sampler state"):
        read_sampler_state(path)


# -- no one result can stop the journal; a failed write is final (issue 37) -------------


def unwritable(n: int) -> RolloutResult:
    """A result with a lone surrogate in a tool's answer (a file name that is not UTF-8)."""
    transcript = [{"role": "user", "content": "list"}, {"role": "tool", "content": "a\udc80b"}]
    return result(n).model_copy(update={"transcript": transcript, "final_answer": "done"})


async def test_a_result_json_cannot_hold_is_journaled_as_its_rollouts_failure_and_the_rest_kept(
    tmp_path: Path,
) -> None:
    path = tmp_path / "results.jsonl"
    async with anyio.create_task_group() as tg, Journal(path, tg) as journal:
        assert journal.append(result(0)) == result(0)
        kept = journal.append(unwritable(1))
        journal.append(result(2))
    got = read_journal(path)
    assert [r.rollout_id for r in got] == ["r0", "r1", "r2"]
    assert got[1] == kept
    assert (kept.status, kept.failure_reason, kept.reward) == (
        "failed",
        FailureReason.RESULT_ERROR,
        None,
    )
    assert kept.error is not None
    assert "transcript[1].content holds a lone surrogate (U+DC80)" in kept.error
    assert "it had ended completed with reward 1" in kept.error
    assert kept.transcript == [] and kept.final_answer is None
    assert (kept.batch_id, kept.task_key, kept.env_key) == ("b", "t", "ledger")


async def test_a_failed_write_is_final_cut_back_and_never_reported_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "results.jsonl"
    real_write = journal_module._write
    writes = 0

    def disk_fills_on_the_second_write(fd: int, data: bytes) -> None:
        nonlocal writes
        writes += 1
        if writes == 2:  # half of it reaches the file, then the disk is full
            os.write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(fd, data)

    monkeypatch.setattr(journal_module, "_write", disk_fills_on_the_second_write)
    heard: list[str] = []
    failed: list[OSError] = []
    first_written, write_failed = anyio.Event(), anyio.Event()

    def on_written(results: Sequence[RolloutResult]) -> None:
        heard.extend(r.rollout_id for r in results)
        first_written.set()

    def on_failed(exc: OSError) -> None:
        failed.append(exc)
        write_failed.set()

    async with anyio.create_task_group() as tg:
        with pytest.raises(JournalError, match="No space left on device") as raised:
            async with Journal(path, tg, on_written=on_written, on_failed=on_failed) as journal:
                journal.append(result(0))
                with anyio.fail_after(5):
                    await first_written.wait()
                journal.append(result(1))
                journal.append(result(2))
                with anyio.fail_after(5):
                    await write_failed.wait()
                journal.append(result(3))  # after the failure: dropped, never written
    assert heard == ["r0"]
    assert [exc.errno for exc in failed] == [errno.ENOSPC]
    assert raised.value.written == 1 and raised.value.error.errno == errno.ENOSPC
    # The file holds exactly what its listener heard of: no torn line, nothing more.
    assert path.read_bytes() == (result(0).model_dump_json() + "\n").encode()

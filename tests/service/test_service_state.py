"""What ``serve`` keeps in ``service.state_dir``, read back as the batches were."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import anyio
import httpx
import pytest
from service_helpers import task_record

from fleetroll.client import FleetrollClient
from fleetroll.emulator import Emulator
from fleetroll.errors import ConfigError, ServiceError
from fleetroll.pool.journal import meta_path
from fleetroll.pool.rollout_pool import RolloutPool, group_id, rollout_id
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.service import Service, create_app, serve_app
from fleetroll.service.batch_record import BatchRecord
from fleetroll.service.models import PolicyConfig
from fleetroll.service.state import StoredBatch, StoredRequest, open_store
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import load_tasks

LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=load_settings().modalities)
TASKS = LEDGER[:2]
BATCH = "b-1"
#: 2 tasks x 2 samples: r[0], r[1] of the first task, r[2], r[3] of the second.
R = [rollout_id(BATCH, t.key, n) for t in TASKS for n in range(2)]


def request() -> StoredRequest:
    return StoredRequest(
        batch_id=BATCH,
        fingerprint="f" * 64,
        tasks=TASKS,
        policy=PolicyConfig(kind="scripted", think_time_s=0.0),
        samples_per_task=2,
    )


def result(i: int, *, cancelled: bool = False, reward: float = 1.0) -> RolloutResult:
    task = TASKS[i // 2]
    return RolloutResult(
        rollout_id=R[i],
        batch_id=BATCH,
        task_key=task.key,
        sample_index=i % 2,
        group_id=group_id(BATCH, task.key),
        env_key=task.env_key,
        modality=task.modality,
        status="failed" if cancelled else "completed",
        failure_reason=FailureReason.CANCELLED if cancelled else None,
        reward=None if cancelled else reward,
    )


async def stream(record: BatchRecord, after: int = 0) -> list[dict[str, object]]:
    lines: list[dict[str, object]] = []
    with anyio.fail_after(5):
        async for chunk in record.lines(after, heartbeat_s=60, stopping=lambda: True):
            lines += [json.loads(line) for line in chunk.decode().splitlines()]
    return lines


async def test_a_batch_read_back_without_every_result_is_interrupted_with_its_cursors() -> None:
    record = BatchRecord.restored(StoredBatch(request(), [result(0), result(2), result(1)], 0))
    assert record.status == "interrupted"
    lines = await stream(record, after=1)
    assert [(line["type"], line["cursor"]) for line in lines] == [
        ("result", 2),
        ("result", 3),
        ("interrupted", 3),
    ]
    assert lines[-1]["missing"] == 1
    assert record.state().counts.done == 3
    groups = [g.task_key for g in record.groups.groups]
    assert groups == [TASKS[0].key]  # the second task's group lacks a sample


async def test_a_batch_read_back_replays_its_rerun_so_readers_get_the_newest_results() -> None:
    first = [result(0, cancelled=True), result(1), result(2), result(3, cancelled=True)]
    rerun = [result(3, reward=0.0), result(0, reward=0.5)]
    record = BatchRecord.restored(StoredBatch(request(), first + rerun, 0))
    assert record.status == "finished"
    lines = await stream(record)
    got = [(line["type"], line["cursor"]) for line in lines]
    assert got == [("result", 2), ("result", 3), ("result", 5), ("result", 6), ("end", 6)]
    # Its groups: each once, the newest (the first ones, with cancelled samples, replaced).
    newest = [g for i, g in enumerate(record.groups.groups) if i not in record.groups._superseded]
    assert sorted(g.task_key for g in newest) == sorted(t.key for t in TASKS)


async def test_a_batch_killed_during_a_rerun_reads_back_interrupted_with_the_rest_owed() -> None:
    first = [result(0, cancelled=True), result(1), result(2, cancelled=True), result(3)]
    record = BatchRecord.restored(StoredBatch(request(), [*first, result(2)], 0))
    assert record.status == "interrupted"
    lines = await stream(record)
    got = [(line["type"], line["cursor"]) for line in lines]
    assert got == [("result", 2), ("result", 4), ("result", 5), ("interrupted", 5)]
    assert lines[-1]["missing"] == 1  # r[0]: its re-run had not ended


async def test_a_stored_batch_reads_back_without_a_line_a_kill_cut_short(tmp_path) -> None:
    async with open_store(tmp_path) as store:
        await anyio.to_thread.run_sync(store.save_request, request())
        path = store.journal_path(BATCH)
        path.write_text(result(0).model_dump_json() + "\n" + result(1).model_dump_json()[:30])
        assert "api_key" not in meta_path(path).read_text()
    async with open_store(tmp_path) as store:
        (stored,) = store.restored
    assert stored.request == request()
    assert [r.rollout_id for r in stored.results] == [R[0]]


async def test_a_second_service_on_the_same_state_dir_is_refused_in_one_line(tmp_path) -> None:
    async with open_store(tmp_path):
        with pytest.raises(ConfigError, match="in use by another fleetroll serve") as refused:
            async with open_store(tmp_path):
                pass
    assert "\n" not in str(refused.value)
    async with open_store(tmp_path):  # free again once the first let go
        pass


async def test_a_policy_api_key_is_never_written_to_the_state_dir(tmp_path) -> None:
    secret = "sk-never-on-disk-0123456789"
    policy = PolicyConfig.model_validate({"kind": "openai", "api_key": secret})
    stored = request().model_copy(update={"policy": policy})
    async with open_store(tmp_path) as store:
        await anyio.to_thread.run_sync(store.save_request, stored)
        assert secret not in meta_path(store.journal_path(BATCH)).read_text()


@pytest.mark.slow
async def test_forgotten_batches_leave_the_state_dir_and_the_rest_read_back(
    emulator: Emulator, tmp_path: Path
) -> None:
    token = "a-state-test-token-of-32-chars-x"  # whatever serve asks of code-carrying tasks
    settings = load_settings(
        service={"keep_finished_batches": 1, "state_dir": tmp_path}, service_token=token
    )
    body = {"tasks": [task_record(t) for t in TASKS], "policy": {"kind": "scripted"}}
    async with (
        open_store(tmp_path) as store,
        RolloutPool(settings, api_key=emulator.api_key, base_url=emulator.base_url) as pool,
    ):
        service = Service(pool, settings, store=store)
        async with (
            serve_app(create_app(service), "127.0.0.1", 0) as url,
            httpx.AsyncClient(
                base_url=url, timeout=30, headers={"Authorization": f"Bearer {token}"}
            ) as http,
        ):
            for batch_id in ("old", "new"):
                answer = await http.post("/v1/batches", json={**body, "batch_id": batch_id})
                assert answer.status_code == 201, answer.text
                with anyio.fail_after(60):
                    async with http.stream("GET", f"/v1/batches/{batch_id}/results") as stream:
                        last = [line async for line in stream.aiter_lines()][-1]
                assert json.loads(last)["type"] == "end"
        # The service has stopped: the removal it started (shielded) is done.
        assert not store.journal_path("old").exists()
        assert not meta_path(store.journal_path("old")).exists()
    async with open_store(tmp_path) as store:
        assert [b.request.batch_id for b in store.restored] == ["new"]
        assert len(store.restored[0].results) == len(TASKS)


def fake_service(posts: list[dict[str, object]]) -> httpx.MockTransport:
    """A service whose batch was interrupted at cursor 2 (r[2], r[3] without a result)
    until it is submitted again; ``posts`` gets each submission."""

    def line(body: dict[str, object]) -> str:
        return json.dumps(body) + "\n"

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            posts.append(json.loads(request.content))
            rerun = 2 if len(posts) > 1 else 0
            return httpx.Response(200, json={"batch_id": BATCH, "rollouts": 4, "rerun": rerun})
        after = int(request.url.params["after"])
        stored = [result(0), result(1)] + ([result(2), result(3)] if len(posts) > 1 else [])
        body = "".join(
            line({"type": "result", "cursor": n, "result": r.model_dump(mode="json")})
            for n, r in enumerate(stored, start=1)
            if n > after
        )
        if len(posts) > 1:
            body += line({"type": "end", "cursor": 4, "status": "finished"})
        else:
            body += line({"type": "interrupted", "cursor": 2, "missing": 2})
        return httpx.Response(200, text=body, headers={"content-type": "application/x-ndjson"})

    return httpx.MockTransport(handler)


async def test_the_client_submits_an_interrupted_batch_again_and_gets_each_rollout_once() -> None:
    posts: list[dict[str, object]] = []
    async with (
        httpx.AsyncClient(transport=fake_service(posts)) as http,
        FleetrollClient("http://service.test", http_client=http) as client,
    ):
        batch = client.run_batch(TASKS, {"kind": "scripted"}, samples_per_task=2, batch_id=BATCH)
        with anyio.fail_after(5):
            got = [r.rollout_id async for r in batch]
    assert got == R
    assert batch.resubmits == 1 and len(posts) == 2 and posts[0] == posts[1]
    assert batch.rerun == 2


async def test_a_batch_the_client_did_not_submit_says_how_to_resume_an_interruption() -> None:
    async with (
        httpx.AsyncClient(transport=fake_service([])) as http,
        FleetrollClient("http://service.test", http_client=http) as client,
    ):
        batch = client.batch(BATCH, after=1)
        with anyio.fail_after(5), pytest.raises(ServiceError) as refused:
            async for _ in batch:
                pass
    assert batch.cursor == 2
    assert f"client.run_batch(<the same tasks>, batch_id='{BATCH}', after=2)" in str(refused.value)


async def test_a_stored_batch_that_cannot_be_read_refuses_the_start_naming_its_file(
    tmp_path: Path,
) -> None:
    # Its request: without it the batch cannot be told from another (a corrupt result
    # line is another matter: the next test).
    async with open_store(tmp_path) as store:
        await anyio.to_thread.run_sync(store.save_request, request())
        meta_path(store.journal_path(BATCH)).write_text("not a request\n")
    with pytest.raises(ConfigError, match=r"cannot read the batch stored in .*b-1\.jsonl") as no:
        async with open_store(tmp_path):
            pass
    assert "\n" not in str(no.value)
    meta_path(tmp_path / "batches" / f"{BATCH}.jsonl").unlink()  # as the message says
    async with open_store(tmp_path) as store:  # and the lock was let go
        assert store.restored == []


async def test_a_corrupt_result_line_is_skipped_with_a_warning_and_its_rollout_has_no_result(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_store(tmp_path) as store:
        await anyio.to_thread.run_sync(store.save_request, request())
        path = store.journal_path(BATCH)
        lines = [result(0).model_dump_json(), result(1).model_dump_json()[:40]]
        lines += [result(2).model_dump_json(), result(3).model_dump_json()]
        path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="fleetroll.pool.journal"):
        async with open_store(tmp_path) as store:  # it starts
            (stored,) = store.restored
    assert [m for r in caplog.records if f"{path}:2: not a rollout result" in (m := r.getMessage())]
    record = BatchRecord.restored(stored)
    # r[1] is not done: the batch is interrupted, a resubmission runs r[1] again.
    assert record.status == "interrupted"
    assert record.newest_of(R[1]) is None
    assert record.plan.rollout_ids(BATCH) - {r.rollout_id for r in record.newest()} == {R[1]}
    # Every other line keeps its cursor: a reader resuming after 2 gets r[2] at 3, r[3] at 4.
    lines_read = await stream(record, after=2)
    assert [(line["type"], line["cursor"]) for line in lines_read] == [
        ("result", 3),
        ("result", 4),
        ("interrupted", 4),
    ]
    assert lines_read[-1]["missing"] == 1
    assert record.state().results == 4

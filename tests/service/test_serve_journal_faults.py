"""``fleetroll serve``'s journals under faults (issue 37): a result JSON cannot
hold, a full disk under ``service.state_dir``, a corrupt line.

Over real HTTP on loopback. The full disk is a real one: the file-size limit
of the ``fleetroll serve`` child (``RLIMIT_FSIZE``, set on the running
process: its writes past it fail with EFBIG, as they fail with ENOSPC on a
full disk). The lone surrogate comes from a real policy server on loopback,
as a model's text (JSON's ``\\udc80`` escape, which ``json`` accepts).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from service_helpers import TOKEN, free_port, serving, task_record

from fleetroll.client import FleetrollClient
from fleetroll.emulator import Emulator
from fleetroll.pool.journal import read_journal
from fleetroll.pool.rollout_pool import RolloutPool, rollout_id
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.service import Service, create_app, serve_app
from fleetroll.service.state import StoredRequest, open_store
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import load_tasks
from fleetroll.telemetry import open_telemetry, queries
from fleetroll.testing.fake_openai import FakeChatServer, FakeRawResponse, Reply, completion

pytestmark = pytest.mark.slow

LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=load_settings().modalities)
TASKS = LEDGER[:6]
SAMPLES = 4  # 6 tasks x 4 samples = 24 rollouts
BATCH = "step-1"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: Slow enough that when the disk fills, rollouts are done, running and waiting.
BODY: dict[str, Any] = {
    "tasks": [task_record(t) for t in TASKS],
    "policy": {"kind": "scripted", "think_time_s": 0.25},
    "samples_per_task": SAMPLES,
    "batch_id": BATCH,
}


def cut(text: str, chars: int) -> str:
    """``text`` as an event's preview holds it (``pool.events_preview_chars``)."""
    return text if len(text) <= chars else text[:chars] + "…"


async def read_stream(
    http: httpx.AsyncClient, after: int, *, then: Any = None
) -> tuple[list[tuple[int, RolloutResult]], dict[str, Any]]:
    """The results stream from ``after``: its results (cursor, result) and its last line.

    ``then(n)`` is called after the n-th result read."""
    seen: list[tuple[int, RolloutResult]] = []
    with anyio.fail_after(120):
        async with http.stream("GET", f"/v1/batches/{BATCH}/results?after={after}") as stream:
            async for line in stream.aiter_lines():
                message = json.loads(line)
                if message["type"] == "result":
                    seen.append((message["cursor"], RolloutResult(**message["result"])))
                    if then is not None:
                        then(len(seen))
                elif message["type"] in ("end", "interrupted"):
                    return seen, message
    raise AssertionError("the stream ended without its last line")


async def test_a_full_disk_stops_the_batch_loudly_and_a_restart_delivers_nothing_twice(
    emulator: Emulator, tmp_path: Path
) -> None:
    # On this process's emulator: the limit is the service's alone.
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    journal = tmp_path / "state" / "batches" / f"{BATCH}.jsonl"
    total = len(TASKS) * SAMPLES
    async with serving(tmp_path, port, emu=emulator) as (first, said):

        def fill_the_disk(n: int) -> None:
            if n == 8:  # from now on nothing more fits in the journal
                size = journal.stat().st_size
                resource.prlimit(first.pid, resource.RLIMIT_FSIZE, (size, resource.RLIM_INFINITY))

        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as http:
            created = await http.post("/v1/batches", json=BODY)
            assert created.status_code == 201, created.text
            seen, last = await read_stream(http, 0, then=fill_the_disk)
            # The stream says so, with why, and sent only what is on disk.
            assert last["type"] == "interrupted", last
            error = last["error"]
            assert f"cannot keep batch {BATCH}: File too large" in error
            assert last["cursor"] == len(seen) and 8 <= len(seen) < total
            assert last["missing"] == total - len(seen)
            # The batch's state says it, the service's health too, and it takes no new rollouts.
            state = (await http.get(f"/v1/batches/{BATCH}")).json()
            assert (state["status"], state["error"], state["results"]) == (
                "interrupted",
                error,
                len(seen),
            )
            health = await http.get("/healthz")
            assert health.status_code == 503 and health.json()["status"] == "failing"
            refused = await http.post("/v1/batches", json={**BODY, "batch_id": "another"})
            assert refused.status_code == 503 and "restart" in refused.json()["detail"]
        # One clear line in the service's log, no traceback.
        assert len([line for line in said if f"cannot keep batch {BATCH}" in line]) == 1, said
        assert not [line for line in said if "Traceback" in line], "\n".join(said)
        # What a reader saw is exactly what is on disk, cursor by cursor.
        on_disk = read_journal(journal, latest=False)
        assert [(c, r) for c, r in seen] == list(enumerate(on_disk, start=1))
        first.kill()

    async with (
        serving(tmp_path, port, emu=emulator),
        httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as http,
    ):
        # The reader goes on from its cursor: nothing again, the batch is interrupted.
        again, last = await read_stream(http, len(seen))
        assert again == [] and last["type"] == "interrupted"
        assert last["missing"] == total - len(seen) and "error" not in last
        resubmitted = await http.post("/v1/batches", json=BODY)
        assert resubmitted.status_code == 200, resubmitted.text
        assert resubmitted.json()["rerun"] == total - len(seen)
        rest, last = await read_stream(http, len(seen))
        assert last["type"] == "end" and last["status"] == "finished"
    delivered = Counter(r.rollout_id for _, r in seen + rest)
    expected = {rollout_id(BATCH, t.key, n) for t in TASKS for n in range(SAMPLES)}
    assert set(delivered) == expected
    assert set(delivered.values()) == {1}, "a rollout was delivered twice"
    on_disk = read_journal(journal, latest=False)
    assert [(c, r) for c, r in seen + rest] == list(enumerate(on_disk, start=1))


async def test_serve_starts_with_a_corrupt_journal_line_and_runs_its_rollout_again(
    tmp_path: Path,
) -> None:
    async with open_store(tmp_path / "state") as store:
        request = StoredRequest(
            batch_id=BATCH,
            fingerprint="f" * 64,
            tasks=TASKS[:2],
            policy=None,
            samples_per_task=1,
        )
        await anyio.to_thread.run_sync(store.save_request, request)
        ids = [rollout_id(BATCH, t.key, 0) for t in TASKS[:2]]
        lines = [
            RolloutResult(
                rollout_id=rid,
                batch_id=BATCH,
                task_key=t.key,
                env_key=t.env_key,
                modality=t.modality,
                status="completed",
                reward=1.0,
            ).model_dump_json()
            for rid, t in zip(ids, TASKS[:2], strict=True)
        ]
        path = store.journal_path(BATCH)
        path.write_text(lines[0][:60] + "\n" + lines[1] + "\n")  # line 1: a disk's fault
    port = free_port()
    async with (
        serving(tmp_path, port) as (_, said),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=AUTH) as http,
    ):
        state = (await http.get(f"/v1/batches/{BATCH}")).json()
    assert [line for line in said if f"{path}:1: not a rollout result, skipped" in line], said
    # Its rollout counts as not done: the batch is interrupted, one rollout without a result.
    assert state["status"] == "interrupted" and state["results"] == 2
    assert state["counts"]["done"] == 1


async def test_a_result_json_cannot_hold_is_result_error_and_the_batch_goes_on(
    emulator: Emulator, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad_prompt = TASKS[2].prompt

    def script(body: dict[str, Any]) -> Reply:
        prompt = next(m["content"] for m in body["messages"] if m["role"] == "user")
        if prompt == bad_prompt:  # a file name that is not UTF-8, in the model's text
            return FakeRawResponse(json.dumps(completion("found a\udc80b.txt")))
        return completion("done")

    settings = load_settings(service={"state_dir": tmp_path}, service_token=TOKEN)
    async with (
        FakeChatServer(script) as server,
        open_store(tmp_path) as store,
        RolloutPool(settings, api_key=emulator.api_key, base_url=emulator.base_url) as pool,
    ):
        service = Service(pool, settings, store=store)
        policy = {"kind": "openai", "base_url": server.base_url, "model": "fake"}
        body = {**BODY, "policy": policy, "samples_per_task": 1}
        async with (
            serve_app(create_app(service), "127.0.0.1", 0) as url,
            httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as http,
        ):
            created = await http.post("/v1/batches", json=body)
            assert created.status_code == 201, created.text
            with caplog.at_level(logging.WARNING, logger="fleetroll.rollout.machine"):
                seen, last = await read_stream(http, 0)
            groups = await http.get(f"/v1/batches/{BATCH}/groups")
    assert last == {"type": "end", "cursor": len(TASKS), "status": "finished"}
    assert len(seen) == len(TASKS)  # every result kept
    bad = [r for _, r in seen if r.task_key == TASKS[2].key]
    assert [(r.failure_reason, r.reward) for r in bad] == [(FailureReason.RESULT_ERROR, None)]
    assert "content holds a lone surrogate (U+DC80)" in (bad[0].error or "")
    # Said once, where the stand-in is made (the rollout's machine: every view serves it).
    said = [m for rec in caplog.records if "as result_error" in (m := rec.getMessage())]
    assert len(said) == 1 and "kept as result_error" in said[0], said
    assert groups.status_code == 200 and groups.text.count('"type":"group"') == len(TASKS)
    # The journal holds them as streamed, and reads back after a restart.
    assert [r for _, r in seen] == read_journal(store.journal_path(BATCH), latest=False)


async def test_every_view_of_a_result_json_cannot_hold_serves_the_journal_s_stand_in(
    emulator: Emulator, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The model's text holds a lone surrogate: the journal keeps result_error. Its
    # events (the route and FleetrollClient.follow), its batch's state and its
    # telemetry say the same, and nothing answers 500 or loses a record.
    bad_task = TASKS[2]
    bad_id = rollout_id(BATCH, bad_task.key, 0)

    def script(body: dict[str, Any]) -> Reply:
        prompt = next(m["content"] for m in body["messages"] if m["role"] == "user")
        if prompt == bad_task.prompt:  # a file name that is not UTF-8, in the model's text
            return FakeRawResponse(json.dumps(completion("found a\udc80b.txt")))
        return completion("done")

    db = tmp_path / "telemetry" / "telemetry.db"
    settings = load_settings(
        service={"state_dir": tmp_path / "state"},
        service_token=TOKEN,
        telemetry={"db_path": str(db), "send_to_logfire": False},
    )
    async with (
        FakeChatServer(script) as server,
        open_telemetry(
            settings.telemetry, secrets=settings.secrets(), logfire_token=settings.logfire_token
        ) as events,
        open_store(tmp_path / "state") as store,
        RolloutPool(
            settings, api_key=emulator.api_key, base_url=emulator.base_url, events=events
        ) as pool,
    ):
        service = Service(pool, settings, store=store)
        policy = {"kind": "openai", "base_url": server.base_url, "model": "fake"}
        body = {**BODY, "policy": policy, "samples_per_task": 1}
        async with serve_app(create_app(service), "127.0.0.1", 0) as url:
            async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as http:
                created = await http.post("/v1/batches", json=body)
                assert created.status_code == 201, created.text
                seen, last = await read_stream(http, 0)
                with anyio.fail_after(30), caplog.at_level(logging.ERROR):
                    answer = await http.get(f"/v1/rollouts/{bad_id}/events?after=0")
                state = await http.get(f"/v1/batches/{BATCH}")
            async with FleetrollClient(url, token=TOKEN, max_retries=0) as client:
                with anyio.fail_after(30):
                    followed = [e async for e in client.follow(bad_id)]
    assert last["type"] == "end" and len(seen) == len(TASKS)
    journaled = {r.rollout_id: r for r in read_journal(store.journal_path(BATCH))}
    stand_in = journaled[bad_id]
    assert (stand_in.failure_reason, stand_in.reward) == (FailureReason.RESULT_ERROR, None)
    assert [r for _, r in seen if r.rollout_id == bad_id] == [stand_in]
    # The events route: 200, every line JSON, the model's text with its surrogate
    # escaped as the journal escapes it, and an end that is the journal's.
    assert answer.status_code == 200, answer.text
    lines = [json.loads(line) for line in answer.text.splitlines()]
    kinds = [m["event"] for m in lines if m["type"] == "event"]
    assert [e["preview"] for e in kinds if e["kind"] == "turn"] == ["found a\\udc80b.txt"]
    end = {k: kinds[-1][k] for k in ("kind", "status", "failure_reason", "reward", "error")}
    expected = {
        "kind": "end",
        "status": "failed",
        "failure_reason": "result_error",
        "reward": None,
        "error": cut(stand_in.error or "", settings.pool.events_preview_chars),
    }
    assert end == expected
    assert "content holds a lone surrogate (U+DC80)" in (stand_in.error or "")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    # FleetrollClient.follow hears the same, at once.
    assert [e.kind for e in followed] == [e["kind"] for e in kinds]
    assert {k: followed[-1].data[k] for k in end if k != "kind"} == {
        k: v for k, v in expected.items() if k != "kind"
    }
    # The batch's state counts it as the journal does.
    assert state.status_code == 200 and state.json()["status"] == "finished"
    # Telemetry: one completed row per rollout, the bad one's the stand-in's.
    completed = queries.batch_costs(db, BATCH)
    assert [(b["batch_id"], b["completed"]) for b in completed] == [(BATCH, len(TASKS))]
    check = queries.check(db, BATCH)
    assert check.ok and check.rollouts == len(TASKS), check
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT attributes FROM records WHERE message = 'fleet_rollout_completed'"
        ).fetchall()
    attributes = [json.loads(a) for (a,) in rows]
    bad = [a for a in attributes if a["task_key"] == bad_task.key]
    assert [(a["status"], a["failure_reason"], a["error_message"]) for a in bad] == [
        ("failed", "result_error", stand_in.error)
    ]


async def test_a_request_that_cannot_be_kept_is_refused_and_the_service_says_why(
    emulator: Emulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fleetroll.service.state as state

    def disk_full(path: Path, data: bytes) -> None:  # the lowest write of a request
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    settings = load_settings(service={"state_dir": tmp_path}, service_token=TOKEN)
    async with (
        open_store(tmp_path) as store,
        RolloutPool(settings, api_key=emulator.api_key, base_url=emulator.base_url) as pool,
    ):
        monkeypatch.setattr(state, "_write_atomically", disk_full)
        service = Service(pool, settings, store=store)
        async with (
            serve_app(create_app(service), "127.0.0.1", 0) as url,
            httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as http,
        ):
            refused = await http.post("/v1/batches", json=BODY)
            batch = await http.get(f"/v1/batches/{BATCH}")
            health = await http.get("/healthz")
            again = await http.post("/v1/batches", json=BODY)
    # Never accepted: it would not have survived a restart.
    assert refused.status_code == 503, refused.text
    assert "No space left on device" in refused.json()["detail"]
    assert batch.json()["status"] == "interrupted" and batch.json()["results"] == 0
    assert health.status_code == 503 and "No space left" in health.json()["error"]
    assert again.status_code == 503
    assert list(tmp_path.glob("batches/*.jsonl*")) == []

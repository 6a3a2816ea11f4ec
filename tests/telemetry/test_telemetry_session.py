"""Setting telemetry up: twice in a process, console verbosity, secrets kept out."""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from telemetry_helpers import local_settings

from fleetroll.emulator import Emulator, FaultProfile
from fleetroll.errors import PolicyError
from fleetroll.policies import AssistantTurn, ScriptedPolicy, ToolSpec
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import TaskSpec, load_tasks
from fleetroll.telemetry import MemorySink, Redactor, Telemetry, open_telemetry
from fleetroll.telemetry.events import Event
from fleetroll.telemetry.sinks import console_level
from fleetroll.telemetry.store import connect

SETTINGS = load_settings()
LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)
FAST = {"creates_per_second": 1000, "backoff_initial_s": 0.01, "backoff_max_s": 0.05}


def messages(db: Path) -> list[str]:
    conn = connect(db, readonly=True)
    try:
        return [m for (m,) in conn.execute("SELECT message FROM records ORDER BY start_timestamp")]
    finally:
        conn.close()


def test_two_set_ups_in_one_process_each_keep_exactly_their_own_records(tmp_path: Path) -> None:
    first, second = tmp_path / "first.db", tmp_path / "second.db"
    with Telemetry(local_settings(first).telemetry) as one:
        with Telemetry(local_settings(second).telemetry) as two:
            one.events.emit("fleet_make_retry")
            two.events.emit("fleet_make_failed")
        one.events.emit("fleet_env_reset_failed")  # closing one set-up leaves the other working
    with Telemetry(local_settings(first).telemetry) as again:  # and setting up again is fine
        again.events.emit("fleet_mcp_tool_error")
    assert messages(first) == ["fleet_make_retry", "fleet_env_reset_failed", "fleet_mcp_tool_error"]
    assert messages(second) == ["fleet_make_failed"]


async def test_open_telemetry_flushes_everything_on_exit_even_when_cancelled(
    tmp_path: Path,
) -> None:
    db = tmp_path / "t.db"
    with anyio.move_on_after(30) as scope:
        async with open_telemetry(local_settings(db).telemetry) as events:
            for i in range(200):
                events.emit("fleet_make_retry", i=i)
            scope.cancel()
            await anyio.sleep(3600)
    assert scope.cancelled_caught
    assert len(messages(db)) == 200


async def test_an_attribute_with_a_lone_surrogate_is_stored_escaped_and_costs_no_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A tool's error naming a file whose name is not UTF-8: UTF-8 cannot encode it,
    # and the store lost the event with every record of its flush.
    db = tmp_path / "t.db"
    name = "a\udc80b.txt"
    with caplog.at_level(logging.ERROR, logger="fleetroll.telemetry"):
        async with open_telemetry(local_settings(db).telemetry) as events:
            events.emit("fleet_make_retry", i=0)
            events.emit(
                "fleet_rollout_completed",
                level="warn",
                status="failed",
                error_message=f"cannot open {name}",
                files=[name, {"name": name}],
            )
            events.emit("fleet_make_retry", i=1)
    assert not caplog.records, caplog.text
    conn = connect(db, readonly=True)
    try:
        rows = conn.execute("SELECT message, attributes FROM records ORDER BY rowid").fetchall()
    finally:
        conn.close()
    names = [m for m, _ in rows]
    assert names == ["fleet_make_retry", "fleet_rollout_completed", "fleet_make_retry"]
    completed = json.loads(rows[1][1])
    escaped = "a\\udc80b.txt"  # as the journal writes it
    assert completed["error_message"] == f"cannot open {escaped}"
    assert completed["files"] == [escaped, {"name": escaped}]


def test_the_console_shows_batches_and_failures_but_not_every_rollout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with Telemetry(local_settings(tmp_path / "t.db").telemetry) as telemetry:
        events = telemetry.events
        events.emit("fleet_batch_started", batch_id="b7", rollouts=2)
        with events.bind(batch_id="b7", rollout_id="r-ok", env_key="ledger"):
            events.emit("fleet_rollout_started")
            events.emit("fleet_provisioning_completed", provisioning_time_s=0.2)
            events.emit("fleet_rollout_completed", status="completed", failure_reason=None)
        with events.bind(batch_id="b7", rollout_id="r-bad", env_key="ledger"):
            events.emit("fleet_rollout_started")
            events.emit("fleet_make_retry", level="warn", attempt=1)
            events.emit(
                "fleet_rollout_completed",
                level="warn",
                status="failed",
                failure_reason="init_error",
                error_message="provisioning failed after 5 attempts",
            )
        events.emit("fleet_batch_completed", batch_id="b7", rollouts=2)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 3, err
    assert "fleet_batch_started" in lines[0] and "batch_id=b7" in lines[0]
    assert "warning" in lines[1] and "rollout_id=r-bad" in lines[1]
    assert "failure_reason=init_error" in lines[1] and "env_key=ledger" in lines[1]
    assert "fleet_batch_completed" in lines[2]
    assert "r-ok" not in err and "fleet_make_retry" not in err


def test_console_level_debug_shows_every_event(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = local_settings(tmp_path / "t.db", telemetry={"console_level": "debug"})
    with (
        Telemetry(
            settings.telemetry, secrets=settings.secrets(), logfire_token=settings.logfire_token
        ) as telemetry,
        telemetry.events.bind(rollout_id="r1"),
    ):
        telemetry.events.emit("fleet_rollout_started")
        telemetry.events.emit("fleet_rollout_completed", failure_reason=None)
    err = capsys.readouterr().err
    assert "fleet_rollout_started" in err and "fleet_rollout_completed" in err


def test_an_abandoned_create_is_a_console_line_only_when_its_instance_may_run_on() -> None:
    def level(outcome: str) -> int:
        return console_level(Event("fleet_create_abandoned", "info", {"outcome": outcome}))

    assert [level(o) for o in ("released", "failed", "release_failed")] == [logging.DEBUG] * 3
    assert level("cut") == logging.WARNING


def test_the_redactor_masks_known_secrets_headers_and_credential_fields() -> None:
    redact = Redactor(["k3y-0f-the-fleet"])
    assert redact("auth failed for k3y-0f-the-fleet!") == "auth failed for [REDACTED]!"
    assert "abc.def" not in redact("Authorization: Bearer abc.def")
    assert "abc.def" not in redact("{'authorization': 'Token abc.def'}")
    assert "s3cr3t" not in redact("GET /x?api_key=s3cr3t&page=2")
    assert redact("GET /x?api_key=s3cr3t&page=2").endswith("&page=2")
    assert "pylf_v1_us_abcdef" not in redact("token pylf_v1_us_abcdef rejected")
    assert redact("MCP session closed; max_tokens=1024") == "MCP session closed; max_tokens=1024"
    attrs = redact.attributes(
        {"api_key": "zz", "headers": {"X-Api-Key": "zz"}, "n": 3, "errors": ["k3y-0f-the-fleet"]}
    )
    assert attrs == {
        "api_key": "[REDACTED]",
        "headers": {"X-Api-Key": "[REDACTED]"},
        "n": 3,
        "errors": ["[REDACTED]"],
    }


FLEET_KEY = "fleetkey-7c1e5b9a3d"
LOGFIRE_TOKEN = "lftoken-2f8e4a6c0b"
OPENAI_KEY = "oaikey-9d3b7f1a5e"
SECRETS = (FLEET_KEY, LOGFIRE_TOKEN, OPENAI_KEY)


class LeakyPolicy(ScriptedPolicy):
    """A policy whose errors quote every credential it knows."""

    async def act(
        self, task: TaskSpec, messages: Sequence[Any], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        if task.key == LEDGER[0].key:
            raise PolicyError(
                f"401 from the model endpoint: key {OPENAI_KEY} rejected "
                f"(headers: Authorization: Bearer {OPENAI_KEY}; fleet {FLEET_KEY}; "
                f"logfire {LOGFIRE_TOKEN})",
                operation="policy",
            )
        return await super().act(task, messages, tools)


async def test_no_secret_reaches_a_record_or_a_console_line_even_inside_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "secrets.db"
    monkeypatch.setenv("FLEET_API_KEY", FLEET_KEY)
    monkeypatch.setenv("LOGFIRE_TOKEN", LOGFIRE_TOKEN)
    monkeypatch.setenv("OPENAI_API_KEY", OPENAI_KEY)
    monkeypatch.setenv("FLEETROLL_TELEMETRY__DB_PATH", str(db))
    monkeypatch.setenv("FLEETROLL_TELEMETRY__SEND_TO_LOGFIRE", "false")  # stay offline
    monkeypatch.setenv("FLEETROLL_TELEMETRY__CONSOLE_LEVEL", "debug")  # print every event
    monkeypatch.setenv("FLEETROLL_PROVISIONING__MAX_ATTEMPTS", "2")
    settings = load_settings()
    assert settings.logfire_token is not None and settings.openai_api_key is not None
    key = settings.fleet_api_key.get_secret_value() if settings.fleet_api_key else ""
    assert key == FLEET_KEY
    settings = settings.model_copy(
        update={"provisioning": settings.provisioning.model_copy(update=FAST)}
    )
    memory = MemorySink()
    results = []
    async with open_telemetry(
        settings.telemetry,
        secrets=settings.secrets(),
        logfire_token=settings.logfire_token,
        extra_sinks=[memory],
    ) as events:
        # The emulator wants another key: every create fails authentication.
        async with (
            Emulator(api_key="some-other-key") as emu,
            RolloutPool(settings, api_key=key, base_url=emu.base_url, events=events) as p,
        ):
            with anyio.fail_after(60):
                results += await p.run_batch(LEDGER[:2], ScriptedPolicy()).results()
        # The right key, a policy that quotes credentials, verifier errors.
        async with (
            Emulator(FaultProfile(p_verifier_error=0.5), api_key=key) as emu,
            RolloutPool(settings, api_key=key, base_url=emu.base_url, events=events) as p,
        ):
            with anyio.fail_after(60):
                results += await p.run_batch(LEDGER[:4], LeakyPolicy()).results()
        events.emit(
            "fleet_worker_lost",
            level="error",
            request=f"POST /v1/env/instances\nAuthorization: Bearer {FLEET_KEY}\n",
            headers={"Authorization": f"Bearer {FLEET_KEY}", "x-openai-key": OPENAI_KEY},
            note=f"token {LOGFIRE_TOKEN} in a nested list",
            notes=[f"see {FLEET_KEY}"],
        )
    out, err = capfd.readouterr()

    reasons = {r.failure_reason for r in results}
    assert {FailureReason.INIT_ERROR, FailureReason.POLICY_ERROR} <= reasons, reasons
    assert any("[REDACTED]" in str(e.attributes) for e in memory.events)  # the test bites
    for secret in SECRETS:
        assert secret not in out and secret not in err, f"{secret} reached the console"
        assert secret not in str([e.attributes for e in memory.events])
    conn = sqlite3.connect(db)
    try:
        dump = "\n".join(conn.iterdump())
    finally:
        conn.close()
    assert "fleet_worker_lost" in dump and "fleet_rollout_completed" in dump
    files = [p for p in tmp_path.iterdir() if p.name.startswith("secrets.db")]
    for secret in SECRETS:
        assert secret not in dump, f"{secret} reached a record"
        for file in files:  # the raw bytes too: the WAL, free pages
            assert secret.encode() not in file.read_bytes(), f"{secret} is in {file.name}"

"""Fleet trace upload (``[traces]``): every finished rollout posted to the emulator's trace API.

End to end: a real pool, the SDK, the emulator's ``/v1/traces/jobs`` and
``/v1/sessions/ingest`` over loopback, and what the emulator received.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from fleetroll.emulator import Emulator, FaultProfile
from fleetroll.environments.fleet.traces import trace_messages
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import RolloutResult
from fleetroll.settings import Settings, config_dir, load_settings
from fleetroll.tasks import TaskSpec, load_tasks
from fleetroll.telemetry import Events, MemorySink
from fleetroll.telemetry.events import Redactor

SETTINGS = load_settings()
LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)
DESKTOP = load_tasks(config_dir() / "tasks" / "desktop.jsonl", modalities=SETTINGS.modalities)
FAST = {"creates_per_second": 1000, "backoff_initial_s": 0.05, "backoff_max_s": 0.5}
SECRET = "sk-trace-secret-0123456789abcdef"


def settings_for(**traces: Any) -> Settings:
    return load_settings(provisioning=FAST, traces=traces, openai_api_key=SECRET)


async def run(
    emu: Emulator, settings: Settings, tasks: list[TaskSpec], sink: MemorySink
) -> list[RolloutResult]:
    pool = RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url, events=Events([sink]))
    with anyio.fail_after(60):
        async with pool:
            results = await pool.run_batch(tasks, ScriptedPolicy()).results()
    return results


@pytest.mark.slow
async def test_a_batch_with_upload_on_holds_one_job_and_one_session_per_rollout() -> None:
    sink = MemorySink()
    tasks = LEDGER[:3]
    async with Emulator() as emu:
        results = await run(emu, settings_for(upload=True), tasks, sink)
        jobs, sessions = list(emu.traces.jobs), emu.traces.sessions
    assert [r.reward for r in results] == [1.0, 1.0, 1.0]
    assert len(jobs) == 1 and results[0].batch_id in jobs[0].name
    assert len(sessions) == len(results)
    by_rollout = {s.metadata["rollout_id"]: s for s in sessions if s.metadata}
    for result in results:
        session = by_rollout[result.rollout_id]
        assert session.job_id == jobs[0].job_id
        assert session.task_key == result.task_key
        assert session.instance_id == result.instance_id
        assert session.status == "completed"
        assert result.verifier is not None and result.verifier.execution_id
        assert session.verifier_execution_id == result.verifier.execution_id
        assert session.metadata is not None and session.metadata["reward"] == 1.0
        assert [m["role"] for m in session.messages] == [m["role"] for m in result.transcript]
    assert sink.named("fleet_trace_upload_failed") == sink.named("fleet_trace_dropped") == []


@pytest.mark.slow
async def test_with_upload_off_nothing_is_posted() -> None:
    sink = MemorySink()
    async with Emulator() as emu:
        results = await run(emu, settings_for(), LEDGER[:2], sink)
        assert list(emu.traces.jobs) == [] and emu.traces.sessions == []
    assert [r.reward for r in results] == [1.0, 1.0]


@pytest.mark.slow
async def test_a_failing_trace_api_is_events_and_every_result_stays_intact() -> None:
    sink = MemorySink()
    async with Emulator(FaultProfile(p_trace_5xx=1.0)) as emu:
        results = await run(emu, settings_for(upload=True), LEDGER[:3], sink)
        assert emu.traces.sessions == []
    assert [(r.status, r.reward) for r in results] == [("completed", 1.0)] * 3
    failed = sink.named("fleet_trace_upload_failed")
    assert len(failed) == 3
    assert {e.attributes["operation"] for e in failed} == {"trace_job"}
    assert {e.attributes["rollout_id"] for e in failed} == {r.rollout_id for r in results}
    assert sink.named("fleet_trace_dropped") == []


@pytest.mark.slow
async def test_a_hanging_trace_api_holds_the_pool_only_for_the_bounded_flush() -> None:
    sink = MemorySink()
    # One post at a time and room for one more: of four traces, two at least are dropped;
    # the post that hangs is given up when the flush runs out, long before upload_s.
    settings = settings_for(upload=True, max_parallel=1, max_queued=1, upload_s=600, flush_s=0.5)
    async with Emulator(FaultProfile(p_trace_hang=1.0)) as emu:
        results = await run(emu, settings, LEDGER[:4], sink)
    assert [(r.status, r.reward) for r in results] == [("completed", 1.0)] * 4
    (dropped,) = sink.named("fleet_trace_dropped")
    assert dropped.attributes["queue_full"] >= 2
    assert dropped.attributes["not_flushed"] >= 1
    assert dropped.attributes["queue_full"] + dropped.attributes["not_flushed"] == 4


@pytest.mark.slow
async def test_secrets_in_a_transcript_never_reach_the_trace_api() -> None:
    sink = MemorySink()
    task = LEDGER[0].model_copy(update={"prompt": f"{LEDGER[0].prompt} (key {SECRET})"})
    async with Emulator() as emu:
        (result,) = await run(emu, settings_for(upload=True), [task], sink)
        (session,) = emu.traces.sessions
    assert SECRET not in str(session.messages) and SECRET not in str(session.metadata)
    assert Redactor.MASK in str(session.messages)
    assert result.reward == 1.0


@pytest.mark.slow
async def test_screenshots_are_uploaded_inline_though_results_elide_them() -> None:
    sink = MemorySink()
    async with Emulator() as emu:
        (result,) = await run(emu, settings_for(upload=True), DESKTOP[:1], sink)
        (session,) = emu.traces.sessions
    assert "data:image/" not in str(result.transcript)
    assert "data:image/" in str(session.messages)


def test_trace_messages_redact_text_keep_images_and_move_other_keys_to_metadata() -> None:
    image = "data:image/png;base64,iVBORw0KGgo="
    messages = [
        {"role": "user", "content": f"use {SECRET}"},
        {
            "role": "tool",
            "tool_call_id": "c1",
            "name": "screenshot",
            "content": [{"type": "image_url", "image_url": {"url": image}}],
        },
    ]
    out = trace_messages(messages, Redactor([SECRET]))
    assert out[0] == {"role": "user", "content": f"use {Redactor.MASK}"}
    assert out[1]["content"][0]["image_url"]["url"] == image
    assert out[1]["tool_call_id"] == "c1" and out[1]["metadata"] == {"name": "screenshot"}

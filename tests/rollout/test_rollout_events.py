"""A rollout's live event log on the provider double: order, cursor, bounds, redaction."""

from __future__ import annotations

import json
from typing import Any

import anyio

from fleetroll.policies import ScriptedPolicy, ToolCall
from fleetroll.pool.assembly import rollout_config
from fleetroll.results import RolloutResult
from fleetroll.rollout.engine import RolloutEngine
from fleetroll.rollout.events import RolloutEvent, RolloutEventLog, ndjson_lines
from fleetroll.rollout.machine import Rollout, RolloutIds
from fleetroll.settings import load_settings
from fleetroll.tasks import SolutionStep, TaskSpec
from fleetroll.telemetry.events import Events, MemorySink, Redactor
from fleetroll.testing.fake_provider import FakeProvider
from fleetroll.tools.session import ToolResult

TASK = TaskSpec(
    key="note-done",
    prompt="Write done.",
    env_key="fake",
    modality="tool_use",
    verifier_func="def verify(env):\n    return 1.0\n",
    solution=(SolutionStep(name="note", arguments={"word": "done"}),),
)


async def run(task: TaskSpec = TASK, **overrides: Any) -> tuple[Rollout, RolloutResult]:
    settings = load_settings(**overrides)
    provider = FakeProvider(settings.modalities, timeouts=settings.timeouts)
    async with RolloutEngine.open(
        rollout_config(settings), Events([MemorySink()]), provider
    ) as eng:
        rollout = eng.rollout(task, RolloutIds("b", "r"))
        with anyio.fail_after(10):
            result = await rollout.run(ScriptedPolicy())
    return rollout, result


def kinds(events: tuple[RolloutEvent, ...]) -> list[str]:
    """Each event's kind, a phase event as its phase."""
    return [str(e.data["phase"]) if e.kind == "phase" else e.kind for e in events]


async def test_the_log_holds_every_phase_turn_and_tool_call_in_order_then_the_end() -> None:
    rollout, result = await run()

    page = rollout.live.read()
    assert kinds(page.events) == [
        "provisioning",
        "resetting",
        "connecting",
        "acting",
        "turn",  # the note call
        "tool_call",
        "turn",  # no tool call: the episode is over
        "verifying",
        "releasing",
        "done",
        "end",
    ]
    assert [e.seq for e in page.events] == list(range(1, len(page.events) + 1))
    assert page.ended and page.missed == 0
    call = next(e for e in page.events if e.kind == "tool_call")
    assert call.data["name"] == "note" and call.data["is_error"] is False
    assert call.data["preview"] == "noted done" and json.loads(call.data["arguments"]) == {
        "word": "done"
    }
    assert call.data["duration_s"] >= 0
    turn = next(e for e in page.events if e.kind == "turn")
    assert turn.data["tool_calls"] == ["note"] and turn.data["latency_s"] >= 0
    end = page.events[-1].data
    assert (end["status"], end["failure_reason"], end["reward"]) == (
        result.status,
        None,
        result.reward,
    )


async def test_a_reader_resumes_after_its_cursor_and_gets_nothing_twice() -> None:
    rollout, _ = await run()
    everything = rollout.live.read().events

    first, rest = everything[:4], rollout.live.read(after=4).events

    assert first + rest == everything
    assert rollout.live.read(after=rollout.live.last).events == ()


async def test_the_log_keeps_only_the_newest_events_and_says_how_many_a_late_reader_missed() -> (
    None
):
    many = TASK.model_copy(
        update={
            "solution": tuple(SolutionStep(name="note", arguments={"word": "x"}) for _ in range(20))
        }
    )
    rollout, _ = await run(many, pool={"events_max": 8, "max_steps": 50})

    page = rollout.live.read(after=0)

    assert len(page.events) == 8 and page.events[-1].kind == "end"
    assert page.missed == rollout.live.last - 8
    assert page.events[0].seq == page.missed + 1


async def test_previews_are_redacted_then_cut_to_the_preview_size() -> None:
    secret = "Bearer sk-live-0123456789abcdef"
    leaky = TASK.model_copy(
        update={"solution": (SolutionStep(name="note", arguments={"word": secret}),)}
    )
    rollout, _ = await run(leaky, pool={"events_preview_chars": 30})

    call = next(e for e in rollout.live.read().events if e.kind == "tool_call")

    assert "sk-live" not in call.data["arguments"] + call.data["preview"]
    assert "[REDACTED]" in call.data["preview"]
    assert len(call.data["arguments"]) <= 31 and len(call.data["preview"]) <= 31


def a_result() -> RolloutResult:
    return RolloutResult(
        rollout_id="r",
        batch_id="b",
        task_key="k",
        env_key="fake",
        modality="tool_use",
        status="completed",
        reward=1.0,
    )


class Phased:
    def __init__(self, phase: str) -> None:
        self.phase = phase


async def test_the_ndjson_stream_waits_for_new_events_and_ends_after_the_end() -> None:
    log = RolloutEventLog(cap=16, preview_chars=50, redact=lambda text: text)
    lines: list[dict[str, Any]] = []

    async def read() -> None:
        stream = ndjson_lines(log.page, 0, heartbeat_s=3600, stopping=lambda: False)
        async for chunk in stream:
            lines.extend(json.loads(line) for line in chunk.decode().splitlines())

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.wait_all_tasks_blocked()
            log.observe(Phased("provisioning"))
            await anyio.wait_all_tasks_blocked()
            assert [line["cursor"] for line in lines] == [1]
            log.end(a_result())

    assert [line["type"] for line in lines] == ["event", "event"]
    assert [line["event"]["kind"] for line in lines] == ["phase", "end"]
    assert lines[1]["event"]["reward"] == 1.0 and lines[1]["cursor"] == 2


async def test_a_reader_behind_what_the_log_holds_gets_a_gap_line_then_the_rest() -> None:
    log = RolloutEventLog(cap=8, preview_chars=50, redact=lambda text: text)
    for n in range(12):
        log.observe(Phased(f"phase-{n}"))
    log.end(a_result())

    chunks = [c async for c in ndjson_lines(log.page, 2, heartbeat_s=1, stopping=lambda: False)]
    lines = [json.loads(line) for c in chunks for line in c.decode().splitlines()]

    assert lines[0] == {"type": "gap", "cursor": 2, "missed": 3}
    assert [line["cursor"] for line in lines[1:]] == list(range(6, 14))
    assert lines[-1]["event"]["kind"] == "end"


def test_a_known_secret_across_the_preview_cut_of_a_large_answer_is_masked() -> None:
    secret = "s3cr3t-value-0123456789"
    log = RolloutEventLog(cap=8, preview_chars=40, redact=Redactor([secret]))
    answer = "x" * 30 + secret + "y" * 1_000_000  # the secret spans the cut at 40

    log.tool_call(ToolCall(id="c", name="read", arguments={}), ToolResult(answer), duration_s=0)

    preview = log.read().events[0].data["preview"]
    assert "s3cr3t" not in preview and preview.startswith("x" * 30 + "[REDACTED]")
    assert len(preview) == 41  # cut to the preview size, and the ellipsis

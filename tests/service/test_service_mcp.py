"""The MCP tools at /mcp, driven by a real MCP client over streamable HTTP."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from mcp import Client
from service_helpers import LEDGER, Running, running_service, task_record

from fleetroll import tasks
from fleetroll.emulator import Emulator, FaultProfile
from fleetroll.rollout.transcript import Transcript
from fleetroll.testing.fake_openai import (
    FakeChatServer,
    FakeRawResponse,
    Reply,
    completion,
    tool_call,
)

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow


def structured(result: Any) -> dict[str, Any]:
    assert not result.is_error, result.content
    assert isinstance(result.structured_content, dict)
    return result.structured_content


async def test_an_mcp_client_starts_polls_and_finalizes_a_rollout(
    served: Running, emulator: Emulator
) -> None:
    task = task_record(LEDGER[2])
    with anyio.fail_after(60):
        async with Client(f"{served.url}/mcp") as mcp:
            names = {tool.name for tool in (await mcp.list_tools()).tools}
            started = structured(await mcp.call_tool("start_rollout", {"task": task}))
            rollout_id = started["rollout_id"]
            state = structured(await mcp.call_tool("get_state", {"rollout_id": rollout_id}))
            final = structured(await mcp.call_tool("finalize_rollout", {"rollout_id": rollout_id}))
            after = structured(await mcp.call_tool("get_state", {"rollout_id": rollout_id}))
            transcript = structured(
                await mcp.call_tool("get_messages", {"rollout_id": rollout_id, "after": 1})
            )
            unknown = await mcp.call_tool("get_state", {"rollout_id": "nope"})
    assert names == {
        "run_rollout",
        "start_rollout",
        "get_state",
        "get_messages",
        "abort_rollout",
        "finalize_rollout",
    }
    assert state["rollout_id"] == rollout_id and state["task_key"] == LEDGER[2].key
    assert final["rollout_id"] == rollout_id and final["reward"] == 1.0
    assert after["done"] and after["phase"] == "done" and after["steps"] == final["steps"]
    assert transcript["done"] and transcript["messages"][0]["role"] == "assistant"
    assert transcript["next"] == len(final["transcript"])
    assert unknown.is_error and "no rollout 'nope'" in unknown.content[0].text
    assert emulator.ledger.running == 0


async def test_an_mcp_client_aborts_a_rollout_and_runs_one_to_the_end(served: Running) -> None:
    slow = {"kind": "scripted", "think_time_s": 3600}
    with anyio.fail_after(60):
        async with Client(f"{served.url}/mcp") as mcp:
            started = structured(
                await mcp.call_tool(
                    "start_rollout", {"task": task_record(LEDGER[3]), "policy": slow}
                )
            )
            await mcp.call_tool("abort_rollout", {"rollout_id": started["rollout_id"]})
            aborted = structured(
                await mcp.call_tool("finalize_rollout", {"rollout_id": started["rollout_id"]})
            )
            ran = structured(await mcp.call_tool("run_rollout", {"task": task_record(LEDGER[4])}))
            invalid = await mcp.call_tool("run_rollout", {"task": {"key": "k", "prompt": "p"}})
    assert aborted["failure_reason"] == "cancelled" and aborted["reward"] is None
    assert ran["reward"] == 1.0
    assert invalid.is_error and "env_key" in invalid.content[0].text


async def test_get_state_on_a_running_rollout_does_not_export_its_transcript(
    served: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    exports: list[int] = []
    real = Transcript.export

    def export(self: Transcript, redact: Callable[[str], str], *, keep_images: bool) -> Any:
        exports.append(len(self))
        return real(self, redact, keep_images=keep_images)

    monkeypatch.setattr(Transcript, "export", export)
    slow = {"kind": "scripted", "think_time_s": 3600}
    with anyio.fail_after(60):
        async with Client(f"{served.url}/mcp") as mcp:
            started = structured(
                await mcp.call_tool(
                    "start_rollout", {"task": task_record(LEDGER[5]), "policy": slow}
                )
            )
            rollout_id = started["rollout_id"]
            states = [
                structured(await mcp.call_tool("get_state", {"rollout_id": rollout_id}))
                for _ in range(20)
            ]
            exported_by_get_state = len(exports)
            await mcp.call_tool("get_messages", {"rollout_id": rollout_id})
            exported_by_get_messages = len(exports) - exported_by_get_state
            await mcp.call_tool("abort_rollout", {"rollout_id": rollout_id})
            await mcp.call_tool("finalize_rollout", {"rollout_id": rollout_id})
    assert all(not s["done"] and s["rollout_id"] == rollout_id for s in states)
    assert exported_by_get_state == 0 and exported_by_get_messages == 1


async def test_a_task_given_to_start_rollout_or_a_session_is_checked_off_the_event_loop(
    served: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[int] = []
    real = tasks._compile_check

    def compile_check(code: str) -> str:
        threads.append(threading.get_ident())
        return real(code)

    monkeypatch.setattr(tasks, "_compile_check", compile_check)
    task = {**task_record(LEDGER[0]), "verifier_func": "x = 1\n"}  # no function: refused
    with anyio.fail_after(60):
        async with Client(f"{served.url}/mcp") as mcp, served.http() as http:
            refused = await mcp.call_tool("start_rollout", {"task": task})
            session = await http.post("/v1/sessions", json={"task": task})
    assert refused.is_error and "defines no top-level function" in refused.content[0].text
    assert session.status_code == 422
    assert session.json()["detail"][0]["loc"] == ["body", "task", "verifier_func"]
    assert len(threads) == 2 and threading.get_ident() not in threads


async def test_a_model_s_text_json_cannot_hold_is_served_as_its_result_error(
    served: Running,
) -> None:
    # The model names a file that is not UTF-8 (JSON's \udc80 escape): the rollout's
    # result is the journal's stand-in (result_error), for finalize_rollout,
    # get_state and get_messages alike, never an error of the tool.
    async def script(body: dict[str, Any]) -> Reply:
        return FakeRawResponse(json.dumps(completion("found a\udc80b.txt")))

    async with FakeChatServer(script) as server:
        policy = {"kind": "openai", "base_url": server.base_url, "model": "fake"}
        with anyio.fail_after(60):
            async with Client(f"{served.url}/mcp") as mcp:
                started = structured(
                    await mcp.call_tool(
                        "start_rollout", {"task": task_record(LEDGER[6]), "policy": policy}
                    )
                )
                rollout_id = started["rollout_id"]
                final = structured(
                    await mcp.call_tool("finalize_rollout", {"rollout_id": rollout_id})
                )
                state = structured(await mcp.call_tool("get_state", {"rollout_id": rollout_id}))
                messages = structured(
                    await mcp.call_tool("get_messages", {"rollout_id": rollout_id})
                )
    assert (final["status"], final["failure_reason"], final["reward"]) == (
        "failed",
        "result_error",
        None,
    )
    assert "content holds a lone surrogate (U+DC80)" in final["error"]
    assert final["transcript"] == []
    assert messages == {"rollout_id": rollout_id, "messages": [], "next": 0, "done": True}
    assert (state["done"], state["failure_reason"], state["reward"]) == (True, "result_error", None)


async def test_a_running_rollout_s_messages_serve_a_model_s_text_json_cannot_hold_escaped() -> None:
    # The model names a file that is not UTF-8 and calls a tool, which hangs: while
    # it does, get_messages serves the text escaped as the journal escapes it.
    task = LEDGER[6]
    assert task.solution
    step = task.solution[0]

    def script(body: dict[str, Any]) -> Reply:
        call = tool_call(step.name, dict(step.arguments), id="call_0")
        return FakeRawResponse(json.dumps(completion("found a\udc80b.txt", [call])))

    async with (
        Emulator(FaultProfile(p_tool_hang=1.0)) as emu,
        running_service(emu) as served,
        FakeChatServer(script) as server,
        served.http() as http,
    ):
        policy = {"kind": "openai", "base_url": server.base_url, "model": "fake"}
        with anyio.fail_after(60):
            async with Client(f"{served.url}/mcp") as mcp:
                started = structured(
                    await mcp.call_tool(
                        "start_rollout", {"task": task_record(task), "policy": policy}
                    )
                )
                rollout_id = started["rollout_id"]
                # Its turn is in its live events: its transcript holds the text.
                path = f"/v1/rollouts/{rollout_id}/events?after=0"
                async with http.stream("GET", path) as events:
                    async for line in events.aiter_lines():
                        message = json.loads(line)
                        if message["type"] == "event" and message["event"]["kind"] == "turn":
                            break
                live = await mcp.call_tool("get_messages", {"rollout_id": rollout_id})
                await mcp.call_tool("abort_rollout", {"rollout_id": rollout_id})
                final = structured(
                    await mcp.call_tool("finalize_rollout", {"rollout_id": rollout_id})
                )
    assert message["event"]["preview"] == "found a\\udc80b.txt"
    texts = [m.get("content") for m in structured(live)["messages"] if m["role"] == "assistant"]
    assert texts == ["found a\\udc80b.txt"]
    assert (final["failure_reason"], final["reward"]) == ("result_error", None)
    assert "it had ended cancelled" in final["error"]

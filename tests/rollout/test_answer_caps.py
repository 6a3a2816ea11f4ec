"""MCP answers are read only up to their caps (pool.max_tool_answer_bytes,
pool.max_tool_listing_bytes), counted while they are read, over HTTP and stdio."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx2
import pytest
from big_answer_server import answer
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.message import SessionMessage
from mcp_types import JSONRPCError, JSONRPCRequest, JSONRPCResponse

from fleetroll.environments.mcp.process import LineReader
from fleetroll.errors import ToolCallFailed, ToolsError
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.assembly import rollout_config
from fleetroll.rollout.engine import RolloutEngine
from fleetroll.rollout.machine import RolloutIds
from fleetroll.settings import load_settings
from fleetroll.tasks import SolutionStep, TaskSpec
from fleetroll.telemetry.events import Events
from fleetroll.testing.fake_provider import FakeProvider
from fleetroll.tools.mcp_client import SdkClient
from fleetroll.tools.session import ANSWER_TOO_LARGE, AnswerLimits, BoundedAnswers, ToolSession

LIMITS = AnswerLimits(answer_bytes=64 * 1024, listing_bytes=16 * 1024)
URL = "http://mcp.test/mcp"


class Served:
    """An MCP server in a mock transport (the test server's answers), counting what
    of each answer was pulled and whether its body was closed."""

    def __init__(self, size: int, *, tools: int = 0, sse: bool = False) -> None:
        self.size, self.tools, self.sse = size, tools, sse
        self.pulled = 0  # bytes of answers read from the "socket"
        self.closed = 0  # bodies closed
        self.listings = 0

    async def __call__(self, request: httpx2.Request) -> httpx2.Response:
        if request.method != "POST":
            return httpx2.Response(405)
        message = json.loads(request.content)
        self.listings += message.get("method") == "tools/list"
        pieces = answer(message, self.size, self.tools)
        if pieces is None:
            return httpx2.Response(202)
        if self.sse:
            pieces = iter([b"event: message\ndata: ", *pieces, b"\n\n"])
            kind = "text/event-stream"
        else:
            kind = "application/json"
        return httpx2.Response(200, headers={"content-type": kind}, stream=Body(self, pieces))


class Body(httpx2.AsyncByteStream):
    def __init__(self, served: Served, pieces: Iterator[bytes]) -> None:
        self._served, self._pieces = served, pieces

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self._pieces:
            self._served.pulled += len(piece)
            yield piece

    async def aclose(self) -> None:
        self._served.closed += 1


@asynccontextmanager
async def session_on(served: Served) -> AsyncIterator[ToolSession]:
    transport = BoundedAnswers(httpx2.MockTransport(served), LIMITS)
    event_bytes = max(LIMITS.answer_bytes, LIMITS.listing_bytes)
    async with (
        httpx2.AsyncClient(transport=transport) as http,
        Client(
            streamable_http_client(URL, http_client=http, max_sse_event_size=event_bytes),
            read_timeout_seconds=10,
        ) as client,
    ):
        yield ToolSession(SdkClient(client), URL, call_timeout_s=10, list_timeout_s=10)


async def call(served: Served, name: str) -> Any:
    """The tool's answer, or the exception it raised (caught inside the session, as
    a rollout catches it)."""
    with anyio.fail_after(20):
        async with session_on(served) as session:
            try:
                return await session.call(name, {})
            except Exception as exc:
                return exc


async def list_tools(served: Served) -> Any:
    with anyio.fail_after(20):
        async with session_on(served) as session:
            try:
                return await session.list_tools()
            except Exception as exc:
                return exc


async def test_a_json_tool_answer_over_its_cap_is_not_read_past_it_and_fails_saying_so() -> None:
    served = Served(size=4 * 1024 * 1024)  # 1 MiB pieces: the first one passes 64 KiB

    failed = await call(served, "big")

    assert isinstance(failed, ToolCallFailed)
    assert str(failed).startswith("big: the MCP server's answer to tools/call is over")
    assert "pool.max_tool_answer_bytes (65536 bytes)" in str(failed)
    assert not failed.transient  # the same call would answer as much again
    assert served.pulled < LIMITS.answer_bytes + 1024 * 1024 + 1024  # never the 4 MiB
    assert served.closed >= 1


async def test_a_session_goes_on_after_an_answer_over_its_cap() -> None:
    served = Served(size=4 * 1024 * 1024)
    with anyio.fail_after(20):
        async with session_on(served) as session:
            with pytest.raises(ToolCallFailed):
                await session.call("big", {})
            small = await session.call("small", {})
    assert small.text == "ok" and not small.is_error


async def test_a_json_tool_answer_within_its_cap_is_read_whole() -> None:
    result = await call(Served(size=60 * 1024), "big")
    assert result.text == "x" * (60 * 1024)


async def test_an_sse_tool_answer_over_its_cap_fails_saying_so() -> None:
    served = Served(size=4 * 1024 * 1024, sse=True)

    failed = await call(served, "big")

    assert isinstance(failed, ToolCallFailed) and "pool.max_tool_answer_bytes" in str(failed)
    assert served.pulled < LIMITS.answer_bytes + 1024 * 1024 + 1024


async def test_a_listing_over_its_cap_is_a_tools_error_not_tried_again() -> None:
    served = Served(size=10, tools=200)  # ~50 KB of tools: over 16 KiB, under 64 KiB

    failed = await list_tools(served)

    assert isinstance(failed, ToolsError) and "pool.max_tool_listing_bytes" in str(failed)
    assert not failed.transient and served.listings == 1


# -- stdio: LineReader ----------------------------------------------------------


def response_line(rid: int, text: str) -> bytes:
    result = {"content": [{"type": "text", "text": text}]}
    return json.dumps({"jsonrpc": "2.0", "id": rid, "result": result}).encode() + b"\n"


def request(rid: int, method: str) -> JSONRPCRequest:
    return JSONRPCRequest(jsonrpc="2.0", id=rid, method=method, params={})


def fed(reader: LineReader, data: bytes, chunk: int) -> list[SessionMessage | Exception]:
    out: list[SessionMessage | Exception] = []
    for start in range(0, len(data), chunk):
        out += reader.feed(data[start : start + chunk])
    return out


def test_a_stdio_line_split_over_many_chunks_is_one_message() -> None:
    data = response_line(1, "y" * 40_000) + response_line(2, "z")

    out = fed(LineReader(LIMITS), data, chunk=1000)

    assert [type(m) for m in out] == [SessionMessage, SessionMessage]
    first, second = (m.message for m in out if isinstance(m, SessionMessage))
    assert isinstance(first, JSONRPCResponse) and first.id == 1
    assert first.result["content"][0]["text"] == "y" * 40_000
    assert isinstance(second, JSONRPCResponse) and second.id == 2


def test_a_stdio_answer_over_its_cap_becomes_an_error_for_its_request_and_the_next_line_reads() -> (
    None
):
    data = response_line(7, "x" * 200_000) + response_line(8, "ok")

    out = fed(LineReader(LIMITS), data, chunk=4096)

    assert len(out) == 2
    error, after = (m.message for m in out if isinstance(m, SessionMessage))
    assert isinstance(error, JSONRPCError) and error.id == 7
    assert error.error.code == ANSWER_TOO_LARGE
    assert "pool.max_tool_answer_bytes" in error.error.message
    assert isinstance(after, JSONRPCResponse) and after.id == 8


def test_a_stdio_listing_has_the_listing_cap() -> None:
    reader = LineReader(LIMITS)
    reader.sent(request(3, "tools/list"))
    reader.sent(request(4, "tools/call"))
    data = response_line(3, "x" * 30_000) + response_line(4, "x" * 30_000)

    out = fed(reader, data, chunk=4096)

    listing, answered = (m.message for m in out if isinstance(m, SessionMessage))
    assert isinstance(listing, JSONRPCError) and listing.id == 3
    assert "pool.max_tool_listing_bytes" in listing.error.message
    assert isinstance(answered, JSONRPCResponse) and answered.id == 4


def test_a_stdio_line_over_its_cap_answering_nothing_of_ours_is_an_exception() -> None:
    line = json.dumps({"jsonrpc": "2.0", "method": "note", "params": {"t": "x" * 100_000}})

    out = fed(LineReader(LIMITS), line.encode() + b"\n", chunk=8192)

    assert len(out) == 1 and isinstance(out[0], ValueError)
    assert "pool.max_tool_answer_bytes" in str(out[0])


# -- what a finished rollout keeps ------------------------------------------------------


async def test_a_finished_rollout_lets_go_of_its_tool_listing_and_session() -> None:
    settings = load_settings()
    task = TaskSpec(
        key="note-done",
        prompt="Write done.",
        env_key="fake",
        verifier_func="def verify(env):\n    return 1.0\n",
        solution=(SolutionStep(name="note", arguments={"word": "done"}),),
    )
    async with RolloutEngine.open(
        rollout_config(settings),
        Events([]),
        FakeProvider(settings.modalities, timeouts=settings.timeouts),
    ) as engine:
        rollout = engine.rollout(task, RolloutIds("b", "r"))
        seen: list[int] = []
        rollout.observers.append(lambda r: seen.append(len(r.tools)))
        with anyio.fail_after(10):
            result = await rollout.run(ScriptedPolicy())

    assert result.reward == 1.0 and max(seen) > 0  # it had tools while it acted
    assert rollout.tools == [] and rollout.session is None

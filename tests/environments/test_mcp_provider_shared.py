"""A shared MCP server over loopback (``environment.url``): each rollout is scored
on the state it left, and a failed reset is never scored.

One notes server (the example, served over streamable HTTP) holds one folder
for every rollout; ``begin`` (the tasks' reset) and ``finish`` (their
verifier) count the rollouts between their reset and their verdict, so the
server itself says how many used it at once.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from fleetroll.examples_mcp.notes_server import build
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.service import serve_app
from fleetroll.settings import load_settings
from fleetroll.tasks import TaskSpec, parse_task

pytestmark = pytest.mark.slow

NOWHERE = "http://127.0.0.1:9"  # no Fleet: a batch of mcp tasks must not need one
SOLVE = [{"name": "write_file", "arguments": {"path": "status.txt", "content": "done"}}]
LOOK = [{"name": "list_files", "arguments": {}}]  # acts, and leaves the state as it was


@dataclass
class Server:
    """The shared server's URL and what it saw."""

    url: str
    folder: Path
    in_flight: int = 0
    most: int = 0


@asynccontextmanager
async def shared_server(tmp_path: Path) -> AsyncIterator[Server]:
    folder = tmp_path / "served"
    folder.mkdir()
    (folder / "status.txt").write_text("done")  # a previous rollout's state
    mcp = build(folder, hang_tool=True)
    server = Server("", folder)

    @mcp.tool(description="A rollout begins: back to an empty folder (the reset).")
    def begin() -> str:
        for path in folder.rglob("*"):
            if path.is_file():
                path.unlink()
        server.in_flight += 1
        server.most = max(server.most, server.in_flight)
        return "ready"

    @mcp.tool(description="A rollout ends: 1.0 when status.txt says done (the verifier).")
    def finish() -> float:
        server.in_flight -= 1
        status = folder / "status.txt"
        return 1.0 if status.is_file() and status.read_text() == "done" else 0.0

    async with serve_app(mcp.streamable_http_app(), "127.0.0.1", 0) as url:
        server.url = f"{url}/mcp"
        yield server


def task(key: str, server: Server, solution: list[dict[str, Any]], **environment: Any) -> TaskSpec:
    record = {
        "key": key,
        "prompt": "Say it is done.",
        "environment": {"url": server.url, "reset": {"tool": {"name": "begin"}}, **environment},
        "verifier": {"tool": {"name": "finish"}},
        "solution": solution,
    }
    return parse_task(record, source="test", modalities={"tool_use"})


def pool_in(root: Path) -> RolloutPool:
    settings = load_settings(
        timeouts={"mcp_connect_s": 20.0, "call_tool_s": 20.0},
        mcp={"workdir_root": str(root)},
    )
    return RolloutPool(settings, api_key="unused", base_url=NOWHERE)


async def run(tasks: list[TaskSpec], root: Path, *, samples: int = 1) -> list[RolloutResult]:
    with anyio.fail_after(120):
        async with pool_in(root) as pool:
            batch = pool.run_batch(tasks, ScriptedPolicy(), samples_per_task=samples)
            return await batch.results()


async def test_a_shared_server_whose_reset_fails_gives_no_reward_not_the_last_state_s(
    tmp_path: Path,
) -> None:
    async with shared_server(tmp_path) as server:
        reset = {"http": {"method": "POST", "url": f"{server.url}-reset?token=s3cr3t-value"}}
        did_nothing = task("did-nothing", server, [], reset=reset)  # status.txt still says done
        # Two samples: the second gets the server once the first gave it back.
        results = await run([did_nothing], tmp_path / "workdirs", samples=2)

    for result in results:
        assert result.reward is None and result.verifier is None  # not 1.0 from the last state
        assert result.failure_reason is FailureReason.RESET_FAILED
        assert result.error is not None and f"POST {server.url}-reset" in result.error
        assert "HTTP 404" in result.error and "s3cr3t" not in result.error


async def test_six_rollouts_on_one_shared_server_each_get_their_own_reward(
    tmp_path: Path,
) -> None:
    async with shared_server(tmp_path) as server:
        tasks = [task("solves", server, SOLVE), task("only-looks", server, LOOK)]
        results = await run(tasks, tmp_path / "workdirs", samples=3)

    rewards = sorted((r.task_key, r.reward) for r in results)
    assert rewards == [("only-looks", 0.0)] * 3 + [("solves", 1.0)] * 3
    assert all(r.failure_reason is None for r in results)
    assert server.most == 1 and server.in_flight == 0  # one at a time: the default


async def test_a_shared_server_declaring_two_serves_at_most_two_rollouts_at_once(
    tmp_path: Path,
) -> None:
    async with shared_server(tmp_path) as server:
        looks = task("only-looks", server, LOOK, max_concurrent_rollouts=2)
        results = await run([looks], tmp_path / "workdirs", samples=6)

    assert [r.failure_reason for r in results] == [None] * 6
    assert server.most == 2 and server.in_flight == 0


async def test_a_rollout_cancelled_while_it_holds_the_server_gives_it_back(tmp_path: Path) -> None:
    async with shared_server(tmp_path) as server, pool_in(tmp_path / "workdirs") as pool:
        hangs = task("hangs", server, [{"name": "hang", "arguments": {}}])
        with anyio.fail_after(60):
            [cancelled] = await pool.run_batch([hangs], ScriptedPolicy(), deadline_s=2).results()
            # The same pool (the same leases): the next rollout gets the server.
            [after] = await pool.run_batch(
                [task("looks", server, LOOK)], ScriptedPolicy()
            ).results()

    assert cancelled.failure_reason is FailureReason.CANCELLED
    assert after.failure_reason is None and after.reward == 0.0


class NotUtf8Names:
    """ASGI in front of a server: ``list_files`` answers a file name that is not
    UTF-8, as a server escaping it writes it (a lone surrogate, ``\\udc80``)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        params = request.get("params") or {}
        if request.get("method") == "tools/call" and params.get("name") == "list_files":
            answer = b'{"jsonrpc":"2.0","id":%s,"result":{"resultType":"complete",' % (
                json.dumps(request["id"]).encode()
            )
            answer += b'"content":[{"type":"text","text":"[\\"report-\\udc80.txt\\"]"}],'
            answer += b'"structuredContent":{"result":["report-\\udc80.txt"]}}}'
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(answer)).encode()),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": answer})
            return
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


@pytest.mark.parametrize("client", ["thin", "sdk"])
async def test_a_tool_answer_that_is_not_valid_json_text_fails_the_call_on_both_clients(
    tmp_path: Path, client: str
) -> None:
    """A lone surrogate escape is JSON Python's json reads and the SDK's parser
    refuses: the thin client took it as a result whose text then crashed the
    run's journal (0 of 6 kept); the call fails, and each result serialises."""
    folder = tmp_path / "served"
    folder.mkdir()
    app = NotUtf8Names(build(folder).streamable_http_app())
    settings = load_settings(
        timeouts={"mcp_connect_s": 20.0, "call_tool_s": 20.0},
        mcp={"workdir_root": str(tmp_path / "workdirs")},
        pool={"mcp_client": client},
    )
    async with serve_app(app, "127.0.0.1", 0) as url:
        record = {
            "key": "looks",
            "prompt": "List the files.",
            "environment": {"url": f"{url}/mcp", "max_concurrent_rollouts": 6},
            "verifier": {"command": ["{python}", "-c", "print(1.0)"]},
            "solution": LOOK,
        }
        looks = parse_task(record, source="test", modalities={"tool_use"})
        with anyio.fail_after(120):
            async with RolloutPool(settings, api_key="unused", base_url=NOWHERE) as pool:
                batch = pool.run_batch([looks], ScriptedPolicy(), samples_per_task=6)
                results = await batch.results()

    assert [r.failure_reason for r in results] == [FailureReason.TOOL_FAILURE] * 6
    for result in results:
        assert result.reward is None
        assert result.error is not None and "Failed to parse JSON response" in result.error
        result.model_dump_json().encode("utf-8")  # what the journal writes

"""A 200 MB tool answer, from a real MCP server, against real fleetroll processes:
``fleetroll serve`` (HTTP) keeps its memory, and a stdio server's answer is cut
at its cap; either way the rollout is a ``tool_failure`` and the batch goes on.
A chat answer that never ends is cut at its cap over real HTTP."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from subprocess import DEVNULL, PIPE
from typing import Any

import anyio
import httpx
import pytest
from anyio.abc import Process
from anyio.streams.text import TextReceiveStream

from fleetroll.errors import PolicyError
from fleetroll.policies import OpenAIChatPolicy, ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason, RolloutResult
from fleetroll.settings import load_settings
from fleetroll.tasks import TaskSpec, parse_task

pytestmark = pytest.mark.slow

SERVER = str(Path(__file__).with_name("big_answer_server.py"))
TOKEN = "answer-caps-test-token-0123456789"
MB = 1024 * 1024


def task(key: str, tool: str, environment: dict[str, Any]) -> dict[str, Any]:
    return {
        "key": key,
        "prompt": f"Call {tool}.",
        "environment": environment,
        "verifier": {"tool": {"name": "score", "arguments": {}}},
        "solution": [{"name": tool, "arguments": {}}],
    }


async def first_line(stream: Any, pattern: str) -> re.Match[str]:
    """The first match of ``pattern`` in what ``stream`` prints, line by line."""
    seen = ""
    async for text in TextReceiveStream(stream):
        seen += text
        if found := re.search(pattern, seen):
            return found
    raise AssertionError(f"never printed {pattern!r}: {seen[-2000:]}")


@asynccontextmanager
async def started(argv: list[str], **kwargs: Any) -> AsyncIterator[Process]:
    process = await anyio.open_process(argv, stdin=DEVNULL, stdout=PIPE, stderr=PIPE, **kwargs)
    try:
        yield process
    finally:
        with anyio.CancelScope(shield=True):
            process.terminate()
            with anyio.move_on_after(10):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
            for stream in (process.stdout, process.stderr):
                if stream is not None:
                    await stream.aclose()


def memory_kb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak) of ``pid``, in KiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return {k: int(v.split()[0]) for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(.+)$", status, re.M)}


async def batch(http: httpx.AsyncClient, tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run ``tasks`` on the service; their results, once the batch ended."""
    started_batch = await http.post("/v1/batches", json={"tasks": tasks})
    assert started_batch.status_code == 201, started_batch.text
    batch_id = started_batch.json()["batch_id"]
    results = []
    async with http.stream("GET", f"/v1/batches/{batch_id}/results") as stream:
        async for line in stream.aiter_lines():
            item = json.loads(line)
            if item["type"] == "result":
                results.append(item["result"])
            elif item["type"] == "end":
                return results
    raise AssertionError("the results stream ended without its end line")


@pytest.mark.timeout(240)
async def test_a_200_mb_tool_answer_leaves_the_service_rss_within_100_mb_of_its_baseline(
    tmp_path: Path,
) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLEET_", "FLEETROLL_", "LOGFIRE_", "OPENAI_"))
    }
    env |= {
        "FLEETROLL_TELEMETRY__DB_PATH": os.devnull,
        "FLEETROLL_MCP__WORKDIR_ROOT": str(tmp_path / "workdirs"),
        "FLEETROLL_SERVICE_TOKEN": TOKEN,  # serve always wants one (else it makes a file)
    }
    server_argv = [sys.executable, SERVER, "http", "--size", str(200 * MB)]
    serve_argv = [sys.executable, "-m", "fleetroll", "serve", "--port", "0"]
    with anyio.fail_after(200):
        async with (
            started(server_argv) as server,
            started(serve_argv, env=env, cwd=tmp_path) as service,
        ):
            port = (await first_line(server.stdout, r"port (\d+)")).group(1)
            url = (await first_line(service.stderr, r"fleetroll serve: (http://\S+) ")).group(1)
            environment = {"url": f"http://127.0.0.1:{port}/mcp", "name": "big"}
            headers = {"Authorization": f"Bearer {TOKEN}"}
            async with httpx.AsyncClient(base_url=url, timeout=120, headers=headers) as http:
                # Warm up (imports, pools, caches), then measure the baseline.
                warm = await batch(http, [task(f"warm-{i}", "small", environment) for i in (1, 2)])
                baseline = memory_kb(service.pid)["VmRSS"]
                results = await batch(
                    http, [task("big", "big", environment), task("small", "small", environment)]
                )
                after = memory_kb(service.pid)

    assert [r["reward"] for r in warm] == [1.0, 1.0]
    by_key = {r["task_key"]: r for r in results}
    big, small = by_key["big"], by_key["small"]
    assert big["failure_reason"] == "tool_failure" and big["reward"] is None
    assert "pool.max_tool_answer_bytes" in big["error"]
    assert small["failure_reason"] is None and small["reward"] == 1.0
    grew_mb = (after["VmHWM"] - baseline) / 1024
    assert grew_mb < 100, f"peak RSS {after['VmHWM']} KiB, baseline {baseline} KiB"


async def test_a_stdio_server_s_answer_over_its_cap_is_a_tool_failure_and_the_batch_goes_on(
    tmp_path: Path,
) -> None:
    settings = load_settings(
        mcp={"workdir_root": str(tmp_path / "workdirs"), "kill_grace_s": 1.0},
        pool={"max_tool_answer_bytes": MB},
    )
    environment = {"command": ["{python}", SERVER, "stdio", "--size", str(200 * MB)]}
    tasks = [
        parse_task(task(key, tool, environment), source="test", modalities={"tool_use"})
        for key, tool in (("big", "big"), ("small", "small"))
    ]
    with anyio.fail_after(90):
        async with RolloutPool(settings, api_key="unused", base_url="http://127.0.0.1:9") as pool:
            results: list[RolloutResult] = await pool.run_batch(tasks, ScriptedPolicy()).results()

    by_key = {r.task_key: r for r in results}
    big, small = by_key["big"], by_key["small"]
    assert big.failure_reason is FailureReason.TOOL_FAILURE and big.reward is None
    assert big.error is not None and "pool.max_tool_answer_bytes (1048576 bytes)" in big.error
    assert small.failure_reason is None and small.reward == 1.0


async def test_a_chat_answer_that_never_ends_is_cut_at_its_cap_over_real_http() -> None:
    from aiohttp import web

    sent = 0
    closed = anyio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        nonlocal sent
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        try:
            while True:
                await response.write(b" " * 65536)
                sent += 65536
        except (ConnectionError, RuntimeError):
            closed.set()  # the client closed the connection
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", endless)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        policy = OpenAIChatPolicy(
            base_url=f"http://127.0.0.1:{port}/v1", model="m", timeout_s=30, max_answer_bytes=MB
        )
        async with policy:
            with anyio.fail_after(60), pytest.raises(PolicyError) as failed:
                await policy.act(TaskSpec(key="t", prompt="p", env_key="e"), [], [])
            with anyio.fail_after(30):
                await closed.wait()
    finally:
        await runner.cleanup()

    assert "policy.max_answer_bytes (1048576 bytes)" in str(failed.value)
    assert not failed.value.transient
    assert sent < 64 * MB  # socket buffers aside, nothing was read past the cap

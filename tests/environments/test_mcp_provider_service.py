"""An mcp task over ``fleetroll serve``'s MCP verbs: start_rollout, get_state, finalize_rollout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from mcp import Client

from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.service import Service, create_app, serve_app
from fleetroll.settings import load_settings

pytestmark = pytest.mark.slow

SERVER = ["{python}", "{examples}/notes_server.py", "--root", "{workdir}"]
CHECK = "import pathlib; p = pathlib.Path('todo.txt'); print(1 if p.is_file() else 0)"


TASK = {
    "key": "notes-svc",
    "prompt": "Create todo.txt.",
    "environment": {"command": SERVER, "name": "notes"},
    "verifier": {"command": ["{python}", "-c", CHECK]},
    "solution": [{"name": "write_file", "arguments": {"path": "todo.txt", "content": "x"}}],
}


def structured(result: Any) -> dict[str, Any]:
    assert not result.is_error, result.content
    assert isinstance(result.structured_content, dict)
    return result.structured_content


async def test_an_mcp_task_runs_through_the_service_s_mcp_verbs_and_leaves_no_workdir(
    tmp_path: Path,
) -> None:
    root = tmp_path / "workdirs"
    settings = load_settings(mcp={"workdir_root": str(root)}, service={"allow_command_tasks": True})
    task = TASK
    with anyio.fail_after(60):
        # No Fleet at all: the service's pool must not need one for mcp tasks.
        async with RolloutPool(settings, api_key="unused", base_url="http://127.0.0.1:9") as pool:
            service = Service(pool, settings)
            async with (
                serve_app(create_app(service), "127.0.0.1", 0, before_stop=service.stop) as url,
                Client(f"{url}/mcp") as mcp,
            ):
                started = structured(await mcp.call_tool("start_rollout", {"task": task}))
                rid = started["rollout_id"]
                state = structured(await mcp.call_tool("get_state", {"rollout_id": rid}))
                final = structured(await mcp.call_tool("finalize_rollout", {"rollout_id": rid}))

    assert state["task_key"] == "notes-svc"
    assert final["reward"] == 1.0 and final["failure_reason"] is None
    assert final["env_key"] == "notes" and final["instance_id"].startswith("mcp-")
    assert not root.exists() or list(root.iterdir()) == []


async def test_a_service_refuses_tasks_that_run_host_commands_unless_allowed(
    tmp_path: Path,
) -> None:
    root = tmp_path / "workdirs"
    settings = load_settings(mcp={"workdir_root": str(root)})  # allow_command_tasks: off
    with anyio.fail_after(60):
        async with RolloutPool(settings, api_key="unused", base_url="http://127.0.0.1:9") as pool:
            service = Service(pool, settings)
            async with (
                serve_app(create_app(service), "127.0.0.1", 0, before_stop=service.stop) as url,
                Client(f"{url}/mcp") as mcp,
                httpx.AsyncClient(base_url=url) as http,
            ):
                refused = await mcp.call_tool("start_rollout", {"task": TASK})
                batch = await http.post("/v1/batches", json={"tasks": [TASK]})

    assert refused.is_error
    assert "allow_command_tasks" in str(refused.content)
    assert batch.status_code == 422
    detail = batch.json()["detail"][0]
    assert detail["loc"] == ["body", "tasks", 0]
    assert "runs commands on the service's host" in detail["msg"]
    assert not root.exists() or list(root.iterdir()) == []  # nothing was started

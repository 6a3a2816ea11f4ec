"""Helpers of the service tests: a running service (in this process, or ``fleetroll
serve`` as a child), task records, a gated policy."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
from anyio.abc import Process

from fleetroll.emulator import Emulator
from fleetroll.policies import AssistantTurn, ScriptedPolicy, ToolSpec
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.service import Service, create_app, serve_app
from fleetroll.settings import config_dir, load_settings
from fleetroll.tasks import TaskSpec, load_tasks

SETTINGS = load_settings()
LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)
FAST = {
    "creates_per_second": 1000,
    "max_concurrent_creates": 16,
    "backoff_initial_s": 0.05,
    "backoff_max_s": 0.5,
}


@dataclass
class Running:
    url: str
    service: Service

    def http(self, **headers: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=30)


@asynccontextmanager
async def running_service(emu: Emulator, **overrides: Any) -> AsyncIterator[Running]:
    """A service on its own port and pool, over ``emu``; settings from ``overrides``."""
    settings = load_settings(**{"provisioning": FAST, **overrides})
    async with RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url) as pool:
        service = Service(pool, settings)
        app = create_app(service)
        async with serve_app(app, "127.0.0.1", 0, before_stop=service.stop) as url:
            yield Running(url, service)


def task_record(task: TaskSpec) -> dict[str, Any]:
    """A task as a controller sends it: the line of the shipped task file."""
    return {
        "key": task.key,
        "prompt": task.prompt,
        "env_key": task.env_spec,
        "data_key": task.data_spec,
        "modality": task.modality,
        "verifier_func": task.verifier_func,
        "max_steps": task.max_steps,
        "solution": [s.model_dump() for s in task.solution or ()],
    }


class GatedPolicy(ScriptedPolicy):
    """Plays solutions, but holds the tasks in ``held`` until ``release`` is set."""

    def __init__(self, held: set[str]) -> None:
        super().__init__()
        self.held = held
        self.release = anyio.Event()

    async def act(
        self, task: TaskSpec, messages: Sequence[Any], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        if task.key in self.held:
            await self.release.wait()
        return await super().act(task, messages, tools)


#: The token of ``fleetroll serve`` as a child (:func:`serving`).
TOKEN = "a-restart-test-token-of-32-chars"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def serve_env(state: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLEET_", "FLEETROLL_", "LOGFIRE_", "OPENAI_", "OTEL_"))
    }
    return env | {
        "FLEETROLL_SERVICE_TOKEN": TOKEN,
        "FLEETROLL_TELEMETRY__DB_PATH": os.devnull,
        "FLEETROLL_SERVICE__STATE_DIR": str(state),
        "FLEETROLL_POOL__CONCURRENCY": "4",
    }


@asynccontextmanager
async def serving(
    tmp_path: Path, port: int, *args: str, emu: Emulator | None = None
) -> AsyncIterator[tuple[Process, list[str]]]:
    """``fleetroll serve`` on ``port`` over ``tmp_path/state``, once it listens; its stderr.

    ``args``: more of its options. On ``emu`` (this process's emulator) if given,
    else on its embedded one. Killed at the end if still running."""
    env = serve_env(tmp_path / "state")
    if emu is not None:
        env |= {"FLEET_BASE_URL": emu.base_url, "FLEET_API_KEY": emu.api_key}
    command = [sys.executable, "-m", "fleetroll", "serve", "--port", str(port), *args]
    said: list[str] = []
    process = await anyio.open_process(
        command,
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    listening = anyio.Event()

    async def read() -> None:
        assert process.stderr is not None
        tail = ""
        async for chunk in process.stderr:
            *lines, tail = (tail + chunk.decode()).split("\n")
            said.extend(lines)
            if any("  API: " in line for line in lines):
                listening.set()
        listening.set()  # it ended: the test sees why in ``said``

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        try:
            with anyio.fail_after(60):
                await listening.wait()
            assert process.returncode is None, "\n".join(said)
            yield process, said
        finally:
            with anyio.CancelScope(shield=True):
                if process.returncode is None:
                    process.kill()
                with anyio.fail_after(30):
                    await process.wait()
                tg.cancel_scope.cancel()
                await process.aclose()

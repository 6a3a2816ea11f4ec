"""Helpers of the service tests: a running service, task records, a gated policy."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

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

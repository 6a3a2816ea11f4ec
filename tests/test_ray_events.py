"""A rollout's live events on `serve --ray`: read from the actor running it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

ray = pytest.importorskip("ray")

from mcp import Client  # noqa: E402

from fleetroll.client import FleetrollClient  # noqa: E402
from fleetroll.emulator.process import EmulatorProcess  # noqa: E402
from fleetroll.pool import RolloutPool  # noqa: E402
from fleetroll.ray_pool import RayRolloutPool  # noqa: E402
from fleetroll.service import Service, create_app, serve_app  # noqa: E402
from fleetroll.settings import config_dir, load_settings  # noqa: E402
from fleetroll.tasks import TaskSpec, load_tasks  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SETTINGS = load_settings(
    provisioning={"creates_per_second": 500, "backoff_initial_s": 0.05, "backoff_max_s": 0.5}
)
LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)
ORDER = ["provisioning", "waiting", "resetting", "connecting", "acting", "verifying"]
ORDER += ["releasing", "done"]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def mcp_task(task: TaskSpec) -> dict[str, Any]:
    return {
        "key": task.key,
        "prompt": task.prompt,
        "env_key": task.env_spec,
        "data_key": task.data_spec,
        "modality": task.modality,
        "verifier_func": task.verifier_func,
        "solution": [s.model_dump() for s in task.solution or ()],
    }


def in_order(phases: list[str]) -> bool:
    """Each phase once, in the order a rollout goes through them (some may be missing:
    once the result is in, the actor lets the log go)."""
    positions = [ORDER.index(p) for p in phases]
    return positions == sorted(set(positions))


async def test_a_rollout_on_a_ray_actor_is_followed_live_and_reports_mcp_progress(
    local_ray: None,
) -> None:
    held = {"kind": "scripted", "think_time_s": 3600}
    progress: list[str] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")

    async with EmulatorProcess() as emu:
        fleet = {"api_key": emu.api_key, "base_url": emu.base_url}
        async with (
            RolloutPool(SETTINGS, **fleet) as local,
            RayRolloutPool(SETTINGS, **fleet, num_actors=1) as on_ray,
        ):
            service = Service(local, SETTINGS, batch_pool=on_ray)
            async with (
                serve_app(create_app(service), "127.0.0.1", 0, before_stop=service.stop) as url,
                Client(f"{url}/mcp") as mcp,
                FleetrollClient(url) as client,
            ):
                with anyio.fail_after(120):
                    started = await mcp.call_tool(
                        "start_rollout", {"task": mcp_task(LEDGER[3]), "policy": held}
                    )
                    assert isinstance(started.structured_content, dict)
                    rid = started.structured_content["rollout_id"]
                    followed = []
                    async for event in client.follow(rid):
                        followed.append(event)
                        if event.kind == "phase" and event.data["phase"] == "acting":
                            # Seen live, from the actor: the policy holds it there.
                            await mcp.call_tool("abort_rollout", {"rollout_id": rid})
                    ran = await mcp.call_tool(
                        "run_rollout", {"task": mcp_task(LEDGER[4])}, progress_callback=on_progress
                    )
            assert not (set(local.batches))  # everything ran on the actor
        ledger = await emu.ledger()

    phases = [e.data["phase"] for e in followed if e.kind == "phase"]
    assert phases[:5] == ORDER[:5] and in_order(phases)
    assert followed[-1].kind == "end" and followed[-1].data["failure_reason"] == "cancelled"
    assert not ran.is_error
    reported = [m.removeprefix("phase ") for m in progress if m.startswith("phase ")]
    assert reported[:5] == ORDER[:5] and in_order(reported)
    assert any(m.startswith("tool ") for m in progress)
    assert progress[-1] == "end: completed"
    assert ledger["running"] == 0

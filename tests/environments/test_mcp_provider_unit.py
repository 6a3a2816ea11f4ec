"""Unit tests of the mcp provider's guards: what it deletes, how it reads a reward,
and that a batch of only mcp tasks needs no Fleet key."""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import pytest

from fleetroll.environments.mcp.process import reward_number
from fleetroll.environments.mcp.provider import WORKDIR_PREFIX
from fleetroll.errors import ConfigError
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.assembly import mcp_provider, mixed_provider
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.settings import load_settings
from fleetroll.tasks import TaskSpec
from fleetroll.tasks.mcp import McpEnvironment
from fleetroll.telemetry import Events

FLEET_TASK = TaskSpec(key="ledger-001", prompt="Pay the rent.", env_key="ledger")
MCP_TASK = TaskSpec(
    key="notes-001",
    prompt="Write a note.",
    env_key="notes",
    environment=McpEnvironment(command=["{python}", "-c", "pass"]),
)
NO_KEY = re.escape(
    "task 'ledger-001' runs on Fleet (it has no 'environment') but the pool has no Fleet api_key"
)


@pytest.mark.parametrize("name", ["precious", f"{WORKDIR_PREFIX}elsewhere"])
def test_release_refuses_to_delete_a_folder_it_did_not_make(tmp_path: Path, name: str) -> None:
    root = tmp_path / "workdirs"
    root.mkdir()
    outside = (tmp_path if name.startswith(WORKDIR_PREFIX) else root) / name
    (outside / "work").mkdir(parents=True)
    provider = mcp_provider(load_settings(mcp={"workdir_root": str(root)}), Events())

    with pytest.raises(OSError, match="not a folder fleetroll made"):
        provider._remove(outside)

    assert (outside / "work").is_dir()


@pytest.mark.parametrize(
    ("line", "reward"),
    [("1", 1.0), (" 0.25 \n", 0.25), ("-1e0", -1.0), ("nan", None), ("inf", None), ("ok", None)],
)
def test_a_reward_line_is_a_finite_number_or_nothing(line: str, reward: float | None) -> None:
    assert reward_number(line) == reward


async def test_a_pool_without_a_fleet_key_refuses_a_batch_with_a_fleet_task_in_one_line() -> None:
    with anyio.fail_after(10):
        async with RolloutPool(load_settings()) as pool:
            with pytest.raises(ConfigError, match=NO_KEY) as caught:
                pool.run_batch([MCP_TASK, FLEET_TASK], ScriptedPolicy())

    assert "\n" not in str(caught.value)
    assert "FLEET_API_KEY" in str(caught.value)


async def test_without_a_fleet_key_only_a_fleet_task_fails_pre_flight_and_provisioning() -> None:
    provider = mixed_provider(load_settings(), Events())
    try:
        with pytest.raises(ConfigError, match=NO_KEY):
            await provider.preflight([MCP_TASK, FLEET_TASK])
        with pytest.raises(ConfigError, match=NO_KEY):
            await provider.provision(FLEET_TASK)
        assert await provider.preflight([MCP_TASK]) == []
    finally:
        await provider.aclose()


async def test_a_pool_without_a_fleet_key_refuses_to_upload_traces_to_fleet() -> None:
    pool = RolloutPool(load_settings(traces={"upload": True}))

    with pytest.raises(
        ConfigError, match=r"traces\.upload is on but the pool has no Fleet api_key"
    ):
        async with pool:
            pass

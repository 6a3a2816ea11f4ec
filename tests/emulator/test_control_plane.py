"""The real fleet-python SDK against the emulator's control plane and manager API."""

from __future__ import annotations

import anyio
import httpx
import pytest
from fleet._async.client import AsyncFleet
from fleet._async.exceptions import (
    FleetAuthenticationError,
    FleetEnvironmentNotFoundError,
    FleetVersionNotFoundError,
)
from fleet.models import InstanceResponse

from fleetroll.emulator import Emulator, FaultProfile
from fleetroll.errors import RolloutError
from fleetroll.pool.assembly import fleet_provider
from fleetroll.settings import load_settings
from fleetroll.tasks import TaskSpec
from fleetroll.telemetry import Events

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow


async def test_sdk_make_instance_reset_heartbeat_and_close_work(sdk) -> None:
    async with Emulator() as emu:
        fleet = sdk(emu)
        env = await fleet.make("ledger:v1", data_key="seed:v1", run_id="run-1")
        assert env.status == "running"
        assert env.urls is not None and env.urls.root.endswith("/")
        assert env.mcp.url == f"{env.urls.root}mcp"
        assert env.manager_url == f"{env.urls.root}api/v1/env"
        assert emu.ledger.running == 1

        again = await fleet.instance(env.instance_id)
        assert again.instance_id == env.instance_id and again.data_key == "seed"

        reset = await env.reset()
        assert reset.success
        beat = await env.heartbeat()
        assert beat.success and beat.instance_id == env.instance_id
        health = await env.instance.manager_health_check()
        assert health is not None and health.status == "healthy"

        closed = await env.close()
        assert isinstance(closed, InstanceResponse)
        assert closed.status == "stopped" and closed.terminated_at is not None
        assert emu.ledger.snapshot()["running"] == 0
        assert emu.ledger.deleted == 1 and emu.ledger.resets == 1


async def test_instances_are_listed_and_filtered_by_status_and_run_id(sdk) -> None:
    async with Emulator() as emu:
        fleet = sdk(emu)
        a = await fleet.make("ledger", run_id="run-a")
        b = await fleet.make("ledger", run_id="run-b")
        await fleet.make("ledger", run_id="run-b")
        await a.close()

        running = await fleet.instances(status="running")
        assert {e.run_id for e in running} == {"run-b"} and len(running) == 2
        assert [e.instance_id for e in await fleet.instances(run_id="run-a")] == [a.instance_id]

        deleted = await fleet.close_all(run_id="run-b")
        assert b.instance_id in {d.instance_id for d in deleted}
        assert emu.ledger.running == 0


async def test_environments_are_listed_with_their_versions(sdk) -> None:
    async with Emulator() as emu:
        envs = {e.env_key: e for e in await sdk(emu).list_envs()}
        assert "ledger" in envs and envs["ledger"].versions == {"v1": "v1"}
        ledger = await sdk(emu).environment("ledger")
        assert ledger.default_version == "v1"


async def test_unknown_environment_and_version_raise_the_sdks_typed_errors(sdk) -> None:
    async with Emulator() as emu:
        fleet = sdk(emu)
        with pytest.raises(FleetEnvironmentNotFoundError) as env_err:
            await fleet.make("nosuchenv:v1")
        assert env_err.value.env_key == "nosuchenv"
        with pytest.raises(FleetVersionNotFoundError) as ver_err:
            await fleet.make("ledger:v9")
        assert ver_err.value.version == "v9"
        assert emu.ledger.created == 0


async def test_a_wrong_api_key_is_refused_with_the_sdks_authentication_error() -> None:
    async with Emulator(api_key="the-right-key") as emu, httpx.AsyncClient() as http:
        fleet = AsyncFleet(
            api_key="a-wrong-key", base_url=emu.base_url, max_retries=0, httpx_client=http
        )
        with pytest.raises(FleetAuthenticationError):
            await fleet.make("ledger")
        ok = AsyncFleet(
            api_key="the-right-key", base_url=emu.base_url, max_retries=0, httpx_client=http
        )
        env = await ok.make("ledger")
        await env.close()


async def test_a_deleted_instance_is_not_found_on_its_manager_and_mcp_endpoints(sdk) -> None:
    async with Emulator() as emu:
        env = await sdk(emu).make("ledger")
        await env.close()
        async with httpx.AsyncClient() as client:
            reset = await client.post(f"{env.manager_url}/reset")
            mcp = await client.post(env.mcp.url, json={})
        assert reset.status_code == 404 and mcp.status_code == 404


async def test_sqlite_resource_queries_run_through_the_manager_api(sdk) -> None:
    async with Emulator() as emu:
        env = await sdk(emu).make("ledger", data_key="seed")
        resources = await env.resources()
        assert [r.resource.name for r in resources] == ["current"]
        result = await env.db("current").query("SELECT COUNT(*) FROM accounts")
        assert result.success and result.rows is not None and result.rows[0][0] > 0
        await env.close()


async def test_a_manager_query_cannot_attach_another_file(sdk, tmp_path) -> None:
    target = tmp_path / "elsewhere.db"
    async with Emulator() as emu:
        env = await sdk(emu).make("ledger", data_key="seed")
        await env.resources()
        result = await env.db("current").query(f"ATTACH DATABASE '{target}' AS other")
        assert not result.success and "not authorized" in (result.error or "")
        assert not target.exists()
        await env.close()


async def test_two_hundred_instances_alive_at_once_all_answer_tool_calls(sdk) -> None:
    from mcp import Client

    count = 200
    async with Emulator() as emu:
        fleet = sdk(emu)
        envs = []
        limiter = anyio.CapacityLimiter(50)

        async def make() -> None:
            async with limiter:
                envs.append(await fleet.make("ledger", data_key="seed"))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for _ in range(count):
                    tg.start_soon(make)
        assert emu.ledger.running == count and emu.ledger.peak_running == count
        answers: list[str] = []

        async def call(env) -> None:
            async with limiter, Client(env.mcp.url) as session:
                result = await session.call_tool("get_balance", {"account": "Checking"})
                assert not result.is_error
                answers.append(env.instance_id)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for env in envs:
                    tg.start_soon(call, env)
            async with anyio.create_task_group() as tg:
                for env in envs:
                    tg.start_soon(env.close)
        assert sorted(answers) == sorted(e.instance_id for e in envs)
        assert emu.ledger.running == 0 and emu.ledger.deleted == count


async def test_a_reset_leaves_nothing_a_query_made_in_the_connection(sdk) -> None:
    async with Emulator() as emu:
        env = await sdk(emu).make("ledger", data_key="seed")
        await env.resources()
        db = env.db("current")
        seeded = (await db.query("SELECT name, balance_cents FROM accounts ORDER BY name")).rows
        # A TEMP trigger lives in the connection, not the file: the next rollout's
        # writes would go through it after a reset that only copied the file.
        made = await db.query(
            "CREATE TEMP TRIGGER double AFTER UPDATE ON main.accounts"
            " BEGIN INSERT INTO transactions (date, description, from_account, to_account,"
            " amount_cents) VALUES ('2026-01-01', 'ghost', 'Checking', 'Rent', 1); END"
        )
        assert made.success
        await db.query("BEGIN")  # a transaction left open is rolled back too
        await db.query("UPDATE accounts SET balance_cents = 0")
        assert (await env.reset()).success
        after = (await db.query("SELECT name, balance_cents FROM accounts ORDER BY name")).rows
        assert after == seeded
        await db.query("UPDATE accounts SET balance_cents = balance_cents WHERE name = 'Rent'")
        ghosts = await db.query("SELECT COUNT(*) FROM transactions WHERE description = 'ghost'")
        assert ghosts.rows == [[0]]
        await env.close()


async def test_a_reset_fault_answers_no_success_and_the_fleet_provider_raises(sdk) -> None:
    settings = load_settings()
    async with Emulator(FaultProfile(p_reset_error=1.0)) as emu:
        provider = fleet_provider(settings, Events(), api_key=emu.api_key, base_url=emu.base_url)
        task = TaskSpec(key="t", prompt="p", env_key="ledger", data_key="seed")
        instance = await provider.provision(task)
        with pytest.raises(RolloutError, match="could not be reset") as caught:
            await provider.reset(instance, task)
        assert caught.value.operation == "reset"
        assert await provider.release(instance)
        await provider.aclose()
        assert emu.ledger.running == 0

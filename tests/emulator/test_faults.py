"""Every fault knob of the emulator does what it says."""

from __future__ import annotations

import anyio
import httpx
import pytest
from fleet._async.exceptions import FleetAPIError, FleetInstanceLimitError, FleetRateLimitError
from fleet._async.tasks import Task
from mcp import Client
from mcp.shared.exceptions import MCPError

from fleetroll.emulator import Emulator, FaultProfile, Latency
from fleetroll.emulator.faults import FaultInjector

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

#: How long a test waits to see that something does NOT answer. Only used for
#: faults that hold a request for an hour, so it is never a race.
NO_ANSWER_S = 0.5


async def answers_within(seconds: float, fn, *args) -> bool:
    with anyio.move_on_after(seconds) as scope:
        await fn(*args)
    return not scope.cancelled_caught


async def test_create_latency_holds_the_create(sdk) -> None:
    async with Emulator(FaultProfile(create_latency=Latency(min_s=3600))) as emu:
        assert not await answers_within(NO_ANSWER_S, sdk(emu).make, "ledger")
    async with Emulator(FaultProfile()) as emu:
        assert await answers_within(30, sdk(emu).make, "ledger")


async def test_the_provisioning_queue_serves_one_create_per_interval(sdk) -> None:
    async with Emulator(FaultProfile(create_queue_interval_s=3600)) as emu:
        fleet = sdk(emu)
        assert await answers_within(30, fleet.make, "ledger")
        assert not await answers_within(NO_ANSWER_S, fleet.make, "ledger")
        assert emu.ledger.created == 1


async def test_server_errors_raise_api_errors_with_5xx_codes_and_retryable_bodies(sdk) -> None:
    async with Emulator(FaultProfile(p_create_5xx=1.0, p_retryable_body=1.0)) as emu:
        statuses = set()
        for _ in range(12):
            with pytest.raises(FleetAPIError) as err:
                await sdk(emu).make("ledger")
            statuses.add(err.value.status_code)
            assert err.value.response_data["detail"]["retryable"] is True
        assert statuses <= {500, 502, 503} and len(statuses) > 1
        assert emu.ledger.created == 0
        assert sum(emu.ledger.creates_by_outcome.values()) == 12


async def test_rate_limits_answer_429_with_retry_after(sdk) -> None:
    async with Emulator(FaultProfile(p_create_429=1.0, retry_after_s=2.5)) as emu:
        with pytest.raises(FleetRateLimitError):
            await sdk(emu).make("ledger")
        async with httpx.AsyncClient() as client:
            raw = await client.post(
                f"{emu.base_url}/v1/env/instances",
                json={"env_key": "ledger"},
                headers={"Authorization": f"Bearer {emu.api_key}"},
            )
        assert raw.status_code == 429 and raw.headers["retry-after"] == "2.5"


async def test_an_account_rate_limit_answers_429_past_it_with_the_wait_for_the_next_token(
    sdk,
) -> None:
    async with Emulator(FaultProfile(create_rate_limit=2.0)) as emu:
        fleet = sdk(emu)
        made = [await fleet.make("ledger") for _ in range(2)]  # a second's worth at once
        async with httpx.AsyncClient() as client:
            raw = await client.post(
                f"{emu.base_url}/v1/env/instances",
                json={"env_key": "ledger"},
                headers={"Authorization": f"Bearer {emu.api_key}"},
            )
        assert raw.status_code == 429
        assert 0 < float(raw.headers["retry-after"]) <= 0.5
        assert emu.ledger.created == 2 and emu.ledger.creates_by_outcome["429"] == 1
        for env in made:
            await env.close()


async def test_the_instance_limit_answers_403_with_counts(sdk) -> None:
    async with Emulator(FaultProfile(instance_limit=1)) as emu:
        fleet = sdk(emu)
        first = await fleet.make("ledger")
        with pytest.raises(FleetInstanceLimitError) as err:
            await fleet.make("ledger")
        assert err.value.running_instances == 1 and err.value.instance_limit == 1
        await first.close()
        second = await fleet.make("ledger")
        await second.close()


async def test_a_hanging_create_does_not_answer(sdk) -> None:
    async with Emulator(FaultProfile(p_create_hang=1.0)) as emu:
        assert not await answers_within(NO_ANSWER_S, sdk(emu).make, "ledger")
        assert emu.ledger.created == 0


@pytest.mark.parametrize(
    "profile",
    [
        FaultProfile(p_create_hang=1.0, create_hang_s=3600),
        FaultProfile(create_latency=Latency(min_s=3600)),
    ],
    ids=["hang", "latency"],
)
async def test_a_slow_create_answers_504_once_the_clients_max_wait_has_passed(
    sdk, profile: FaultProfile
) -> None:
    async with Emulator(profile) as emu:
        with anyio.fail_after(30), pytest.raises(FleetAPIError) as err:
            await sdk(emu).make("ledger", max_wait_seconds=1)
        assert err.value.status_code == 504 and "max_wait_seconds=1" in str(err.value)
        assert emu.ledger.created == 0 and emu.ledger.running == 0


async def test_a_create_that_makes_no_instance_leaves_no_file_behind(sdk) -> None:
    # An instance's file is made while its create's latency runs (in a worker thread).
    async with Emulator(FaultProfile(create_latency=Latency(min_s=3600))) as emu:
        files = emu.store.data_dir
        with anyio.fail_after(30), pytest.raises(FleetAPIError):  # 504 past its max wait
            await sdk(emu).make("ledger", max_wait_seconds=1)
        assert not await answers_within(NO_ANSWER_S, sdk(emu).make, "ledger")  # it left
        with anyio.fail_after(10):
            while emu.ledger.creates_by_outcome.get("abandoned", 0) < 1:
                await anyio.sleep(0.02)
        assert emu.ledger.creates_by_outcome["timed_out"] == 1
        assert sorted(files.iterdir()) == []
    async with Emulator(FaultProfile(create_latency=Latency(min_s=0.2))) as emu:
        env = await sdk(emu).make("ledger")
        assert [p.name for p in emu.store.data_dir.iterdir()] == [f"{env.instance_id}.db"]
        await env.close()


async def test_mcp_endpoints_answer_503_while_the_instance_warms_up(sdk) -> None:
    async with Emulator(FaultProfile(mcp_warmup_s=3600)) as emu:
        env = await sdk(emu).make("ledger")
        async with httpx.AsyncClient() as client:
            for url in (env.mcp.url, f"{env.urls.root}api/v1/mcp"):
                response = await client.post(url, json={})
                assert response.status_code == 503
            health = await client.get(f"{env.manager_url}/health")
        assert health.status_code == 200
        assert emu.ledger.mcp_rejected_warming == 2
        await env.close()


async def test_tool_latency_holds_each_call(sdk) -> None:
    async with Emulator(FaultProfile(tool_latency=Latency(min_s=3600))) as emu:
        env = await sdk(emu).make("ledger")
        async with Client(env.mcp.url) as session:
            assert not await answers_within(NO_ANSWER_S, session.call_tool, "list_accounts", {})
        await env.close()


async def test_a_hanging_tool_call_times_out_on_the_client_and_the_session_survives(sdk) -> None:
    profile = FaultProfile(p_tool_hang=1.0)
    async with Emulator(profile) as emu:
        env = await sdk(emu).make("ledger")
        async with Client(env.mcp.url) as session:
            with pytest.raises(MCPError):
                await session.call_tool("list_accounts", {}, read_timeout_seconds=0.3)
            # The same session still answers (listing tools does not pass the gate).
            tools = await session.list_tools()
            assert tools.tools
        assert emu.ledger.tool_calls_by_outcome["hang"] == 1
        await env.close()


async def test_injected_tool_errors_come_back_as_mcp_tool_errors(sdk) -> None:
    async with Emulator(FaultProfile(p_tool_error=1.0)) as emu:
        env = await sdk(emu).make("ledger")
        async with Client(env.mcp.url) as session:
            result = await session.call_tool("list_accounts", {})
        assert result.is_error and "injected" in result.content[0].text
        await env.close()


async def test_a_hanging_reset_does_not_answer(sdk) -> None:
    async with Emulator(FaultProfile(p_reset_hang=1.0)) as emu:
        env = await sdk(emu).make("ledger")
        assert not await answers_within(NO_ANSWER_S, env.reset)
        await env.close()


async def test_a_dead_instance_reports_error_and_its_endpoints_are_gone(sdk) -> None:
    profile = FaultProfile(p_instance_death=1.0, death_after=Latency(min_s=0.0))
    async with Emulator(profile) as emu:
        env = await sdk(emu).make("ledger")
        again = await sdk(emu).instance(env.instance_id)
        assert again.status == "error"
        async with httpx.AsyncClient() as client:
            assert (await client.post(env.mcp.url, json={})).status_code == 404
        assert emu.ledger.died == 1 and emu.ledger.running == 0
        closed = await env.close()  # deleting a dead instance is harmless
        assert closed.status == "error" and emu.ledger.deleted == 0


async def test_instances_expire_when_their_ttl_passes(sdk) -> None:
    async with Emulator() as emu:
        env = await sdk(emu).make("ledger", ttl_seconds=60)
        inst = emu.store.get(env.instance_id)
        assert inst is not None
        emu.store.refresh(inst, now=inst.created_mono + 59)
        assert inst.alive
        emu.store.refresh(inst, now=inst.created_mono + 60)
        assert not inst.alive and (await sdk(emu).instance(env.instance_id)).status == "stopped"
        assert emu.ledger.expired == 1 and emu.ledger.running == 0


async def test_the_profiles_default_ttl_applies_when_a_create_sets_none(sdk) -> None:
    async with Emulator(FaultProfile(default_ttl_s=5)) as emu:
        env = await sdk(emu).make("ledger")
        inst = emu.store.get(env.instance_id)
        assert inst is not None and inst.ttl_s == 5
        await env.close()


async def test_injected_verifier_failures_answer_503(sdk) -> None:
    async with Emulator(FaultProfile(p_verifier_error=1.0)) as emu:
        env = await sdk(emu).make("ledger")
        task = Task(
            key="t",
            prompt="p",
            env_id="ledger",
            verifier_func="def verify(env, final_answer=None):\n    return 1.0\n",
        )
        with pytest.raises(FleetAPIError) as err:
            await task.verify_detailed_async(env, final_answer=None)
        assert err.value.status_code == 503
        await env.close()


def test_the_same_seed_draws_the_same_faults() -> None:
    profile = FaultProfile(seed=42, p_create_5xx=0.3, p_create_429=0.3, p_tool_error=0.5)

    def draws() -> list[object]:
        faults = FaultInjector(profile)
        return [(faults.create_outcome(0), faults.chance(0.5)) for _ in range(50)]

    assert draws() == draws()
    other = FaultInjector(profile.model_copy(update={"seed": 43}))
    assert [(other.create_outcome(0), other.chance(0.5)) for _ in range(50)] != draws()


def test_shipped_profiles_load_and_chaos_turns_every_fault_on() -> None:
    from fleetroll.settings import load_settings

    emulator = load_settings().emulator
    assert {"clean", "realistic", "chaos"} <= set(emulator.profiles)
    chaos = emulator.fault_profile("chaos")
    for knob in (
        "p_create_5xx",
        "p_create_429",
        "p_create_hang",
        "p_tool_hang",
        "p_tool_error",
        "p_reset_hang",
        "p_instance_death",
        "mcp_warmup_s",
    ):
        assert getattr(chaos, knob) > 0, knob
    assert emulator.fault_profile("clean") == FaultProfile()


def test_the_shipped_profiles_hang_creates_for_less_than_a_minute() -> None:
    """A profile meant for trying faults must not hold a rollout for the create
    timeout (900 s): its hung creates answer soon and are retried."""
    from fleetroll.settings import load_settings

    profiles = load_settings().emulator.profiles
    assert {"clean", "realistic", "chaos"} <= set(profiles)
    for name, profile in profiles.items():
        if profile.p_create_hang:
            assert profile.create_hang_s <= 60, name


async def test_a_hanging_tool_call_ends_on_the_emulator_once_its_client_gives_up(sdk) -> None:
    async with Emulator(FaultProfile(p_tool_hang=1.0, tool_hang_s=3600)) as emu:
        env = await sdk(emu).make("ledger")
        # Observes the MCP requests the emulator is still serving (instrumentation only).
        handle, in_flight, drained = emu.app.mcp.handle, [0], anyio.Event()

        async def watched(*args) -> None:
            in_flight[0] += 1
            try:
                await handle(*args)
            finally:
                in_flight[0] -= 1
                if not in_flight[0] and emu.ledger.tool_calls_by_outcome["hang"]:
                    drained.set()

        emu.app.mcp.handle = watched
        async with Client(env.mcp.url) as session:
            with pytest.raises(MCPError):
                await session.call_tool("list_accounts", {}, read_timeout_seconds=0.3)
        # The hour-long hang ends with the client's connection, not in an hour.
        with anyio.fail_after(10):
            await drained.wait()
        await env.close()

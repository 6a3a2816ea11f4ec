"""Admission control against the embedded emulator (real HTTP, real MCP sessions)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import anyio
import httpx
import pytest
from fleet._async.client import AsyncFleet
from fleet._async.exceptions import FleetInstanceLimitError

from fleetroll.emulator import Emulator
from fleetroll.policies import ScriptedPolicy
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.results import FailureReason
from fleetroll.service.metrics import Metrics
from fleetroll.settings import config_dir, load_settings
from fleetroll.settings.fault_profiles import FaultProfile, Latency
from fleetroll.tasks import load_tasks
from fleetroll.telemetry import Events, MemorySink

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

SETTINGS = load_settings()
LEDGER = load_tasks(config_dir() / "tasks" / "ledger.jsonl", modalities=SETTINGS.modalities)
DESKTOP = load_tasks(config_dir() / "tasks" / "desktop.jsonl", modalities=SETTINGS.modalities)
FAST = {
    "creates_per_second": 1000,
    "max_concurrent_creates": 64,
    "backoff_initial_s": 0.05,
    "backoff_max_s": 0.5,
}


def pool_for(emu: Emulator, sink: MemorySink, **overrides: Any) -> RolloutPool:
    settings = load_settings(**{"provisioning": FAST, **overrides})
    return RolloutPool(settings, api_key=emu.api_key, base_url=emu.base_url, events=Events([sink]))


@pytest.mark.parametrize("account_limit", [True, False], ids=["read-at-start", "learnt-from-403"])
async def test_a_batch_of_40_on_an_account_limited_to_5_never_passes_it_and_none_fails(
    account_limit: bool,
) -> None:
    profile = FaultProfile(instance_limit=5, create_latency=Latency(min_s=0.01, max_s=0.03))
    sink = MemorySink()
    async with Emulator(profile) as emu:
        async with pool_for(emu, sink, admission={"account_limit": account_limit}) as pool:
            with anyio.fail_after(240):
                results = await pool.run_batch(
                    LEDGER[:20], ScriptedPolicy(), samples_per_task=2
                ).results()
            state = pool.admission.state()
        # The emulator's own count of running instances, at its highest.
        assert emu.ledger.peak_running <= 5
        assert emu.ledger.running == 0
        refused = emu.ledger.creates_by_outcome["instance_limit"]
    assert len(results) == 40
    reasons = Counter(r.failure_reason for r in results)
    assert reasons[FailureReason.INIT_ERROR] == 0, [r.error for r in results if r.error][:3]
    assert all(r.status == "completed" for r in results)
    assert state.limit == 5 and state.in_use == 0 and state.queued == 0
    if account_limit:
        assert refused == 0  # read at start: no create was ever refused
    else:
        assert refused > 0  # learnt from the 403s, which cost no rollout
        assert not sink.named("fleet_make_failed")


async def test_a_broken_environment_is_quarantined_while_a_healthy_one_runs_on() -> None:
    profile = FaultProfile(broken_envs=("desktop:v1",))
    sink = MemorySink()
    async with Emulator(profile) as emu:
        async with pool_for(
            emu,
            sink,
            retries={"mcp_connect_attempts": 1},
            admission={
                # One desktop instance at a time: the breaker sees each failure in turn.
                "env": {"desktop:v1": {"max_instances": 1}},
                "breaker": {
                    "window": 4,
                    "min_rollouts": 4,
                    "failure_share": 0.75,
                    "on_open": "fail",
                    "probe_interval_s": 3600,
                },
            },
        ) as pool:
            tasks = [*LEDGER[:9], *DESKTOP[:9]]
            with anyio.fail_after(240):
                results = await pool.run_batch(tasks, ScriptedPolicy()).results()
            state = pool.admission.state()
        assert emu.ledger.running == 0
        desktop_creates = emu.ledger.creates_by_env["desktop"]
    by_env: dict[str, Counter[str | None]] = {"ledger": Counter(), "desktop": Counter()}
    for r in results:
        env = "desktop" if r.task_key.startswith("desktop") else "ledger"
        by_env[env][r.failure_reason.value if r.failure_reason else None] += 1
    assert by_env["ledger"] == Counter({None: 9})  # the healthy one ran on
    assert by_env["desktop"] == Counter({"init_error": 4, "env_unavailable": 5})
    assert desktop_creates == 4  # quarantined: no instance made for the rest
    [event] = sink.named("fleet_env_quarantined")
    assert event.attributes["env_key"] == "desktop"
    assert event.attributes["env_version"] == "v1"
    assert event.attributes["failure_share"] == 1.0
    assert not sink.named("fleet_env_recovered")
    assert state.open_breakers == 1
    metrics = Metrics().render(in_flight=0, sessions_open=0, batches={}, admission=state)
    assert "fleetroll_admission_open_breakers 1" in metrics.splitlines()


async def test_the_emulators_limit_counts_instances_still_starting_and_account_reports_it() -> None:
    profile = FaultProfile(instance_limit=2, create_latency=Latency(min_s=0.3))
    async with Emulator(profile) as emu, httpx.AsyncClient(timeout=60) as client:
        fleet = AsyncFleet(
            api_key=emu.api_key, base_url=emu.base_url, max_retries=0, httpx_client=client
        )
        outcomes: list[object] = []

        async def make() -> None:
            try:
                outcomes.append(await fleet.make("ledger"))
            except FleetInstanceLimitError as exc:
                outcomes.append(exc)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for _ in range(4):  # all sent while the first ones are still starting
                    tg.start_soon(make)
            account = await fleet.account()
            made = [o for o in outcomes if not isinstance(o, FleetInstanceLimitError)]
            refused = [o for o in outcomes if isinstance(o, FleetInstanceLimitError)]
            assert len(made) == 2 and len(refused) == 2
            assert all(e.instance_limit == 2 for e in refused)
            assert (account.instance_limit, account.instance_count) == (2, 2)
            assert emu.ledger.peak_running == 2
            for env in made:
                await env.close()  # type: ignore[attr-defined]


async def test_a_quarantined_environment_that_heals_recovers_through_a_probe_and_runs_on() -> None:
    profile = FaultProfile(broken_envs=("desktop:v1",))
    sink = MemorySink()
    async with Emulator(profile) as emu:

        class HealOnQuarantine:
            """Mends the environment the moment its breaker opens (no sleeps, no polling)."""

            def emit(self, event: Any) -> None:
                if event.name == "fleet_env_quarantined":
                    emu.app.faults.profile = profile.model_copy(update={"broken_envs": ()})

        settings = load_settings(
            provisioning=FAST,
            retries={"mcp_connect_attempts": 1},
            admission={
                "env": {"desktop:v1": {"max_instances": 1}},
                "breaker": {
                    "window": 4,
                    "min_rollouts": 4,
                    "failure_share": 0.75,
                    "on_open": "wait",
                    "probe_interval_s": 0.1,
                },
            },
        )
        events = Events([sink, HealOnQuarantine()])
        async with RolloutPool(
            settings, api_key=emu.api_key, base_url=emu.base_url, events=events
        ) as pool:
            with anyio.fail_after(240):
                results = await pool.run_batch(DESKTOP[:8], ScriptedPolicy()).results()
            state = pool.admission.state()
        assert emu.ledger.running == 0
    reasons = Counter(r.failure_reason for r in results)
    assert reasons[FailureReason.INIT_ERROR] == 4  # until the breaker opened
    assert reasons[FailureReason.ENV_UNAVAILABLE] == 0  # "wait": nobody failed fast
    assert len(results) == 8
    breaker = ("fleet_env_quarantined", "fleet_env_recovered")  # not fleet_env_created
    assert [e.name for e in sink.events if e.name in breaker] == [
        "fleet_env_quarantined",
        "fleet_env_recovered",
    ]
    assert state.open_breakers == 0

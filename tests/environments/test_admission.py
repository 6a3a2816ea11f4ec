"""The admission controller's bookkeeping, in-process (no emulator, no sleeps)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from fleetroll.environments.admission import AdmissionController, CreateLimits, Ticket
from fleetroll.errors import EnvUnavailableError
from fleetroll.results import FailureReason
from fleetroll.service.metrics import Metrics
from fleetroll.settings import load_settings
from fleetroll.telemetry import Events, MemorySink

pytestmark = pytest.mark.anyio

INIT = FailureReason.INIT_ERROR


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def controller(**admission: Any) -> tuple[AdmissionController, MemorySink, Clock]:
    sink = MemorySink()
    clock = Clock()
    settings = load_settings(admission=admission)
    limits = CreateLimits.from_settings(settings.provisioning)
    return AdmissionController(settings.admission, limits, Events([sink]), clock=clock), sink, clock


async def admitted_later(ctl: AdmissionController, env: str, into: list[Ticket]) -> None:
    into.append(await ctl.acquire(env))


async def test_instances_still_starting_count_against_the_cap() -> None:
    ctl, _, _ = controller(max_instances=2, account_limit=False)
    first = await ctl.acquire("ledger:v1")
    await ctl.acquire("ledger:v1")  # neither has started yet
    late: list[Ticket] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(admitted_later, ctl, "ledger:v1", late)
            await anyio.wait_all_tasks_blocked()
            assert late == []
            state = ctl.state()
            assert (state.limit, state.in_use, state.starting, state.queued) == (2, 2, 2, 1)
            ctl.started(first)
            assert ctl.state().starting == 1
            ctl.release(first)
    assert len(late) == 1 and ctl.state().in_use == 2 and ctl.state().queued == 0


async def test_a_release_given_twice_frees_one_place() -> None:
    ctl, _, _ = controller(max_instances=3)
    ticket = await ctl.acquire("ledger:v1")
    ctl.started(ticket)
    ctl.release(ticket)
    ctl.release(ticket)
    assert ctl.state().in_use == 0 and ctl.state().starting == 0


async def test_a_per_environment_cap_holds_only_its_environment() -> None:
    ctl, _, _ = controller(env={"desktop": {"max_instances": 1}})
    await ctl.acquire("desktop:v1")
    late: list[Ticket] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(admitted_later, ctl, "desktop:v1", late)
            for _ in range(5):  # another environment is not held up
                await ctl.acquire("ledger:v1")
            await anyio.wait_all_tasks_blocked()
            assert late == [] and ctl.state().queued == 1
            tg.cancel_scope.cancel()


async def test_the_account_limit_counts_other_clients_instances() -> None:
    ctl, _, _ = controller()
    ctl.learn_account(5, 2)  # two instances of someone else's
    assert ctl.limit == 3
    ctl.learn_account(-1, 7)  # Fleet's "no limit"
    assert ctl.limit is None
    ctl, _, _ = controller(max_instances=2)
    ctl.learn_account(10, 0)
    assert ctl.limit == 2  # the lower of the two


async def test_a_create_refused_for_the_limit_waits_for_a_release_then_gets_its_place() -> None:
    ctl, _, _ = controller()
    running = [await ctl.acquire("ledger:v1") for _ in range(3)]
    for ticket in running:
        ctl.started(ticket)
    refused = await ctl.acquire("ledger:v1")
    done = anyio.Event()

    async def retry() -> None:
        await ctl.limit_reached(refused, instance_limit=3, running=3)
        done.set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(retry)
            await anyio.wait_all_tasks_blocked()
            assert not done.is_set()
            assert ctl.limit == 3 and ctl.state().in_use == 3 and ctl.state().queued == 1
            ctl.release(running[0])
            await done.wait()
    assert not refused.released and ctl.state().in_use == 3


def trip(ctl: AdmissionController, env: str = "desktop:v1", n: int = 4) -> None:
    for _ in range(n):
        ctl.record(env, INIT)


async def test_the_breaker_opens_on_the_share_of_infrastructure_failures() -> None:
    ctl, sink, _ = controller(
        breaker={"window": 4, "min_rollouts": 4, "failure_share": 0.5, "on_open": "fail"}
    )
    ctl.record("desktop:v1", None)
    ctl.record("desktop:v1", FailureReason.POLICY_ERROR)  # the model's fault, not the env's
    ctl.record("desktop:v1", FailureReason.CANCELLED)  # says nothing: not counted
    ctl.record("desktop:v1", INIT)
    assert ctl.quarantined() == []
    ctl.record("desktop:v1", FailureReason.TOOLS_ERROR)  # 2 of the last 4
    assert ctl.quarantined() == ["desktop:v1"]
    [event] = sink.named("fleet_env_quarantined")
    assert event.attributes["env_key"] == "desktop"
    assert event.attributes["env_version"] == "v1"
    assert event.attributes["failure_share"] == 0.5 and event.attributes["window"] == 4
    with pytest.raises(EnvUnavailableError):
        await ctl.acquire("desktop:v1")
    await ctl.acquire("ledger:v1")  # another environment runs on
    assert ctl.state().open_breakers == 1 and ctl.state().queued == 0


async def test_one_probe_at_a_time_tests_recovery_and_its_success_closes_the_breaker() -> None:
    ctl, sink, clock = controller(
        breaker={"window": 4, "min_rollouts": 4, "on_open": "fail", "probe_interval_s": 30}
    )
    trip(ctl)
    clock.now = 31.0
    probe = await ctl.acquire("desktop:v1")
    assert probe.probe
    with pytest.raises(EnvUnavailableError):
        await ctl.acquire("desktop:v1")  # one probe at a time
    ctl.release(probe)
    ctl.record("desktop:v1", INIT)  # the probe failed: still open, next probe later
    with pytest.raises(EnvUnavailableError):
        await ctl.acquire("desktop:v1")
    clock.now = 62.0
    probe = await ctl.acquire("desktop:v1")
    ctl.release(probe)
    ctl.record("desktop:v1", None)
    assert ctl.quarantined() == []
    assert [e.attributes["env_key"] for e in sink.named("fleet_env_recovered")] == ["desktop"]
    ticket = await ctl.acquire("desktop:v1")
    assert not ticket.probe


async def test_in_wait_mode_new_rollouts_wait_for_the_breaker_to_close() -> None:
    ctl, _, _ = controller(breaker={"window": 4, "min_rollouts": 4, "probe_interval_s": 1e6})
    trip(ctl)
    late: list[Ticket] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(admitted_later, ctl, "desktop:v1", late)
            await anyio.wait_all_tasks_blocked()
            assert late == [] and ctl.state().queued == 1
            ctl.record("desktop:v1", None)  # a rollout admitted before it opened succeeded
    assert len(late) == 1 and ctl.quarantined() == []


async def test_the_metrics_show_admissions_gauges() -> None:
    ctl, _, _ = controller(max_instances=4, breaker={"window": 4, "min_rollouts": 4})
    started = await ctl.acquire("ledger:v1")
    ctl.started(started)
    await ctl.acquire("ledger:v1")
    trip(ctl)
    text = Metrics().render(in_flight=0, sessions_open=0, batches={}, admission=ctl.state())
    for line in (
        "fleetroll_admission_limit 4",
        "fleetroll_admission_in_use 2",
        "fleetroll_admission_starting 1",
        "fleetroll_admission_queued 0",
        "fleetroll_admission_open_breakers 1",
    ):
        assert line in text.splitlines()


async def test_other_clients_instances_are_presumed_gone_after_the_recheck_interval() -> None:
    ctl, _, clock = controller(limit_recheck_s=10)
    ctl.learn_account(3, 3)  # someone else holds the whole account
    assert ctl.limit == 0
    late: list[Ticket] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(admitted_later, ctl, "ledger:v1", late)
            await anyio.wait_all_tasks_blocked()
            assert late == [] and ctl.state().queued == 1
            clock.now = 11.0
            assert (await ctl.acquire("ledger:v1")).env == "ledger:v1"  # tried again
            assert ctl.limit == 3
            tg.cancel_scope.cancel()
